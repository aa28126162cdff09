"""Throughput: count the FLOPs of a training step, check them against 6N + 12LHQT, get MFU.

What you will see: a small GPT trained for a few steps in this process. The first step
runs under the FLOP ledger, which counts every operation that executes: the table lists
them by op and phase (forward, backward, optimizer), matmul FLOPs apart from the rest.
Then PaLM's closed form for the same step, term by term: 6N' + 12LHQT with N' the
non-embedding parameters, minus the biases and LayerNorm parameters (in N', but no matmul),
plus the tied LM head (a matmul, not in N'); it equals the ledger's matmul FLOPs exactly.
Last, this CPU's measured matmul peak and, for each timed step, tokens/s, MFU (model FLOPs,
6N + 12LHQT per token with N every parameter, / time / peak) and HFU (all FLOPs).

Run:       python demos/24_throughput.py [--n-layer 2 --n-embd 64 --steps 5]
Read with: minidist/observe/throughput.py, minidist/observe/flops.py,
           minidist/observe/op_flops.py, minidist/observe/peak.py
Paper:     Chowdhery et al. 2022, "PaLM", arXiv:2204.02311, App. B (MFU, 6N + 12LHQT)
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")           # one BLAS thread: the peak is per thread

import argparse                                # noqa: E402
import contextlib                              # noqa: E402
import statistics                              # noqa: E402
import sys                                     # noqa: E402
import time                                    # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minidist import optim                     # noqa: E402
from minidist.cli import CliParser             # noqa: E402
from minidist.data import DataConfig, SyntheticData, model_config_for  # noqa: E402
from minidist.nn import GPT                    # noqa: E402
from minidist.observe.flops import FlopLedger  # noqa: E402
from minidist.observe.peak import peak_flops   # noqa: E402
from minidist.observe.throughput import closed_form, from_ledger  # noqa: E402

# --- settings (each can be overridden on the command line) ---
N_LAYER, N_EMBD, N_HEAD, LENGTH, BATCH, STEPS, DTYPE, PEAK_SIZE = 2, 64, 4, 16, 16, 5, \
    "float32", 1024


# each number option's (low, high): the demo stays small
LIMITS = dict(n_layer=(1, 8), n_embd=(1, 256), n_head=(1, 64), length=(1, 16),
              batch=(1, 256), steps=(1, 1000), peak_size=(1, 4096))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, length=LENGTH,
                        batch=BATCH, steps=STEPS, peak_size=PEAK_SIZE), LIMITS)
    ap.add_argument("--dtype", default=DTYPE, choices=["float32", "float64"])
    ap.add_argument("--peak-cache", default=None,
                    help="the peak's cache file (default ~/.cache/minidist/peak.json)")
    a = ap.parse_args(argv)
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    return a


def train(a, cfg, data_cfg) -> tuple[FlopLedger, list[float]]:
    """Step 0 under the ledger (forward, backward, grad norm, AdamW), then `steps` timed
    steps with it off; returns (the ledger, seconds of each timed step)."""
    model, data = GPT(cfg, 0), SyntheticData(data_cfg)
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    ledger, times = FlopLedger(), []
    for step in range(a.steps + 1):
        x, y = data.batch(data.global_indices(step, a.batch))         # (B, T) each
        t0 = time.perf_counter()
        with ledger if step == 0 else contextlib.nullcontext():
            _, loss = model(x, y)
            loss.backward()
            optim.global_grad_norm([p.grad for p in model.parameters()])
            if step == 0:
                ledger.count_optimizer(opt)                # the norm and the update
            opt.step()
            opt.zero_grad()
        if step:
            times.append(time.perf_counter() - t0)
    return ledger, times


def main() -> None:
    a = parse_args()
    data_cfg = DataConfig(task="sort", length=a.length)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           dtype=a.dtype)
    T, tokens = data_cfg.block_size, a.batch * data_cfg.block_size
    print(f"demo 24 · throughput · GPT {cfg.n_layer} layers, C={cfg.n_embd}, "
          f"H={cfg.n_head}, T={T}, V={cfg.vocab_size} · {cfg.dtype}\nbatch {a.batch} "
          f"({tokens} tokens per step)")
    ledger, times = train(a, cfg, data_cfg)
    print("\nFLOP ledger of step 0 (observe/flops.py; rules in observe/op_flops.py):")
    print(ledger.table())

    cf = closed_form(cfg, T)
    print(f"\nclosed form, per step of {tokens} tokens (PaLM App. B, observe/throughput.py):")
    for label, per_token in cf.terms():
        print(f"  {label:<48}{per_token * tokens:>16,d}")
    matmul = ledger.model_flops()
    equal = matmul == cf.matmul * tokens
    print(f"  {'ledger: MatMul FLOPs, forward + backward':<48}{matmul:>16,d}   "
          f"{'equal' if equal else 'DIFFERENT'}")
    print(f"  (6N' + 12LHQT alone: {cf.palm * tokens:,}, off by "
          f"{cf.palm * tokens / matmul - 1:+.2%}; the other FLOPs add "
          f"{ledger.total('other') / matmul:.1%} to the matmuls)")

    pk = peak_flops(a.dtype, n=a.peak_size, path=a.peak_cache)
    print(f"\npeak {pk.dtype}: {pk.flops / 1e9:.1f} GFLOP/s (({pk.n}, {pk.n}) matmul, one "
          f"thread, median of {pk.repeats};\n  {'cached in' if pk.cached else 'saved to'} "
          f"{pk.path})")
    print(f"{'step':>4}{'ms':>9}{'tokens/s':>10}{'MFU':>8}{'HFU':>8}")
    for i, s in enumerate(times, start=1):
        t = from_ledger(ledger, cfg, s, tokens, pk.flops)
        print(f"{i:>4}{s * 1e3:>9.2f}{t.tokens_per_s:>10.0f}{t.mfu:>8.1%}{t.hfu:>8.1%}")
    med = from_ledger(ledger, cfg, statistics.median(times), tokens, pk.flops)
    verdict = "OK" if equal else "MISMATCH"
    print(f"median of the {len(times)} timed steps: MFU {med.mfu:.1%}, HFU {med.hfu:.1%}")
    print(f"{verdict}: FLOP ledger = 6N' + 12LHQT - 6 x {cf.n_vector:,} vectors + 6 x "
          f"{cf.head:,} head = {cf.matmul:,} FLOPs/token, exactly" if equal else
          f"{verdict}: ledger {matmul:,} != closed form {cf.matmul * tokens:,} FLOPs")
    raise SystemExit(verdict != "OK")


if __name__ == "__main__":
    main()
