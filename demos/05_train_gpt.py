"""Train the tiny GPT in one process on a synthetic task, and watch it learn.

What you will see: a 2-layer GPT (about 26 k parameters) trained from the seed to SORT
five digits: the loss per step falls from ~ln(11) = 2.4 (uniform guessing over 11 tokens)
to ~0.05; then the model, decoding greedily, answers prompts it never saw in training
(the "eval" split), and the demo ends with its exact-match accuracy (~97 %). A few
seconds. This run is `baseline.train_single_process`, the ground truth every parallel
layout is compared with.

Run:       python demos/05_train_gpt.py [--task reverse --steps 200 --lr 3e-3 ...]
Read with: minidist/nn/gpt.py, minidist/nn/attention.py, minidist/data.py,
           minidist/baseline.py, minidist/optim/adamw.py
Paper:     Radford et al. 2019, "Language models are unsupervised multitask learners"
           (GPT-2); Loshchilov & Hutter 2019, arXiv:1711.05101 (AdamW)
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")           # one BLAS thread: faster for tiny matrices

import argparse                                # noqa: E402

from minidist.baseline import train_single_process                                     # noqa
from minidist.cli import CliParser                                                      # noqa
from minidist.data import (TASKS, DataConfig, SyntheticData, answer_accuracy,           # noqa
                           model_config_for)
from minidist.nn import GPT                                                          # noqa

# --- settings (each can be overridden on the command line) ---
TASK, LENGTH, STEPS, BATCH, LR, SEED = "sort", 5, 300, 32, 3e-3, 0
N_LAYER, N_EMBD, N_HEAD, DTYPE = 2, 32, 2, "float32"
TARGET_ACCURACY, EVAL_PROMPTS = 0.9, 64
# each number option's (low, high): the demo stays small
LIMITS = dict(length=(1, 16), steps=(1, 100_000), batch=(1, 512), lr=(0.0, 1.0),
              seed=(0, 2 ** 32), n_layer=(1, 8), n_embd=(1, 256), n_head=(1, 64),
              target_accuracy=(0.0, 1.0))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default=TASK, choices=TASKS)
    ap.add_argument("--dtype", default=DTYPE, choices=["float32", "float64"])
    ap.add_numbers(dict(length=LENGTH, steps=STEPS, batch=BATCH, lr=LR, seed=SEED,
                        n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD,
                        target_accuracy=TARGET_ACCURACY), LIMITS)
    a = ap.parse_args(argv)
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    data_cfg = DataConfig(task=args.task, length=args.length, seed=args.seed)
    cfg = model_config_for(data_cfg, n_layer=args.n_layer, n_embd=args.n_embd,
                           n_head=args.n_head, dtype=args.dtype)
    data = SyntheticData(data_cfg)
    params = GPT(cfg, seed=args.seed).num_parameters()
    print(f"demo 05 · train GPT · task {args.task} · {cfg.n_layer} layers, C={cfg.n_embd}, "
          f"{params / 1e3:.1f}k params · {cfg.dtype} · batch {args.batch} · AdamW lr {args.lr}")
    x, y = data.global_batch(0, 1)
    print(f"one training sequence: x = {data.decode(x[0])}   y = "
          f"{' '.join('.' if t < 0 else data.decode([t]) for t in y[0])}  ('.' = no loss)")

    def progress(step: int, loss: float, model: GPT) -> None:
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d} | loss {loss:.4f}")

    result = train_single_process(cfg, data_cfg, steps=args.steps, global_batch=args.batch,
                                  lr=args.lr, seed=args.seed, on_step=progress)
    model = GPT(cfg, seed=None)
    model.load_state_dict(result.params)
    acc, lines = answer_accuracy(model, data, n=EVAL_PROMPTS)
    print("\nheld-out prompts (never in training) | the model's greedy answer:")
    for line in lines[:6]:
        print("  " + line)
    first, last = result.losses[0], result.losses[-1]
    verdict = "OK" if acc >= args.target_accuracy and last < first else "MISMATCH"
    print(f"{verdict}: loss {first:.3f} -> {last:.3f}; {acc:.0%} of {EVAL_PROMPTS} held-out "
          f"prompts answered exactly (target >= {args.target_accuracy:.0%})")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    raise SystemExit(main())
