"""The main job's progress line and summary (observe/progress.py), on made-up numbers whose
rates, shares and ETA are known by hand."""

import re

import numpy as np
import pytest

from minidist.observe.progress import Progress, human, seconds


def test_human_and_seconds():
    assert [human(x) for x in (0, 999, 1234, 35_200, 1.5e6, 2e9)] == \
        ["0", "999", "1.23k", "35.2k", "1.5M", "2G"]
    assert human(3e12, "FLOP/s") == "3TFLOP/s"
    assert [seconds(s) for s in (42, 210, 9000, float("inf"))] == ["42 s", "3.5 min", "2.5 h", "?"]


def test_the_line_reads_like_the_baselines_and_its_numbers_are_the_windows():
    # 100 steps of 1,000 tokens; lines at steps 9 and 19, 2 s then 1 s later: 10 steps each
    p = Progress(total_steps=100, tokens_per_step=1000, ranks=2, flops_per_step=4e8,
                 peak_flops=1e10)
    ranks = np.array([[0.1, 0.02, 3e6], [0.1, 0.04, 5e6]])   # step s, comm wait s, peak bytes
    first = p.line(9, 1.5, 2.0, ranks)
    assert re.match(r"step    9 \| loss 1\.5000 \|   2\.0 s \| ", first), first
    assert "| 5k tok/s |" in first                    # 10 steps x 1000 tokens / 2 s
    assert "| MFU 10.0% |" in first                    # 4e8 x 5 steps/s / (1e10 x 2)
    assert "| comm 30% |" in first                     # mean(0.2, 0.4)
    assert "| mem 5.00 MB max |" in first
    assert first.endswith("| ETA 18 s [#---------] 10%"), first   # 90 steps at 0.2 s
    second = p.line(19, 1.25, 3.0, ranks)
    assert "| 10k tok/s |" in second and "| MFU 20.0% |" in second
    assert second.endswith("| ETA 8 s [##--------] 20%"), second   # 80 steps at 0.1 s
    last = p.line(99, 1.0, 11.0, ranks)
    assert last.endswith("| ETA 0 s [##########] 100%"), last


def test_no_mfu_column_without_flops_or_peak_and_a_resumed_run_counts_from_its_start():
    p = Progress(total_steps=50, tokens_per_step=10, ranks=1, start_step=40)
    line = p.line(44, 2.0, 1.0, [[0.2, 0.0, 1e6]])    # steps 40..44 in 1 s
    assert "MFU" not in line and "| 50 tok/s |" in line and "| comm 0% |" in line
    assert "ETA 1 s" in line                           # 5 steps left at 0.2 s


def test_summary_leaves_out_the_first_step_and_lists_each_ranks_peak():
    p = Progress(total_steps=21, tokens_per_step=100, ranks=2, flops_per_step=1e9,
                 peak_flops=1e9)
    p.line(0, 3.0, 5.0, [[5.0, 1.0, 1e6], [5.0, 1.0, 2e6]])        # a slow first step
    p.line(10, 2.0, 6.0, [[0.1, 0.05, 4e6], [0.1, 0.05, 1e6]])
    p.line(20, 1.0, 7.0, [[0.1, 0.0, 1e6], [0.1, 0.0, 1e6]])
    text = " ".join(p.summary(7.0).split())                       # one space between words
    assert "steps 0..20 (21)" in text and "wall time 7.0 s" in text
    assert "tokens/s 1k (after step 0)" in text                   # 20 steps x 100 / 2 s
    assert "MFU 500.00% of 1GFLOP/s x 2 ranks" in text            # 1e9 x 10 / (1e9 x 2)
    assert "peak mem rank 0 4.00 MB" in text and "peak mem rank 1 2.00 MB" in text
    assert "comm wait 23.3% of step time" in text                 # mean(20, 50, 0) %
    assert Progress(total_steps=1, tokens_per_step=1, ranks=1).summary(1.0) == \
        "summary: no step was run"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="tokens_per_step=0"):
        Progress(total_steps=10, tokens_per_step=0, ranks=1)


def test_memory_is_left_out_when_nothing_measured_it_and_moe_models_have_no_mfu():
    from minidist.nn import GPTConfig
    p = Progress.for_model(GPTConfig(block_size=8, n_layer=2, n_embd=16), batch=4, ranks=1,
                           total_steps=3, peak_flops=1e9)
    assert p.tokens_per_step == 32 and p.flops_per_step > 0
    line = p.line(0, 1.0, 0.5, [[0.5, 0.0, 0]])
    assert "mem" not in line and "MFU" in line and "mem" not in p.summary(0.5)
    moe = Progress.for_model(GPTConfig(block_size=8, n_layer=2, n_embd=16, moe_every=2),
                             batch=4, ranks=1, total_steps=3, peak_flops=1e9)
    assert moe.flops_per_step == 0 and "MFU" not in moe.line(0, 1.0, 0.5, [[0.5, 0.0, 0]])
