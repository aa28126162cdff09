"""The expert-parallel rows of the training benchmark (`bench train --ep W`): the bytes sent
over the ep group are the all-to-alls of parallel/expert/'s formula (take_traffic) plus
the gradient norm's all_gather, exactly, on every rank and every step; the table prints
them next to each other with the gradient-sync bytes and the routing's load imbalance.
Nothing here looks at a time: only that the columns are there and positive.

The default run checks the bytes in process; the command's table (~0.4 s) is in the slow
set."""

import numpy as np
import pytest

from minidist.bench import train as bench
from minidist.bench import train_layouts as lay
from minidist.data import DataConfig, model_config_for
from minidist.runtime.launch import spawn
from minidist.train import Plan

DATA = DataConfig(task="sort", length=4)                                  # T = 8
CFG = model_config_for(DATA, n_layer=2, n_embd=16, n_head=2, dtype="float32", moe_every=1,
                       n_experts=4, top_k=2)
EP_ARGS = ["--ep", "2", "--steps", "1", "--warmup", "1", "--repeats", "1", "--batch", "4",
           "--n-embd", "16", "--n-head", "2", "--length", "4", "--dtype", "float64"]
HEADER = ["run", "ranks", "tokens/s", "ratio", "step", "ms", "cpu", "ms", "ep", "sent", "a2a",
          "formula", "norm", "check", "dp", "sync", "2(D-1)/D", "Ψd", "edp", "sync",
          "2(R-1)/R", "Ψe", "kept", "max/mean", "drop"]


@pytest.mark.multiproc
def test_ep_bytes_equal_take_traffic_plus_the_norm_on_every_rank_and_step():
    plan = Plan(dp=2, ep=2, check_placements=False)        # placement digests: traffic too
    runs = spawn(2, lay._ep_on_rank, CFG, DATA, plan, 2, 4)
    for rank, (timing, by_axis, formula, moe) in enumerate(runs):
        sent = [b["ep"] for b in by_axis]
        assert len(formula) == 2 and all(f > 0 for f in formula), f"rank {rank}: {formula}"
        assert sent == [f + 8 for f in formula], f"rank {rank}: ep sent {sent}, formula " \
            f"{formula} + one float64 of the norm's all_gather"
        assert by_axis[0]["edp"] == 0                      # edp = dp / ep = 1: no replicas
    row = lay.measure_ep("dp=2 ep=2", CFG, DATA, plan, steps=1, warmup=1, batch=4, W=2)
    assert row.exact and row.a2a_formula > 0 and row.norm == 2 * 8
    assert row.ep_sent == row.a2a_formula + row.norm
    dense, _ = lay._ep_params(CFG, 2)
    assert row.dp_sync == dense * 4                        # 2(D-1)/D Ψ_dense x 4 B at D = 2
    assert row.imbalance >= 1 and 0 <= row.drop < 1 and len(row.kept) == CFG.n_layer


@pytest.mark.slow
@pytest.mark.multiproc
def test_cli_prints_the_ep_table(capsys):
    assert bench.main(EP_ARGS) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "$ python -m minidist bench train " + " ".join(EP_ARGS)
    assert "E=4, top-2" in lines[1] and "float64" in lines[1]
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    assert lines[start].split() == HEADER
    rows = {line[:20].strip(): line[20:].split() for line in lines[start + 1:start + 4]}
    assert list(rows) == ["dp=1", "dp=2", "dp=2 ep=2"] and rows["dp=1"][2] == "1.00"
    num = lambda cell: int(cell.replace(",", ""))                        # noqa: E731
    for name, cells in rows.items():
        tokens, _, step, cpu = map(float, cells[1:5])
        assert tokens > 0 and step > 0 and cpu > 0, name
        ep, a2a, norm = num(cells[5]), num(cells[6]), num(cells[7])
        assert cells[8] == "OK" and ep == a2a + norm, name
        assert (ep > 0) == (name == "dp=2 ep=2"), name
        assert (num(cells[9]), num(cells[11])) == (num(cells[10]), num(cells[12])), name
        assert float(cells[13]) >= 1 and cells[14].endswith("%"), name
    assert num(rows["dp=2"][9]) > num(rows["dp=2 ep=2"][9]) > 0     # experts left dp sync
    notes = "\n".join(lines[start + 4:])
    assert "tokens kept per ep rank" in notes and "target (issue)" in notes


def test_bad_ep_arguments_are_refused():
    for args in (["--ep", "2", "--tp", "2"], ["--ep", "2", "--zero", "1"],
                 ["--ep", "3"],                                      # 4 experts, 3 ranks
                 ["--ep", "2", "--dp", "3"], ["--ep", "0"], ["--ep", "2", "--top-k", "5"]):
        with pytest.raises(SystemExit):
            bench.main(args)


def test_imbalance_is_per_ep_rank():
    kept = lay._kept_per_rank({"blocks.0.moe": {"kept": [3, 1, 2, 2]}}, 2)
    assert [k.tolist() for k in kept] == [[4, 4]]
    assert np.array_equal(lay._kept_per_rank({"m": {"kept": [3, 1, 2, 2]}}, 4)[0], [3, 1, 2, 2])
