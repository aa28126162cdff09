"""The mixed-precision demo runs as a user runs it: four loss curves side by side, the bytes
per parameter of each precision, and fp16's loss scale halved on both ranks by an overflow
on one; it ends with its OK line."""

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc


# slow (~11 s): four precisions trained side by side
@pytest.mark.slow
def test_mixed_precision_demo_shows_curves_bytes_and_the_skipped_step():
    rc, out = run_demo("20_mixed_precision.py", "--steps", "60", "--every", "20")
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0].startswith("demo 20 · mixed precision · "), out[0]
    assert "step       fp32      bf16      fp16       fp8" in text
    assert " bf16: params 2 + grads 2 + optimizer 12 = 16 bytes" in text     # K = 12
    assert " fp32: params 4 + grads 4 + optimizer 8 = 16 bytes" in text
    assert ("   6 |    65536 SKIP    32768          |    65536 SKIP    32768   <- inf in "
            "rank 1's gradients") in text
    assert "replicas bitwise equal after 10 steps: True" in text
    assert "Warning" not in text                              # overflow is expected, quietly
    assert out[-1].startswith("OK: bf16, fp16, fp8 curves match fp32"), text
    assert out[-2] == ("fp16: the overflow on rank 1 skipped step 6 on both ranks and halved the "
                       "scale 65536 -> 32768"), text
