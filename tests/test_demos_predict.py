"""The predict demo runs as a user runs it: the fastest fitting layout of GPT-3 13B at 8 to
4,096 GPUs with its breakdown, then Megatron's runs against the model, and an OK line.
Slow (the layout search and the replay's fit take about 50 s)."""

import pytest

from tests.helpers import run_demo

DEMO = "31_predict.py"


@pytest.mark.slow
def test_predict_demo_scales_one_model_and_replays_the_paper():
    rc, out = run_demo(DEMO)
    text = "\n".join(out)
    assert rc == 0 and out[0].startswith("demo 31 · predict · gpt3-13b from 8 to 4096 GPUs"), text
    sizes = [line.split()[0] for line in out if line[:7].strip().isdigit()]
    assert sizes[:4] == ["8", "64", "512", "4096"], text
    assert "Table 1, row 10 (1008B)" in text and "PTD-P" in text and "ZeRO-3 row" not in text
    assert "Table 5, 1T present work" in text
    assert out[-2].startswith("OK: a layout fits at every size; the runs not fitted: mean "
                              "|error|") and out[-1].startswith("worst "), text
    assert all(len(line) <= 100 for line in out), [line for line in out if len(line) > 100]
