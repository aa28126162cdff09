"""The tiny autograd: one backward pass gives every gradient; finite differences confirm it.

What you will see: a small expression, L = sum(softmax(tanh(x @ w) * s) * log(1 + y^2)),
evaluated forward; its gradients with respect to x, w and s from ONE call to
L.backward(); and the same gradients measured the slow way, by nudging every input
element by +-eps and re-evaluating L (central differences, 2 forward passes per element).
The two agree to about eps^2, so the demo ends with OK and the largest difference.

Run:       python demos/04_autograd.py [--eps 1e-6] [--seed 0]
Read with: minidist/autograd/tensor.py (the Tensor, the backward walk, Function and the
           elementary operations), minidist/autograd/gradcheck.py
Paper:     Baydin et al. 2018, "Automatic differentiation in machine learning: a survey",
           JMLR 18, arXiv:1502.05767 (reverse mode, Sec. 3.2)
"""

import numpy as np

from minidist.autograd import Tensor, no_grad
from minidist.autograd import functional as F
from minidist.cli import CliParser, at_least

# --- settings (each can be overridden on the command line) ---
EPS, SEED, TOLERANCE = 1e-6, 0, 1e-8


def expression(x: Tensor, w: Tensor, s: Tensor, y: np.ndarray) -> Tensor:
    """L = sum(softmax(tanh(x @ w) * s) * log(1 + y^2)): matmul, tanh, broadcast, softmax."""
    h = (x @ w).tanh() * s                         # (2, 3) @ (3, 4) -> (2, 4), s (4,) broadcast
    return (F.softmax(h, axis=-1) * np.log1p(y ** 2)).sum()


def finite_differences(f, arrays: list[np.ndarray], eps: float) -> list[np.ndarray]:
    """dL/da_k ~ (L(a + eps e_k) - L(a - eps e_k)) / (2 eps), for every element of every a."""
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        for k in np.ndindex(a.shape):
            orig = a[k]
            a[k] = orig + eps
            up = f()
            a[k] = orig - eps
            down = f()
            a[k] = orig
            g[k] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def parse_args(argv=None):
    ap = CliParser(description="autograd vs finite differences")
    ap.add_argument("--eps", type=at_least(1e-12, float), default=EPS,
                    help="the finite differences' step")
    ap.add_argument("--seed", type=at_least(0), default=SEED)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    x, w, s = (Tensor(rng.standard_normal(shape), requires_grad=True)
               for shape in [(2, 3), (3, 4), (4,)])
    y = rng.standard_normal((2, 4))
    print("demo 04 · autograd · L = sum(softmax(tanh(x @ w) * s) * log(1 + y^2)) · float64")

    loss = expression(x, w, s, y)
    loss.backward()                                # one reverse sweep: all three gradients
    print(f"L = {loss.item():.12f}")

    def f():
        with no_grad():
            return expression(x, w, s, y).item()

    numeric = finite_differences(f, [x.data, w.data, s.data], args.eps)
    worst = 0.0
    for name, t, num in zip("xws", (x, w, s), numeric):
        diff = np.abs(t.grad - num).max()
        worst = max(worst, diff)
        print(f"\ndL/d{name} {t.shape} from backward():\n{np.array2string(t.grad, precision=6)}")
        print(f"central differences (eps={args.eps:g}): max |Δ| = {diff:.1e}")
    verdict = "OK" if worst < TOLERANCE else "MISMATCH"
    print(f"\n{verdict}: backward() gradients match finite differences (max |Δ| = {worst:.1e})")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    raise SystemExit(main())
