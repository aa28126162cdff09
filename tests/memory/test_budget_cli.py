"""`python -m minidist memory` (budget_cli.main) and the --fit search (budget_fit): sizes,
plans, the tables, the verdict and the exit codes. The --fit search over the GPT-3 presets
(~4 s) is `-m slow`; test_fit_keeps_what_fits_sorted_by_traffic covers fit() by default."""

import pytest

from minidist.memory import budget as mb
from minidist.memory import budget_fit as bf
from minidist.memory.budget_cli import main, parse_plan, parse_size, print_comparison
from minidist.memory.budget_models import preset
from minidist.nn import GPTConfig
from minidist.parallel.tensor import memory as tm

SMALL = GPTConfig(vocab_size=11, block_size=12, n_layer=4, n_head=4, n_embd=32)


@pytest.mark.parametrize("text, expected", [("141GB", 141 * 10**9), ("64MB", 64 * 10**6),
                                            ("1.5GiB", 3 * 2**29), ("2 KiB", 2048),
                                            ("4096", 4096), ("10b", 10), ("1e3kB", 10**6)])
def test_sizes_are_si_or_iec_as_written(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "141XB", "-1GB", "0", "1,5GB"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match="positive number of bytes"):
        parse_size(text)


def test_plan_strings():
    assert parse_plan("dp=2, tp=2,sp=1,zero=1,recompute=selective,precision=bf16,mb=4") == \
        mb.MemoryPlan(dp=2, tp=2, sp=True, zero=1, recompute="selective", precision="bf16",
                      micro_batches=4)
    assert parse_plan("") == mb.MemoryPlan()
    for bad, match in (("ep=2", "not modelled"), ("dq=2", "key=value"), ("dp=two", "int"),
                       ("zero=4", "zero=4"), ("dp", "key=value")):
        with pytest.raises(ValueError, match=match):
            parse_plan(bad)


def test_estimate_of_a_preset(capsys):
    assert main(["--model", "gpt3-13b", "--plan", "tp=8,sp=1,precision=bf16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("memory budget · gpt3-13b (12.85B parameters) · dp=1 tp=8+sp")
    assert [line.split()[0] for line in out[2:9]] == [*mb.CATEGORIES, "total"]


def test_pipeline_estimate_has_a_column_per_stage(capsys):
    assert main(["--plan", "pp=2,mb=2"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["per", "rank", "stage", "0",
                                                               "stage", "1"]


@pytest.mark.parametrize("argv, match", [
    (["--plan", "dp=3", "--batch", "4"], "multiple of 3"),
    (["--model", "gpt3-13b", "--measure"], "--model tiny"),
    (["--device-memory", "1GB"], "goes with --fit"),
    (["--fit"], "needs --device-memory"),
    (["--model", "gpt4"], "presets"),
    (["--plan", "precision=bf16", "--measure"], "precision=fp64"),
    (["--device-memory", "lots", "--fit"], "positive number of bytes"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, match, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:                  # argparse's own errors (a bad --device-memory)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert match in err


@pytest.mark.multiproc
def test_measure_prints_both_and_ends_ok(capsys):
    assert main(["--plan", "dp=2,zero=2,mb=2", "--measure"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("OK: estimated bytes match measured"), out
    assert sum(line.startswith("0     ") for line in out) == len(mb.CATEGORIES)


def test_a_wrong_estimate_is_a_mismatch(capsys):
    rows = {0: {"params": (100, 100), "activations": (104, 100), "recompute": (7, 7)}}
    assert print_comparison(rows) == 0                  # 4% of activations: within 5%
    rows[0]["params"] = (100, 101)
    assert print_comparison(rows) == 1
    assert capsys.readouterr().out.splitlines()[-1] == \
        "MISMATCH: estimated bytes differ from measured: stage 0 params: 100 vs 101"
    rows[0]["params"], rows[0]["activations"] = (100, 100), (106, 100)
    assert print_comparison(rows) == 1


# --- --fit --------------------------------------------------------------------------------

def test_fit_keeps_what_fits_sorted_by_traffic():
    everything, valid = bf.fit(SMALL, 4, 1e12, batch=8)
    assert len(everything) == valid > 20                  # plenty of memory: all valid plans
    totals = sorted(f.estimate.total for f in everything)
    limit = totals[len(totals) // 2]                      # about half of them fit
    some, _ = bf.fit(SMALL, 4, limit, batch=8)
    assert 0 < len(some) < valid
    assert all(f.estimate.total <= limit for f in some)
    keys = [(f.comm["total"], mb.RECOMPUTE.index(f.plan.recompute), f.estimate.total)
            for f in some]
    assert keys == sorted(keys)
    assert all(f.plan.world_size == 4 and f.plan.cp == 1 for f in some)
    assert bf.fit(SMALL, 4, 1, batch=8)[0] == []


def test_fit_lists_zero3_with_every_recompute_and_no_sharding_on_one_replica():
    plans = bf.candidates(8, 8)
    z3 = {p.recompute for p in plans if p.zero == 3}
    assert z3 == set(mb.RECOMPUTE)
    assert not [p for p in plans if p.dp == 1 and p.zero > 0]
    assert not [p for p in plans if p.pp > 1 and p.zero == 3]


def test_communication_closed_forms():
    psi, b = sum(bf.unit_numels(SMALL)), 2
    ddp = bf.comm_bytes(SMALL, mb.MemoryPlan(dp=4, precision="bf16"), 8, 12)
    assert ddp == {"dp": 2 * psi * 3 / 4 * b, "tp": 0, "pp": 0, "total": 2 * psi * 3 / 4 * b}
    tp = bf.comm_bytes(SMALL, mb.MemoryPlan(tp=2, precision="bf16"), 8, 12)
    layer = tm.megatron_layer_bytes(8, 12, 32, 2, b)        # 4 all-reduces of B T C
    assert tp["tp"] == (SMALL.n_layer + 0.5) * layer and tp["dp"] == tp["pp"] == 0
    pp = bf.comm_bytes(SMALL, mb.MemoryPlan(pp=4, micro_batches=8, precision="bf16"), 8, 12)
    assert pp["pp"] == 8 * 2 * (1 * 12 * 32 * b)            # a middle stage: both ways


@pytest.mark.slow
def test_fit_command_answers_the_h200_question(capsys):
    assert main(["--fit", "--model", "gpt3-175b", "--device-memory", "141GB",
                 "--gpus", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "0 of" in out[0] and out[-1].startswith("no plan fits")
    assert main(["--fit", "--model", "gpt3-1.3b", "--device-memory", "141GB", "--gpus", "8",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[0] == "plan" and len(out) == 6 and out[-1].startswith("... ")
    fits, _ = bf.fit(preset("gpt3-1.3b"), 8, 141e9, batch=8)
    assert out[2].startswith(fits[0].plan.describe())
