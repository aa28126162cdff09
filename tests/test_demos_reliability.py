"""The reliability demos run as a user runs them: checkpointing (the files and manifest, a kill
mid-save that leaves the previous checkpoint current, an async save, a dp=2 -> dp=3 resume)
and failure recovery (a SIGKILLed rank, a restart, the uninterrupted run's params sha256);
each ends with its OK line and leaves no temporary folder and no process behind."""

import os
import tempfile

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc
CHECKPOINTING, RECOVERY = "14_checkpointing.py", "15_failure_recovery.py"


def _leftovers(prefix: str) -> list[str]:
    """Temporary folders named `prefix`*, and processes whose working folder is one (the
    train commands and their ranks run in the demo's folder)."""
    tmp = os.path.join(tempfile.gettempdir(), prefix)
    left = [os.path.join(tempfile.gettempdir(), d) for d in os.listdir(tempfile.gettempdir())
            if d.startswith(prefix)]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(tmp):
                left.append(f"process {pid}")
        except OSError:
            pass
    return left


def _ok(name: str, *args: str) -> str:
    """The demo's output, each line of train's output that the demo wrapped at 100 characters
    ("  |     " starts a continued line) joined again."""
    prefix = f"minidist-demo{name[:2]}-"
    before = set(_leftovers(prefix))
    rc, out = run_demo(name, *args)
    text = "\n".join(out)
    assert rc == 0 and out[-1].startswith("OK: "), text
    assert out[0].startswith(f"demo {name[:2]} · "), out[0]
    assert set(_leftovers(prefix)) <= before, f"{name} left {set(_leftovers(prefix)) - before}"
    return text.replace("\n  |     ", " ")


# all slow (~2.5-3.3 s each): the default run covers checkpoints and a kill-and-recover
# with tests/reliability/test_checkpoint.py and test_recovery.py
@pytest.mark.slow
def test_checkpointing_demo_shows_layout_atomic_commit_async_and_reshard():
    text = _ok(CHECKPOINTING)
    assert "demo 14 · checkpointing · dp=2 ZeRO-1, 8 steps, a checkpoint every 4" in text
    for line in (  # the layout, the manifest's pieces checked by hand
            '  full/latest                                       13 B  "step00000008"',
            "  full/step00000008/rank00001.safetensors       321384 B",
            "  params/ln_f.bias   F64 shape [32]:\n    rank00000.safetensors [0, 16) sha256 ",
            "every piece above, hashed by hand from its safetensors file, matches: True",
            # the kill mid-save: `latest` still names step 4, which loads
            "  | [rank 1] injecting sigkill:rank=1:step=7:point=save:attempt=0:"
            "phase=rank_file_partial",
            '  crashed/latest                                    13 B  "step00000004"',
            "  crashed/.tmp-step00000008-<token>/rank00000.safetensors  321384 B",
            "loaded: step 4, params bitwise equal to run 1's step00000004: True",
            # async = sync; the resume on 3 ranks, which then removes the crash's leftovers
            "the async checkpoint holds the same bytes as the synchronous one: True",
            "  | resuming from crashed/step00000004 (step 4)",
            "step00000008 now holds manifest.json, rank00000.safetensors,\n  "
            "rank00001.safetensors, rank00002.safetensors; the crash's .tmp-step00000008-<token> "
            "is gone: True"):
        assert line in text, f"missing {line!r}\n{text}"
    assert "  <- snapshot() returned: the step starts" in text
    assert text.count("latest_replaced") == 1                # the async save's commit
    assert text.splitlines()[-1] == ("OK: pieces = manifest; kill mid-save: step 4 current, "
                                     "loads; async = sync; dp=2 -> dp=3 within 1e-12")


@pytest.mark.slow
def test_failure_recovery_demo_recovers_to_the_uninterrupted_digest():
    text = _ok(RECOVERY)
    for line in ("  | [rank 1] injecting sigkill:rank=1:step=6:point=start:attempt=0",
                 "  | recovery: attempt 0 failed: rank 1 of 2 failed; the other ranks were "
                 "stopped.",
                 "  | recovery: restarting all ranks in 0.5 s from ck/step00000004 (step 4); "
                 "steps 4..5 are lost and run again [restart 1 of at most 2]",
                 "  | resuming from ck/step00000004 (step 4)"):
        assert line in text, f"missing {line!r}\n{text}"
    ref, rec = (next(x for x in text.splitlines() if x.startswith(f"params sha256, {w}"))
                for w in ("uninterrupted: ", "recovered:     "))
    assert ref.split()[-1] == rec.split()[-1] and len(ref.split()[-1]) == 64, (ref, rec)
    assert "steps run twice, losses before | after the restart: step 4: " in text
    assert text.splitlines()[-1] == ("OK: rank 1 SIGKILLed at step 6, resumed from step 4 after 1"
                                     " restart; same params sha256 as run 1")


@pytest.mark.slow
def test_failure_recovery_demo_before_the_first_checkpoint_restarts_from_step_0():
    text = _ok(RECOVERY, "--kill-rank", "0", "--kill-step", "2")
    assert "from step 0 (no checkpoint yet); steps 0..1 are lost and run again" in text, text
    assert "  resumed from: step 0: no checkpoint had been written yet" in text
