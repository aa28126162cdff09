"""data.py: samples are pure functions of (seed, split, index); batches of (seed, step, B)."""

import numpy as np
import pytest

from minidist.data import IGNORE_INDEX, DataConfig, SyntheticData


@pytest.mark.parametrize("task", ["copy", "reverse", "sort", "add"])
def test_layout_and_answers(task):
    cfg = DataConfig(task=task, length=5, modulus=7)
    data = SyntheticData(cfg)
    x, y = data.batch([0, 1, 2, 3])
    L, A = cfg.prompt_len, cfg.answer_len
    assert x.shape == y.shape == (4, L + A) == (4, cfg.block_size)
    for row in range(4):
        prompt, answer = x[row, :L], y[row, L:]
        assert x[row, L] == cfg.sep                       # separator after the prompt
        assert np.all(y[row, :L] == IGNORE_INDEX)          # no loss on the prompt part
        assert np.array_equal(x[row, L + 1:], answer[:-1])  # teacher forcing: shifted by 1
        want = {"copy": prompt, "reverse": prompt[::-1], "sort": np.sort(prompt),
                "add": np.array([(prompt[0] + prompt[1]) % 7])}[task]
        assert np.array_equal(answer, want)
    assert x.max() < cfg.vocab_size and (y[y >= 0]).max() < cfg.sep


def test_rank_slices_equal_global_batch_for_awkward_world_sizes():
    data = SyntheticData(DataConfig(task="sort", seed=4))
    x, y = data.global_batch(step=3, global_batch_size=10)
    for world in (1, 2, 3, 4, 5):
        parts = []
        for r in range(world):
            ids = data.global_indices(3, 10)[r * 10 // world:(r + 1) * 10 // world]
            parts.append(data.batch(ids))
        assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
        assert np.array_equal(np.concatenate([p[1] for p in parts]), y)


def test_steps_seeds_and_splits_differ_but_repeat_exactly():
    d0, d1 = SyntheticData(DataConfig(seed=0)), SyntheticData(DataConfig(seed=1))
    again = SyntheticData(DataConfig())
    assert np.array_equal(d0.global_batch(2, 8)[0], again.global_batch(2, 8)[0])
    assert not np.array_equal(d0.global_batch(2, 8)[0], d0.global_batch(3, 8)[0])
    assert not np.array_equal(d0.global_batch(2, 8)[0], d1.global_batch(2, 8)[0])
    assert not np.array_equal(d0.batch([0, 1])[0], d0.batch([0, 1], split="eval")[0])


def test_finite_train_size_visits_every_sample_once_per_epoch():
    data = SyntheticData(DataConfig(train_size=12))
    epoch0 = np.concatenate([data.global_indices(s, 4) for s in range(3)])
    epoch1 = np.concatenate([data.global_indices(s, 4) for s in range(3, 6)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert not np.array_equal(epoch0, epoch1)              # reshuffled per epoch
    assert np.array_equal(data.global_indices(1, 6), np.concatenate(
        [data.global_indices(2, 3), data.global_indices(3, 3)]))   # positions, not steps


def test_decode_and_bad_configs():
    data = SyntheticData(DataConfig(task="sort", length=3))
    assert data.decode([3, 1, 2, 10, 1, 2, 3]) == "3 1 2 | 1 2 3"
    assert data.format_example([3, 1, 2], [1, 2, 3], [1, 2, 3]) == "3 1 2 | 1 2 3   (ok)"
    assert data.format_example([3, 1, 2], [1, 3, 3], [1, 2, 3]).endswith("(want 1 2 3)")
    for bad in (dict(task="mul"), dict(length=0), dict(base=1), dict(modulus=1),
                dict(train_size=0)):
        with pytest.raises(ValueError):
            DataConfig(**bad)
    with pytest.raises(ValueError, match="step"):
        data.global_indices(-1, 4)
