"""Loss spikes (reliability/spike.py): the detector's rule, each policy on a stand-in
engine, and the train CLI handling an injected NaN."""

from __future__ import annotations

import math
import re

import pytest

from minidist import train_cli
from minidist.reliability.spike import WARMUP, Detector, Guard, SpikeDetected


def _warm(d: Detector, n: int = WARMUP, loss: float = 2.0, norm: float = 1.0) -> None:
    for i in range(n):
        d.accept(loss + 0.01 * (-1) ** i, norm + 0.01 * (-1) ** i)


def test_the_detector_flags_non_finite_values_at_once_and_jumps_after_warm_up():
    d = Detector()
    assert d.check(float("nan"), 1.0) == "loss is nan"
    assert d.check(2.0, float("inf")) == "norm is inf"
    assert d.check(50.0, 1.0) is None                  # still warming up: no statistics
    _warm(d)
    assert d.check(2.05, 1.02) is None                 # noise
    why = d.check(3.0, 1.0)
    assert why is not None and why.startswith("loss 3 > mean 2")
    assert d.check(2.0, 5.0).startswith("grad norm 5 > mean 1")


def test_sigma_has_a_floor_and_only_accepted_steps_move_the_bar():
    d = Detector()
    for _ in range(WARMUP):
        d.accept(2.0, 1.0)                             # a plateau: zero variance
    assert d.check(2.2, 1.0) is None                   # 2.2 < 2 + 6 x 2% x 2 = 2.24
    assert d.check(2.3, 1.0) is not None
    before = dict(d.mean)
    d.check(100.0, 1.0)
    assert d.mean == before


class _Engine:
    """engine.step stand-in: norms to report, and what each call decided."""

    def __init__(self, norms):
        self.norms, self.applied = list(norms), []

    def step(self, lr, clip, skip=None):
        norm = self.norms.pop(0)
        self.applied.append(not (skip is not None and skip(norm)))
        return norm


def _guard(policy: str) -> tuple[Guard, list[str]]:
    lines: list[str] = []
    g = Guard(policy, lines.append)
    _warm(g.detector)
    return g, lines


def test_skip_leaves_the_update_out_and_detect_applies_it():
    g, lines = _guard("skip")
    e = _Engine([1.0, 9.0])
    assert g.step(20, e, 0.1, None, 2.0, lambda: 2.0) == (1.0, 2.0)
    assert g.step(21, e, 0.1, None, 2.0, lambda: 2.0) == (9.0, 2.0)
    assert e.applied == [True, False] and g.skipped == [21]
    assert len(lines) == 1 and re.fullmatch(
        r"spike at step 21: grad norm 9 > mean 1\.0\d* \+ 6 sigma \(0\.02\d*\) = "
        r"1\.1\d*; policy skip", lines[0]), lines
    g, _ = _guard("detect")
    e = _Engine([9.0])
    g.step(3, e, 0.1, None, 2.0, lambda: 2.0)
    assert e.applied == [True]


@pytest.mark.parametrize("rerun_loss, applied, verdict", [
    (2.0, [False, True], "the rerun is normal (a transient fault)"),
    (float("nan"), [False, False], "the rerun spikes again (loss is nan): bad data"),
])
def test_rerun_tells_a_transient_fault_from_bad_data(rerun_loss, applied, verdict):
    g, lines = _guard("rerun")
    e = _Engine([1.0, 1.0])
    norm, loss = g.step(7, e, 0.1, None, float("nan"), lambda: rerun_loss)
    assert e.applied == applied and verdict in lines[-1]
    assert (g.skipped == []) == (rerun_loss == 2.0)


def test_rollback_stops_the_step_before_the_update():
    g, _ = _guard("rollback")
    e = _Engine([1.0])
    with pytest.raises(SpikeDetected, match="loss spike at step 4 .*rolling back"):
        g.step(4, e, 0.1, None, float("inf"), lambda: 2.0)
    assert e.applied == [False]


TINY = ["--dp", "2", "--steps", "24", "--every", "100", "--n-layer", "1", "--n-embd", "16",
        "--n-head", "2", "--batch", "8", "--dtype", "float64"]


def _run(argv, capfd) -> tuple[int, str, str]:
    code = train_cli.main(argv)
    out = capfd.readouterr().out
    return code, out, re.findall(r"^params sha256: (\w+)$", out, re.M)[-1]


@pytest.mark.multiproc
def test_the_policies_in_a_run_with_an_injected_nan(tmp_path, capfd):
    _, _, clean = _run(TINY, capfd)
    nan = ["--inject", "nan:rank=0:step=15"]
    code, out, digest = _run(TINY + nan + ["--spike", "rerun"], capfd)
    assert code == 0 and "spike at step 15: the rerun is normal" in out
    assert digest == clean                                 # a transient fault leaves no trace
    code, out, digest = _run(TINY + nan + ["--spike", "skip"], capfd)
    assert code == 0 and "spike at step 15: loss is nan; policy skip" in out
    assert digest != clean and "loss nan" not in out
    code, out, _ = _run(TINY + ["--spike", "rollback", "--checkpoint-dir", str(tmp_path),
                                "--checkpoint-every", "4", "--max-restarts", "1",
                                "--inject", "nan:rank=1:step=14"], capfd)
    assert code == 0, out
    assert "spike: rolled back to step 12; skipping 5 batches: step s now trains on batch " \
           "s + 5" in out
    final = float(re.findall(r"^step +23 \| loss (\S+)", out, re.M)[0])
    assert math.isfinite(final)


def test_rollback_needs_checkpoints_and_a_restart(capsys):
    assert train_cli.main(TINY + ["--spike", "rollback"]) == 2
    assert "--spike rollback restarts from a checkpoint" in capsys.readouterr().err


def test_the_guard_s_state_round_trips_through_json_exactly():
    """What a checkpoint keeps (recovery.RankCheckpoints): a guard restored from it judges
    the next steps exactly as the one it was taken from."""
    import json
    from minidist.reliability.spike import Guard
    a = Guard("skip", lambda line: None)
    for i in range(15):
        a.detector.accept(2.0 - 0.1 * i + 1e-3 * (i % 3), 1.0 + 0.01 * i)
    a.skipped = [4, 9]
    b = Guard("skip", lambda line: None)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict() and b.skipped == [4, 9]
    for loss, norm in [(0.6, 1.2), (5.0, 1.2), (0.6, 9.0)]:
        assert b.detector.check(loss, norm) == a.detector.check(loss, norm)
