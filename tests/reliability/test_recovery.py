"""Recovery (reliability/recovery.py) through the train CLI: a run killed anywhere, then
restarted from its latest checkpoint, ends bitwise equal to the uninterrupted run.

The default run keeps one kill-and-restart (dp=2 ZeRO-1, SIGKILL), one elastic run, the
refusals that cost little, and every one-line error; the other layouts and faults, the
resharding resume, the NaN runs, elastic's other cases and the spike-state restart (each
0.3-2.6 s of training) are in the slow set. The slow set also draws 100 random kills."""

from __future__ import annotations

import random
import re

import pytest

from minidist import train_cli
from minidist.reliability import faults
from minidist.reliability.checkpoint import PHASES

pytestmark = pytest.mark.multiproc

TINY = ["--steps", "9", "--every", "100", "--n-layer", "2", "--n-embd", "16", "--n-head", "2",
        "--batch", "8", "--dtype", "float64", "--seed", "3"]
LAYOUTS = {"dp2": ["--dp", "2"], "dp2-zero3": ["--dp", "2", "--zero", "3"],
           "tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "dp2-zero1": ["--dp", "2", "--zero", "1"],
           "cp2": ["--cp", "2"], "one": []}
_REFERENCE: dict[str, str] = {}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, the launcher's stdout and stderr)."""
    code = train_cli.main(argv)
    res = capsys.readouterr()
    return code, res.out + res.err


def _digest(out: str) -> str:
    return re.findall(r"^params sha256: ([0-9a-f]{64})$", out, re.M)[-1]


def _reference(layout: str, capsys) -> str:
    """The uninterrupted run's digest (once per layout)."""
    if layout not in _REFERENCE:
        code, out = _run(LAYOUTS[layout] + TINY, capsys)
        assert code == 0
        _REFERENCE[layout] = _digest(out)
    return _REFERENCE[layout]


def _recovered(layout: str, spec: str, tmp_path, capsys, every: int = 2) -> str:
    argv = LAYOUTS[layout] + TINY + ["--checkpoint-dir", str(tmp_path / "ck"),
                                     "--checkpoint-every", str(every), "--inject", spec,
                                     "--max-restarts", "2"]
    code, out = _run(argv, capsys)
    assert code == 0, out
    assert "recovery: attempt 0 failed" in out and "recovery: attempt 1" not in out, out
    return out


@pytest.mark.parametrize("layout, spec", [
    ("dp2-zero1", "sigkill:rank=1:step=5"),         # the cheapest: the default run's share
    pytest.param("tp2", "sigkill:rank=0:step=3:point=save:phase=rank_file_partial",
                 marks=pytest.mark.slow),
    pytest.param("pp2", "raise:rank=1:step=6:point=end", marks=pytest.mark.slow),
])
def test_a_run_killed_and_restarted_ends_bitwise_equal_to_the_uninterrupted_run(
        layout, spec, tmp_path, capsys):
    out = _recovered(layout, spec, tmp_path, capsys)
    assert _digest(out) == _reference(layout, capsys)
    f = faults.parse(spec)
    resumed = (f.step + (f.point != "start")) // 2 * 2      # the last checkpoint before it
    if f.point == "save":
        resumed = f.step + 1 - 2                             # that save never committed
    assert f"resuming from {tmp_path / 'ck'}/step{resumed:08d} (step {resumed})" in out


@pytest.mark.slow
def test_a_checkpoint_loads_under_another_layout_and_continues(tmp_path, capsys):
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3"]
    code, out = _run(LAYOUTS["dp2-zero3"] + TINY + ck + ["--inject", "raise:rank=0:step=7"],
                     capsys)
    assert code == 1 and "InjectedFault: injected fault raise:rank=0:step=7" in out
    code, out = _run(LAYOUTS["tp2"] + TINY + ck + ["--check"], capsys)
    assert code == 0, out
    assert f"resuming from {tmp_path / 'ck'}/step00000006 (step 6)" in out
    assert re.search(r"^OK: dp=1 x tp=2, ZeRO-0 training matches", out, re.M), out


def test_resume_never_and_a_checkpoint_of_another_run_are_refused(tmp_path, capsys):
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3"]
    assert _run(LAYOUTS["dp2"] + TINY + ck + ["--lr", "0.003"], capsys)[0] == 0
    assert train_cli.main(LAYOUTS["dp2"] + TINY + ck + ["--resume", "never"]) == 2
    assert "--resume never, but" in capsys.readouterr().err
    assert train_cli.main(LAYOUTS["dp2"] + TINY + ck + ["--lr", "0.01", "--seed", "4"]) == 2
    res = capsys.readouterr()
    err = res.err.strip().splitlines()
    assert len(err) == 1 and "holds a checkpoint of another run" in err[0], err
    assert "lr 0.003 vs 0.01; seed 3 vs 4 (the checkpoint's vs this run's)" in err[0], err
    assert len(err[0]) < 300 and "resuming from" not in res.out, res


@pytest.mark.parametrize("where, why", [("file", "is a file, not a directory"),
                                        ("/proc/nope/ck", "cannot make that directory")])
def test_a_bad_checkpoint_dir_is_refused_before_any_rank_starts(where, why, tmp_path, capsys):
    """Finding 8: --checkpoint-dir /etc/passwd was found only after every step trained."""
    if where == "file":
        where = str(tmp_path / "file")
        (tmp_path / "file").write_text("not a directory\n")
    assert train_cli.main(LAYOUTS["dp2"] + TINY + ["--checkpoint-dir", where]) == 2
    res = capsys.readouterr()
    assert res.out.count("step") == 0 and why in res.err, res       # nothing trained
    assert len(res.err.strip().splitlines()) == 1, res.err


@pytest.mark.slow
def test_a_directory_of_corrupt_checkpoints_is_one_line(tmp_path, capsys):
    """Finding 8: when every checkpoint is corrupt, the cause came in a 30-line traceback."""
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3"]
    assert _run(LAYOUTS["dp2"] + TINY + ck, capsys)[0] == 0
    for manifest in (tmp_path / "ck").glob("step*/manifest.json"):
        manifest.write_text("{garbage")
    assert train_cli.main(LAYOUTS["dp2"] + TINY + ck) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no intact checkpoint" in err[0], err
    assert "step00000009: " in err[0] and "not a valid manifest" in err[0], err


def test_restarting_under_mixed_precision_is_refused_in_one_line(tmp_path, capsys):
    """Resuming a reduced-precision run is not built (no fp32 master weights in the
    checkpoint): refused before any rank starts, not as a traceback after the restart."""
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3"]
    assert train_cli.main(LAYOUTS["dp2"] + TINY[:-4] + ck + ["--precision", "bf16",
                                                         "--max-restarts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "resuming under mixed precision is not built" in err[0], err
    assert _run(LAYOUTS["dp2"] + TINY[:-4] + ck + ["--precision", "bf16"], capsys)[0] == 0
    assert train_cli.main(LAYOUTS["dp2"] + TINY[:-4] + ck + ["--precision", "bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a checkpoint of step 9" in err[0], err


def test_a_fault_inside_an_async_save_is_refused_as_it_could_not_fire(tmp_path, capsys):
    """Finding 5: --inject ...:point=save was accepted with --async-checkpoint and never
    fired."""
    argv = LAYOUTS["dp2"] + TINY + ["--checkpoint-dir", str(tmp_path), "--checkpoint-every",
                                    "3", "--async-checkpoint", "--inject",
                                    "sigkill:rank=1:step=5:point=save"]
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--async-checkpoint writes in a background thread" in err[0], err


@pytest.mark.slow
def test_loss_spike_skipping_survives_a_restart_bitwise(tmp_path, capfd):
    """Finding 4: the spike detector's statistics were not in the checkpoint, so after a
    resume it was back in its warm-up and let through the spikes of steps 27-29 that the
    uninterrupted run skipped: another sha256. The issue's own command."""
    F = ["--steps", "30", "--batch", "32", "--dp", "2", "--checkpoint-every", "4",
         "--max-restarts", "2", "--spike", "skip", "--every", "100"]
    code, whole = _run(F + ["--checkpoint-dir", str(tmp_path / "a")], capfd)
    assert code == 0 and "spike at step 27" in whole, whole
    code, cut = _run(F + ["--checkpoint-dir", str(tmp_path / "b"), "--inject",
                          "sigkill:rank=1:step=25"], capfd)
    assert code == 0 and "recovery: attempt 0 failed" in cut, cut
    assert re.findall(r"^spike at .*$", cut, re.M) == re.findall(r"^spike at .*$", whole, re.M)
    assert _digest(cut) == _digest(whole)


def test_a_storage_failure_is_not_retried_and_is_one_line(capsys):
    """Finding 7: a full disk spent every --max-restarts attempt and printed 38 lines."""
    from minidist.reliability import recovery
    from minidist.runtime import RankFailure
    text = ("CheckpointStorageError: [rank 0/2] saving step 4 into ck: No space left on "
            "device; a restart cannot fix this: free space on that disk, then run again "
            "(the latest checkpoint is still step 2)")
    attempts, lines = [], []

    def attempt(k):
        attempts.append(k)
        raise RankFailure("rank 0 of 2 failed; the other ranks were stopped.\n  " + text,
                          0, {0: text + "\n  (raised in save)"})
    with pytest.raises(RankFailure) as info:
        recovery.supervise(attempt, max_restarts=3, policy=None, log=lines.append)
    assert attempts == [0] and "a restart cannot fix: not restarting" in lines[-1], lines
    assert train_cli._rank_failed(info.value) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: " + text], err


@pytest.mark.parametrize("spec, why", [
    ("sigkill:rank=5:step=1", "rank 5 does not exist"),
    ("sigkill:rank=0:step=99", "step 99 is not run"),
    ("sigkill:rank=0:step=2:point=save", "no checkpoint is saved after step 2"),
    ("boom:rank=0:step=1", "unknown kind 'boom'"),
    ("sigkill:rank=0", "rank= and step= are required"),
    ("sigkill:rank=0:step=1:point=save:phase=nope", "phase is one of"),
    ("nan:rank=0:step=1:point=end", "its point is start"),
    ("nan:rank=0:step=1", "only the last pipeline stage's ranks (1..1) compute a loss"),
])
def test_a_bad_injection_is_one_line_with_exit_2(spec, why, tmp_path, capsys):
    layout = LAYOUTS["pp2" if "last pipeline" in why else "dp2"]
    argv = layout + TINY + ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4",
                            "--inject", spec]
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert why in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow                  # the spike tests (test_spike.py) inject a NaN by default
@pytest.mark.parametrize("layout, rank", [("dp2", 0), ("pp2", 1)])
def test_an_injected_nan_makes_the_step_loss_and_the_parameters_nan(layout, rank, capfd):
    argv = LAYOUTS[layout] + TINY + ["--every", "1", "--inject", f"nan:rank={rank}:step=4"]
    code, out = _run(argv, capfd)                 # capfd: the ranks print the steps
    assert code == 0, out
    losses = dict(re.findall(r"^step +(\d+) \| loss (\S+)", out, re.M))
    assert losses["3"] != "nan" and losses["4"] == "nan" and losses["8"] == "nan"


def test_faults_from_the_environment_and_the_data_faults():
    assert faults.from_env({faults.ENV: "exit:rank=1:step=2; sleep:rank=0:step=1:seconds=0.5"}) \
        == [faults.Fault("exit", 1, 2), faults.Fault("sleep", 0, 1, seconds=0.5)]
    inj = faults.Injector([faults.parse("nan:rank=1:step=3"),
                           faults.parse("corrupt:rank=1:step=4")], rank=1)
    import numpy as np

    class Model:
        def loss(self, x):
            return 2.0 * x

    m = Model()
    with inj.nan_loss(m, 2):
        assert m.loss(1) == 2.0
    with inj.nan_loss(m, 3):
        assert np.isnan(m.loss(1))
    assert m.loss(1) == 2.0 and "loss" not in vars(m)
    x = np.arange(12).reshape(2, 6) % 11
    assert inj.corrupt(3, x, 11) is x
    bad = inj.corrupt(4, x, 11)
    assert bad.shape == x.shape and not np.array_equal(bad, x)
    assert np.array_equal(bad, inj.corrupt(4, x, 11))            # the same draw on a rerun
    assert faults.Injector([faults.parse("raise:rank=1:step=3")], rank=1, attempt=1).faults == []


def _trial(seed: int) -> tuple[str, str, int]:
    """A random (layout, fault, checkpoint interval)."""
    rng = random.Random(seed)
    layout = rng.choice(sorted(LAYOUTS))
    W = 1 if layout == "one" else 2
    every = rng.choice([1, 2, 3])
    kind = rng.choice(["sigkill", "exit", "raise", "sigkill"])
    point = rng.choice(["start", "end", "save"])
    steps = [s for s in range(9) if point != "save" or (s + 1) % every == 0 or s == 8]
    spec = f"{kind}:rank={rng.randrange(W)}:step={rng.choice(steps)}:point={point}"
    if point == "save":
        spec += f":phase={rng.choice(PHASES)}"
    return layout, spec, every


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100))
def test_random_kills_recover_bitwise(seed, tmp_path, capsys):
    layout, spec, every = _trial(seed)
    argv = LAYOUTS[layout] + TINY + ["--checkpoint-dir", str(tmp_path / "ck"),
                                     "--checkpoint-every", str(every), "--inject", spec,
                                     "--max-restarts", "2"]
    code, out = _run(argv, capsys)
    assert code == 0, (layout, spec, every, out)
    assert _digest(out) == _reference(layout, capsys), (layout, spec, every)


def _elastic_run(argv: list[str]):
    """recovery.run as `train` runs it, returning the RankResult of the whole run."""
    from minidist import train_options
    from minidist.reliability import recovery
    a = train_cli._arguments().parse_args(argv)
    job = train_options.resolve(a)
    return a, job.cfg, job.data_cfg, recovery.run(a, job.cfg, job.data_cfg, job.plan,
                                                  job.resilience, train_cli._rank_main)


@pytest.mark.parametrize("extra, lines", [
    pytest.param(["--rejoin-after", "3"], ["continuing on dp=3 (3 ranks, was 4) from step 4, "
                                           "until step 7", "capacity is back at step 7: "
                                           "growing from dp=3"], marks=pytest.mark.slow),
    ([], ["continuing on dp=3 (3 ranks, was 4) from step 4; global batch 12 kept"]),  # default
])
def test_elastic_shrinks_and_grows_and_equals_the_reference(extra, lines, tmp_path, capfd):
    import numpy as np
    from minidist import baseline
    argv = ["--dp", "4", "--batch", "12", "--steps", "10", "--n-layer", "1", "--n-embd", "16",
            "--n-head", "2", "--dtype", "float64", "--checkpoint-dir", str(tmp_path / "ck"),
            "--checkpoint-every", "2", "--max-restarts", "2", "--elastic",
            "--inject", "sigkill:rank=3:step=5", *extra]
    a, cfg, data_cfg, run = _elastic_run(argv)
    out = capfd.readouterr().out
    assert all(line in out for line in lines), out
    ref = baseline.train_single_process(cfg, data_cfg, steps=10, global_batch=12, lr=a.lr,
                                        seed=a.seed)
    assert len(run.losses) == 10
    assert max(abs(x - y) for x, y in zip(run.losses, ref.losses)) <= 1e-12
    assert max(float(np.max(np.abs(run.params[k] - v))) for k, v in ref.params.items()) <= 1e-12


def test_elastic_needs_checkpoints_and_restarts(capsys):
    assert train_cli.main(LAYOUTS["dp2"] + TINY + ["--elastic"]) == 2
    assert "give --elastic with --checkpoint-dir and --max-restarts >= 1" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_elastic_keeps_the_size_when_the_smaller_layout_cannot_take_the_batch(tmp_path, capfd):
    argv = ["--dp", "4", "--batch", "8", "--steps", "6", "--n-layer", "1", "--n-embd", "16",
            "--n-head", "2", "--dtype", "float64", "--checkpoint-dir", str(tmp_path / "ck"),
            "--checkpoint-every", "2", "--max-restarts", "1", "--elastic",
            "--inject", "exit:rank=2:step=3"]
    _, _, _, run = _elastic_run(argv)
    out = capfd.readouterr().out
    assert "elastic: cannot continue on dp=3 (" in out and "restarting at the same size" in out
    assert len(run.losses) == 6
