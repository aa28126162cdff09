"""Synthetic data sets addressed by global sample index, so every layout sees the same batches.

A data-parallel rank must read exactly its rows of the global batch the single process
reads, and a restarted job must read exactly the batch it would have read. So a sample is
never "the next thing an RNG produces": it is a pure function of (seed, split, index), and
the global batch of a step is a pure function of (seed, step, global batch size). The
prompt symbols of sample i are elements i*L .. i*L+L-1 of the counter-based stream
(seed, "data", task, split) (seed.counter_integers), so a batch is drawn in one
vectorised call whatever the indices are.

Tasks (each a prompt, a separator token SEP, and an answer the model must produce):
    copy     3 1 4 1 5 | 3 1 4 1 5          the prompt again
    reverse  3 1 4 1 5 | 5 1 4 1 3          the prompt backwards
    sort     3 1 4 1 5 | 1 1 3 4 5          the prompt in ascending order
    add      4 9 | 2                        (a + b) mod m, here m = 11, one token each
Symbols are tokens 0..S-1 (S = base, or m for add) and SEP = S, so vocab_size = S + 1.

Language-model layout of one sample (prompt length L, answer length A, T = L + A):
    sequence  s = prompt + [SEP] + answer                         (L + 1 + A tokens)
    input     x = s[:-1]                                          (T,)
    target    y = s[1:], with the first L positions set to -100   (T,)
so the loss only counts the A answer tokens (ignore_index=-100 on the prompt part).

Epochs: with `train_size = N` the training split holds samples 0..N-1 and global position
g (= step * B + row) reads sample perm_e[g % N] of epoch e = g // N, where perm_e is a
permutation drawn from (seed, "shuffle", e). With train_size None every position is a
fresh sample (g is the index). The "eval" split draws from a separate stream.

One rank's view (dp rank r of W, global batch B, rows B/W per rank):
    1. idx = data.global_indices(step, B)[r*B//W : (r+1)*B//W]
    2. x, y = data.batch(idx)            -- exactly rows r*B//W.. of data.global_batch(step, B)
Shapes: x (B, T) int64, y (B, T) int64. No communication.

Read next: nn/gpt.py (the model that learns these tasks), baseline.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minidist import seed as seeding
from minidist.nn import GPT, GPTConfig

IGNORE_INDEX = -100
TASKS = ("copy", "reverse", "sort", "add")
_SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class DataConfig:
    """A synthetic task. `length` = prompt length for copy/reverse/sort (add uses 2 tokens)."""

    task: str = "sort"
    length: int = 6
    base: int = 10
    modulus: int = 11
    seed: int = 0
    train_size: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"DataConfig: task={self.task!r} is unknown; choose one of {TASKS}.")
        if self.length < 1:
            raise ValueError(f"DataConfig: length={self.length} must be >= 1 (prompt tokens).")
        if not 2 <= self.base <= len(_SYMBOLS):
            raise ValueError(f"DataConfig: base={self.base} must be in 2..{len(_SYMBOLS)}.")
        if self.modulus < 2:
            raise ValueError(f"DataConfig: modulus={self.modulus} must be >= 2.")
        if self.train_size is not None and self.train_size < 1:
            raise ValueError(f"DataConfig: train_size={self.train_size} must be >= 1 or None.")

    @property
    def n_symbols(self) -> int:
        return self.modulus if self.task == "add" else self.base

    @property
    def sep(self) -> int:
        """The separator token, one past the last symbol."""
        return self.n_symbols

    @property
    def vocab_size(self) -> int:
        return self.n_symbols + 1

    @property
    def prompt_len(self) -> int:
        return 2 if self.task == "add" else self.length

    @property
    def answer_len(self) -> int:
        return 1 if self.task == "add" else self.length

    @property
    def block_size(self) -> int:
        """T, the model's input length: prompt + answer (the SEP replaces the last token)."""
        return self.prompt_len + self.answer_len


class SyntheticData:
    """Samples and batches of one task, each a pure function of (cfg.seed, split, index)."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self._perms: dict[int, np.ndarray] = {}            # epoch -> shuffle (train_size set)

    def prompts(self, indices, split: str = "train") -> np.ndarray:
        """The prompts (n, L) int64 of dataset samples `indices`."""
        c = self.cfg
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and indices.min() < 0:
            raise ValueError(f"prompts: sample indices must be >= 0, got {indices.min()}.")
        counters = indices[:, None] * c.prompt_len + np.arange(c.prompt_len)    # (n, L)
        return seeding.counter_integers(c.seed, ("data", c.task, split), counters, c.n_symbols)

    def answers(self, prompts: np.ndarray) -> np.ndarray:
        """The correct answers (n, A) for prompts (n, L)."""
        c = self.cfg
        if c.task == "copy":
            return prompts.copy()
        if c.task == "reverse":
            return prompts[:, ::-1].copy()
        if c.task == "sort":
            return np.sort(prompts, axis=1)
        return (prompts[:, :1] + prompts[:, 1:2]) % c.modulus

    def sample(self, index: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """Return (prompt (L,), answer (A,)) int64 arrays for dataset sample `index`."""
        prompt = self.prompts([index], split)
        return prompt[0], self.answers(prompt)[0]

    def batch(self, indices, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """Return (x (B, T), y (B, T)) int64 for dataset samples `indices` (any order)."""
        c = self.cfg
        prompts = self.prompts(indices, split)                            # (B, L)
        sep = np.full((len(prompts), 1), c.sep, dtype=np.int64)
        s = np.concatenate([prompts, sep, self.answers(prompts)], axis=1)  # (B, L + 1 + A)
        x, y = s[:, :-1].copy(), s[:, 1:].copy()                          # (B, T) each
        y[:, : c.prompt_len] = IGNORE_INDEX
        return x, y

    def global_indices(self, step: int, global_batch_size: int) -> np.ndarray:
        """Dataset indices (B,) of the global batch of `step`: positions step*B .. step*B+B-1."""
        if step < 0 or global_batch_size < 1:
            raise ValueError(f"global_indices: need step >= 0 and global_batch_size >= 1, got "
                             f"step={step}, global_batch_size={global_batch_size}.")
        positions = step * global_batch_size + np.arange(global_batch_size, dtype=np.int64)
        n = self.cfg.train_size
        if n is None:
            return positions
        return np.array([self._permutation(int(g // n))[g % n] for g in positions], np.int64)

    def global_batch(self, step: int, global_batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y), each (B, T): the whole global batch of `step` (training split)."""
        return self.batch(self.global_indices(step, global_batch_size))

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 4:                      # keep a few epochs, not all
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = seeding.stream(self.cfg.seed, "shuffle", epoch).permutation(
                self.cfg.train_size)
        return self._perms[epoch]

    def decode(self, tokens) -> str:
        """Tokens as text: symbols as digits/letters ('add' as numbers), SEP as '|'."""
        c = self.cfg
        words = ["|" if t == c.sep else ("?" if not 0 <= t < c.sep else
                                          (str(t) if c.task == "add" else _SYMBOLS[t]))
                 for t in (int(t) for t in tokens)]
        return " ".join(words)

    def format_example(self, prompt, predicted, answer) -> str:
        """One line for the demo: 'prompt | predicted   (ok / want answer)'."""
        verdict = "ok" if np.array_equal(predicted, answer) else "want " + self.decode(answer)
        return (f"{self.decode(prompt)} | {self.decode(predicted)}   ({verdict})")


# --- the model a task needs, and how well it answers ---------------------------------

def check_compatible(model_cfg: GPTConfig, data_cfg: DataConfig) -> None:
    """ValueError unless the model's vocabulary and context fit the task."""
    if model_cfg.vocab_size < data_cfg.vocab_size or model_cfg.block_size < data_cfg.block_size:
        raise ValueError(
            f"model vocab_size={model_cfg.vocab_size}, block_size={model_cfg.block_size} is too "
            f"small for task {data_cfg.task!r}, which needs vocab_size >= {data_cfg.vocab_size} "
            f"and block_size >= {data_cfg.block_size}; use model_config_for(data_cfg, ...).")


def model_config_for(data_cfg: DataConfig, **overrides) -> GPTConfig:
    """A GPTConfig whose vocab_size and block_size match the task; other fields overridable."""
    fields = dict(vocab_size=data_cfg.vocab_size, block_size=data_cfg.block_size)
    fields.update(overrides)
    return GPTConfig(**fields)


def answer_accuracy(model: GPT, data: SyntheticData, n: int = 64, split: str = "eval"
                    ) -> tuple[float, list[str]]:
    """Greedy-decode the answers of n held-out samples; return (exact-match rate, lines)."""
    c = data.cfg
    samples = [data.sample(i, split) for i in range(n)]
    prompts = np.stack([np.concatenate([p, [c.sep]]) for p, _ in samples])    # (n, L + 1)
    out = model.generate(prompts, c.answer_len)[:, c.prompt_len + 1:]       # (n, A)
    lines = [data.format_example(p, o, a) for (p, a), o in zip(samples, out)]
    hits = sum(np.array_equal(o, a) for (_, a), o in zip(samples, out))
    return hits / n, lines
