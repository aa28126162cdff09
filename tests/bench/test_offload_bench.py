"""The offload benchmark: a tiny run prints the command, one row per tier with the ratio to
`none`, the target line, and a device-peak drop equal to the bytes moved off the device by
the closed form (AdamW: m and v, 2 numbers per element; ZeRO-3: the shard too), and leaves
no files behind. The default run keeps the DDP case; ZeRO-3 is in the slow set."""

import os

import pytest

from minidist.bench import offload as bench
from minidist.data import DataConfig, model_config_for
from minidist.memory.ledger import format_bytes
from minidist.memory.offload import PREFIX, TIERS
from minidist.nn import GPT
from minidist.parallel.zero.flat import split_units

TINY = ["--steps", "2", "--warmup", "0", "--repeats", "1", "--batch-per-rank", "4",
        "--n-embd", "16", "--n-head", "2", "--length", "3", "--dtype", "float64"]
CFG = model_config_for(DataConfig(task="sort", length=3), n_layer=2, n_embd=16, n_head=2,
                       dtype="float64")


def _rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("offload "))
    return {line.split()[0]: line.split()[1:] for line in lines[start + 1:start + 4]}


@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_tiny_run_prints_one_row_per_tier(capsys, tmp_path, zero):
    argv = TINY + ["--zero", str(zero), "--offload-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "$ python -m minidist bench offload " + " ".join(argv)
    rows = _rows(out)
    assert list(rows) == list(TIERS)
    if zero == 0:                              # DDP: m and v of every parameter
        moved = 2 * GPT(CFG).num_parameters() * 8
    else:                                      # ZeRO-3 on 2 ranks: m, v and w of the shards
        moved = 3 * sum(u.shard for u in split_units(GPT(CFG, seed=None), 2)) * 8
    for tier, cells in rows.items():
        step, ratio, compute, cpu = map(float, cells[:4])
        assert step > 0 and compute > 0 and cpu > 0, tier
        expected = format_bytes(0 if tier == "none" else moved)      # 2 words each
        assert " ".join(cells[-4:]) == f"{expected} {expected}", f"{tier}: drop, moved"
    assert rows["none"][1] == "1.00"
    assert out.splitlines()[-2].startswith("target step <= 1.3x none (prefetch on): host ")
    assert out.splitlines()[-1] == "device peak drop = bytes moved off the device, exactly: yes"
    assert not [d for d in os.listdir(tmp_path) if d.startswith(PREFIX)]
