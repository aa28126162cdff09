"""A tiny reverse-mode autograd on xp arrays (NumPy or CuPy).

    from minidist.autograd import Tensor, functional as F
    x = Tensor(xp_array, requires_grad=True)
    loss = F.cross_entropy(F.gelu(x @ w) @ v, targets)
    loss.backward()          # x.grad, w.grad, v.grad now hold dloss/d(.)

Reading order: tensor.py (the Tensor, the backward walk, how an operation is
defined, and the elementary operations behind a Tensor's operators),
functional.py and fused.py (activations, norms, losses), gradcheck.py (how
every backward rule is tested); saved.py and split.py serve memory accounting
and the pipeline's split backward.
"""

from minidist.autograd import functional
from minidist.autograd.gradcheck import gradcheck
from minidist.autograd.tensor import Context, Function, Tensor, is_grad_enabled, no_grad

__all__ = ["Tensor", "Function", "Context", "no_grad", "is_grad_enabled", "functional",
           "gradcheck"]
