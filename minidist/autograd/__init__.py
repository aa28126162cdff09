"""A tiny reverse-mode autograd on xp arrays (NumPy or CuPy).

    from minidist.autograd import Tensor, functional as F
    x = Tensor(xp_array, requires_grad=True)
    loss = F.cross_entropy(F.gelu(x @ w) @ v, targets)
    loss.backward()          # x.grad, w.grad, v.grad now hold dloss/d(.)

Reading order: tensor.py (Tensor and the backward walk), function.py (how an
operation is defined), ops.py (arithmetic, reductions, reshapes, indexing),
functional.py and fused.py (matmul, activations, norms, losses),
gradcheck.py (how every backward rule is tested).
"""

# tensor.py first: it defines Tensor, then imports ops/functional, which build on it.
from minidist.autograd.tensor import Tensor, is_grad_enabled, no_grad  # isort: skip
from minidist.autograd import functional
from minidist.autograd.function import Context, Function
from minidist.autograd.gradcheck import gradcheck

__all__ = ["Tensor", "Function", "Context", "no_grad", "is_grad_enabled", "functional",
           "gradcheck"]
