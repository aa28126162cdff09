"""train_options.py: every rule of `train` checked before any rank starts, in flags; the
defaults a layout needs; an explicit flag never changed; every suggested fix accepted."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest

from minidist import train_cli, train_options
from minidist.reliability import recovery

REFUSED = [   # (options, what the one line must say): each refused before any rank starts
    (["--cp", "2", "--moe-every", "1", "--deterministic"],
     r"not yet --cp 2 with MoE blocks \(--moe-every 1\)"),
    (["--dp", "2", "--deterministic", "--grain", "5"], r"use --grain 4 \(a divisor of 16\)"),
    (["--cp", "2", "--deterministic", "--token-tiles", "2"],
     r"--token-tiles 2: cp rank 0 holds positions 0\.\.11 of T=12, not whole runs of"),
    (["--cp", "2", "--tp", "4", "--sp", "--length", "8", "--deterministic", "--token-tiles",
      "4"], r"cp rank 0, tp rank 0 holds positions 0\.\.1 .* use --token-tiles 8 \(the fewest"),
    (["--pp", "5", "--n-layer", "2"], r"--n-layer 2 is fewer than .* use --n-layer 5"),
    (["--sp"], r"--sp splits the sequence .* give --tp > 1"),
    (["--length", "5", "--cp", "4"], r"T=10 positions; --cp 4 \(zigzag\) .* use --length 8"),
    (["--task", "add", "--cp", "4"], r"--task add makes sequences of T=3 .* use --cp 1$"),
    (["--ep", "2"], r"has none \(--moe-every 0\); use --moe-every 1"),
    (["--ep", "3", "--moe-every", "1", "--batch", "30"], r"use --n-experts 6"),
    (["--dp", "1", "--ep", "2", "--moe-every", "1"], r"--ep 2 must divide --dp 1.* use --dp 2"),
    (["--lr", "inf"], r"--lr: must be a finite number"),
    (["--check", "--dtype", "float32"], r"drop --dtype float32"),
    (["--dp", "3"], r"--batch 32 does not split over --dp 3 x --grad-accum 1 .* use --batch "
                    r"30 or --batch 33"),
    (["--pp", "2", "--grad-accum", "5"], r"use --batch 30 or --batch 35 or --grad-accum 4"),
    (["--tp", "3"], r"--tp 3 splits attention by heads, but --n-head 4"),
    (["--checkpoint-every", "0"], r"--checkpoint-every: must be an int >= 1"),
    (["--dp", "2", "--run-dir", "/etc/passwd"], r"--run-dir /etc/passwd: is a file"),
    (["--length", "100000000"], r"need at least .* GiB .* more than this machine's"),
    (["--n-embd", "400000", "--pp", "1000", "--batch", "1000000000"], r"need at least"),
    (["--dp", "4", "--ranks-per-node", "3"],
     r"--ranks-per-node 3 does not divide the layout's 4 ranks into nodes; use one of \[1, 2, 4\]"),
    (["--dp", "2", "--ranks-per-node", "1", "--inter-gbs", "0"], r"--inter-gbs 0.0 > 0"),
    (["--dp", "2", "--ranks-per-node", "1", "--dry-run"], r"a --dry-run times no link"),
    (["--dp", "2", "--local-steps", "2", "--check"], r"not meant to equal; drop one"),
    (["--dp", "2", "--local-steps", "2", "--zero", "1"], r"not with --zero 1; use --local-steps 0"),
    (["--dp", "4", "--zero", "1", "--hsdp", "3"], r"use --hsdp 2 or --hsdp 4"),
    (["--dp", "2", "--onebit-adam", "5", "--optimizer", "sgd"], r"Use --optimizer adamw"),
    (["--dp", "2", "--onebit-adam", "5", "--check"], r"--onebit-adam 5 \(not an exact"),
]


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank would start."""
    def started(*args, **kwargs):
        raise AssertionError("a rank started")
    monkeypatch.setattr(recovery, "run", started)


@pytest.mark.parametrize("argv, says", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_options_that_make_no_job_are_one_line_in_flags_before_any_rank(argv, says, capsys,
                                                                        no_ranks):
    try:
        code = train_cli.main(argv + ["--steps", "1"])
    except SystemExit as e:                  # argparse's refusals: a value out of range
        code = e.code
    assert code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(says, err.strip()), err
    for field in ("micro_batches", "cp_layout", "global_batch", "sequence_parallel", "Plan:"):
        assert field not in err, err                       # the flags typed, not the fields


def _fixes(message: str) -> list[list[str]]:
    """The fixes a message suggests ('; use --batch 30 or --batch 33'), as option changes."""
    found = re.search(r"; use (.*)$", message)
    return [] if found is None else [fix.split() for fix in found.group(1).split(" or ")]


@pytest.mark.parametrize("argv, suggests", [
    (["--dp", "3"], 2), (["--pp", "2", "--grad-accum", "5"], 3),
    (["--length", "5", "--cp", "4"], 2), (["--task", "add", "--cp", "4"], 1),
    (["--length", "7", "--cp", "2", "--tp", "2", "--sp"], 2),   # not --cp-layout contiguous
    # no one change fixes both the batch and the positions: no fix is offered
    (["--length", "3", "--cp", "2", "--dp", "3", "--batch", "12", "--grad-accum", "5"], 0)])
def test_every_fix_a_refusal_suggests_is_accepted(argv, suggests):
    with pytest.raises(train_options.OptionError) as refused:
        train_options.resolve(train_cli._arguments().parse_args(argv))
    fixes = _fixes(str(refused.value))
    assert len(fixes) == suggests, str(refused.value)
    for fix in fixes:
        changed = [v for v in argv if v != "--sp"] if fix == ["no", "--sp"] else argv + fix
        train_options.resolve(train_cli._arguments().parse_args(changed))  # no error


def _resolve(argv):
    a = train_cli._arguments().parse_args(argv)
    return a, train_options.resolve(a)


def test_pp_picks_micro_batches_that_split_the_batch_and_says_where_they_come_from():
    a, job = _resolve(["--pp", "3"])
    assert job.plan.micro_batches == 8 and a.grad_accum == 8      # 32 rows: 8 is nearest 6
    assert any("--grad-accum 8 (default under --pp 3)" in n for n in job.notes), job.notes
    a, job = _resolve(["--pp", "2"])
    assert job.plan.micro_batches == 4                            # 2 x pp divides 32
    assert _resolve(["--pp", "4", "--dp", "2"])[1].plan.micro_batches == 8


def test_an_explicit_flag_is_never_overridden():
    assert _resolve(["--pp", "2", "--grad-accum", "1"])[1].plan.micro_batches == 1
    assert _resolve(["--pp", "2", "--n-layer", "3"])[1].cfg.n_layer == 3
    assert _resolve(["--check", "--dtype", "float64"])[1].cfg.dtype == "float64"
    with pytest.raises(train_options.OptionError, match="--n-layer 2 is fewer"):
        _resolve(["--pp", "4", "--n-layer", "2"])


def test_the_defaults_a_layout_needs_are_filled_in_with_a_note():
    a, job = _resolve(["--pp", "4"])
    assert job.cfg.n_layer == 4 and any("--n-layer 4" in n for n in job.notes)
    assert _resolve(["--check"])[1].cfg.dtype == "float64"
    assert _resolve(["--ep", "2", "--moe-every", "1"])[1].plan.dp == 2
    a, job = _resolve(["--cp", "2", "--moe-every", "1"])
    assert job.cfg.moe_group_size == 3 and any("--moe-group-size 3" in n for n in job.notes)
    assert _resolve(["--moe-every", "1"])[1].cfg.moe_group_size == 0      # one sequence


@pytest.mark.parametrize("argv, tiles", [
    (["--cp", "2", "--deterministic"], 4),                        # zig-zag: 2 cp runs
    (["--cp", "2", "--cp-layout", "contiguous", "--deterministic"], 2),
    (["--cp", "2", "--tp", "4", "--sp", "--length", "8", "--deterministic"], 8)])
def test_deterministic_context_parallelism_gets_the_fewest_whole_token_tiles(argv, tiles):
    a, job = _resolve(argv)
    assert a.token_tiles == tiles and any(f"--token-tiles {tiles}" in n for n in job.notes)


def test_the_deterministic_default_tiles_train_as_the_single_process_does(capsys):
    """--deterministic --cp 2 with the default --token-tiles runs, bit for bit (--check)."""
    argv = ["--cp", "2", "--deterministic", "--check", "--steps", "2", "--run-dir", "none",
            "--length", "4", "--batch", "4"]
    assert train_cli.main(argv) == 0, capsys.readouterr()
    assert "bit for bit" in capsys.readouterr().out


def test_fields_become_the_flags_that_set_them():
    text = ("Plan: global_batch=32 does not split over dp=3 x micro_batches=6; use "
            "cp_layout='contiguous', sequence_parallel=False, zero <= 2 or "
            "layers_per_stage=(3, 2).")
    assert train_options.in_flags(text) == (
        "--batch 32 does not split over --dp 3 x --grad-accum 6; use --cp-layout contiguous, "
        "no --sp, --zero <= 2 or --layers-per-stage 3,2.")


@pytest.mark.parametrize("verbose, prints", [([], False), (["--verbose"], True)])
def test_under_mpiexec_only_rank_0_prints_the_job_unless_verbose(verbose, prints):
    env = {**os.environ, "PMI_RANK": "1"}
    run = subprocess.run([sys.executable, "-m", "minidist", "train", "--steps", "0",
                          *verbose], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert ("task sort" in run.stdout) is prints, run.stdout


LAYOUT_CHOICES = {"--dp": ["1", "2", "3", "4"], "--tp": ["1", "2", "3"], "--cp": ["1", "2"],
                  "--pp": ["1", "2", "3"], "--ep": ["1", "2"], "--zero": ["0", "1", "2", "3"],
                  "--grad-accum": ["1", "2", "3"], "--batch": ["8", "12", "16"],
                  "--length": ["2", "3", "4", "5"], "--task": ["sort", "add"],
                  "--moe-every": ["0", "1"], "--n-head": ["2", "4"],
                  "--schedule": ["1f1b", "gpipe", "interleaved", "zb-h1"],
                  "--cp-layout": ["zigzag", "contiguous"], "--cp-algo": ["ring", "ulysses"],
                  "--precision": ["fp32", "bf16"], "--recompute": ["none", "full"]}
FLAG_CHOICES = ["--sp", "--deterministic", "--check", "--plain"]


def _random_layout(rng: random.Random) -> list[str]:
    argv = []
    for flag in rng.sample(sorted(LAYOUT_CHOICES), rng.randint(1, 5)):
        argv += [flag, rng.choice(LAYOUT_CHOICES[flag])]
    return argv + rng.sample(FLAG_CHOICES, rng.randint(0, 2))


def _layout_number(k: int) -> tuple[list[str], train_options.Job | None]:
    """Random layout k (its own seed) of at most 8 ranks, and its job (None: refused)."""
    rng = random.Random(f"layout {k}")
    while True:
        argv = _random_layout(rng) + ["--steps", "1", "--n-embd", "8", "--run-dir", "none"]
        try:
            job = train_options.resolve(train_cli._arguments().parse_args(argv))
        except ValueError:
            return argv, None
        if job.plan.world_size <= 8:
            return argv, job


@pytest.mark.slow
@pytest.mark.parametrize("k", range(200))
def test_random_layouts_end_ok_or_are_refused_in_one_line_before_any_rank(k):
    """200 random layouts and options: each trains (exit 0), or is refused with exit 2 in
    at most 3 lines before any rank starts (resolve alone refuses it)."""
    argv, job = _layout_number(k)
    run = subprocess.run([sys.executable, "-m", "minidist", "train", *argv],
                         capture_output=True, text=True, timeout=110)
    if job is None:
        assert run.returncode == 2 and run.stdout == "", (argv, run.stdout, run.stderr)
        assert run.stderr.startswith("error: ") and run.stderr.count("\n") <= 3, \
            (argv, run.stderr)
    else:
        assert run.returncode == 0, (argv, run.stdout[-2000:], run.stderr[-4000:])


def test_a_csv_schedule_brings_its_own_micro_batch_count(tmp_path):
    """An explicit --grad-accum is never replaced; without one, a CSV schedule's count."""
    from minidist.parallel.pipeline.schedule_csv import to_csv
    from minidist.parallel.pipeline.family import make_schedule
    path = tmp_path / "two.csv"
    path.write_text(to_csv(make_schedule("1f1b", 2, 2)))
    a, job = _resolve(["--pp", "2", "--schedule", str(path)])
    assert job.plan.micro_batches == 2 and any("schedule in" in n for n in job.notes)
    with pytest.raises(train_options.OptionError, match="M=2 micro-batches, the Plan has "
                                                        "--pp 2 and --grad-accum 4"):
        _resolve(["--pp", "2", "--schedule", str(path), "--grad-accum", "4"])


def test_a_schedule_file_that_is_not_text_names_the_flag_and_the_file(tmp_path, capsys,
                                                                      no_ranks):
    path = tmp_path / "bad.csv"
    path.write_bytes(b"0F0,\xff\xfe\n")
    assert train_cli.main(["--pp", "2", "--schedule", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --schedule {path}: not UTF-8 text") and err.count("\n") == 1
