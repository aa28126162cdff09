"""bench/compare.py: the table's cells are medians of the rounds with the right "better";
without PyTorch the command says so in one line; with it, its module twin of the GPT
computes minidist's loss and gradients, and a short run prints every row."""

import numpy as np
import pytest

from minidist.bench import autograd as ag
from minidist.bench import compare
from minidist.bench.compare import Measures
from minidist.nn import GPT, GPTConfig


def _m(scale: float) -> Measures:
    return Measures({"8 B": 5e-6 * scale, "16 MiB": 4e-3 * scale}, alone=0.15, ddp=0.16 * scale,
                    zero3=0.2 * scale, one_rank=0.1 * scale)


def test_table_cells_are_medians_and_better_follows_each_row_s_direction():
    ours = [_m(1.0), _m(3.0), _m(1.1)]                    # medians: _m(1.1)
    theirs = [_m(2.0)] * 3
    lines = compare.table(ours, theirs).splitlines()
    assert len(lines) == 1 + len(compare.ROWS)
    row = {line[:52].strip(): line.split() for line in lines[1:]}
    assert row["all_reduce 8 B, 2 ranks"][-7:] == ["5.50", "us", "10.00", "us", "gloo", "0.55",
                                                   "minidist"]
    # alone / ddp: ours 0.15 / 0.176 = 0.85 (the median), theirs 0.15 / 0.32 = 0.47
    dp = row["data parallelism's own cost, t(2 alone) / t(dp=2)"]
    assert dp[-2:] == [f"{(0.15 / 0.176) / (0.15 / 0.32):.2f}", "minidist"]   # higher: better
    assert row["ZeRO-3 step / DDP step, dp=2"][-2:] == ["1.00", "same"]      # 1.25 both


def test_without_pytorch_one_line_and_exit_0(monkeypatch, capsys):
    monkeypatch.setattr(ag, "have_torch", lambda: False)
    assert compare.main(["--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "PyTorch is not installed" in out


def test_the_torch_module_twin_matches_minidist_loss_and_gradients():
    torch = pytest.importorskip("torch")
    cfg = GPTConfig(vocab_size=7, block_size=6, n_layer=2, n_head=2, n_embd=8)   # float64
    model = GPT(cfg, seed=3)
    x, y = ag.make_batch(cfg, seed=1, batch=3)
    _, loss = model(x, y)
    loss.backward()
    twin = compare.torch_gpt(cfg, model.state_dict())
    ref = twin(torch.tensor(x), torch.tensor(y))
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-13)
    grads = {n: p.grad for n, p in model.named_parameters()}
    names = [n for n in model.state_dict() if not n.startswith("blocks.")]
    for i in range(cfg.n_layer):
        names += [n for n in model.state_dict() if n.startswith(f"blocks.{i}.")]
    got = [p.grad.numpy() for p in twin.parameters()]
    assert len(got) == len(grads)
    for name in grads:                                         # by minidist's name
        holder = twin if not name.startswith("blocks.") else twin.blocks[int(name.split(".")[1])]
        prefix = "" if holder is twin else ".".join(name.split(".")[:2]) + "."
        theirs = holder.p[name[len(prefix):].replace(".", "/")].grad.numpy()
        np.testing.assert_allclose(grads[name], theirs, rtol=0, atol=1e-13, err_msg=name)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_short_run_prints_every_row(capsys):
    pytest.importorskip("torch")
    assert compare.main(["--rounds", "1", "--steps", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    for label, *_ in compare.ROWS:
        assert label in out
