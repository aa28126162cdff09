"""What the graph keeps for the backward, counted by hand: each buffer once, views with their
base, parameters excluded, only the nodes the backward would visit."""

import numpy as np

from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.autograd.saved import base_buffer, saved_by_op, saved_bytes
from minidist.nn.module import Parameter


def _leaf(*shape, dtype=np.float64):
    return Tensor(np.ones(shape, dtype), requires_grad=True)


def test_matmul_saves_both_inputs():
    a, b = _leaf(3, 4), _leaf(4, 5)
    y = a @ b
    assert saved_bytes(y) == (3 * 4 + 4 * 5) * 8
    assert saved_by_op(y) == {"MatMul": 256}
    assert saved_bytes(y, exclude=[b]) == 3 * 4 * 8              # b is a parameter
    assert saved_bytes(y, exclude=[b.data]) == 3 * 4 * 8         # arrays work too


def test_a_view_and_its_base_count_once():
    a = _leaf(4, 3)
    u = a * 1.0                          # Mul keeps a (the 1.0 is a number: 0 bytes); u is new
    w = u[0:2] * u[2:4]                  # keeps two views of u's buffer: counted as u, once
    assert base_buffer(u[0:2].data) is u.data
    assert saved_bytes(w) == 2 * 4 * 3 * 8                       # a and u
    assert saved_bytes(w, exclude=[a]) == 4 * 3 * 8              # u only


def test_a_transposed_parameter_is_excluded_with_its_base():
    w, x = _leaf(5, 3), _leaf(2, 3)
    y = x @ w.transpose()                # the tied LM head: MatMul keeps a view of w
    assert saved_bytes(y) == (2 * 3 + 5 * 3) * 8
    assert saved_bytes(y, exclude=[w]) == 2 * 3 * 8


def test_the_same_array_saved_twice_counts_once():
    x = _leaf(7, dtype=np.float32)
    assert saved_bytes(x * x) == 7 * 4


def test_array_attributes_of_ctx_count():
    # masked_fill keeps its bool mask as ctx.cond (an attribute, not saved_tensors), and
    # shapes (tuples of ints) as ctx.shapes: T*T bytes in all
    x = _leaf(2, 6, 6)
    mask = np.triu(np.ones((6, 6), bool), k=1)
    assert saved_bytes(F.masked_fill(x, mask, -np.inf)) == 36
    ids = np.array([[1, 0, 2]])          # Embedding keeps the int64 ids it looked up
    table = _leaf(3, 4)
    assert saved_bytes(F.embedding(table, ids), exclude=[table]) == 3 * 8


def test_layer_norm_keeps_xhat_and_the_inverse_std():
    B, T, C = 2, 5, 8
    x, w, b = _leaf(B, T, C), _leaf(C), _leaf(C)
    y = F.layer_norm(x, w, b)
    assert saved_bytes(y, exclude=[w, b]) == (B * T * C + B * T) * 8     # xhat, 1/sigma
    assert saved_bytes(y) == (B * T * C + B * T + C) * 8                 # + w, kept too


def test_only_nodes_the_backward_visits_count():
    const = Tensor(np.ones((3, 3)))                  # no grad: its ops record no node
    y = const * 2.0
    w = _leaf(3, 3)
    assert saved_bytes(y) == 0                       # y is a leaf without a node
    z = y @ w
    assert saved_bytes(z) == 2 * 9 * 8              # y and w; y's own history is not a node
    assert saved_bytes(w) == 0


def test_parameters_are_excluded_like_tensors():
    p = Parameter((4, 2), init=None)
    x = _leaf(3, 4)
    assert saved_bytes(x @ p, exclude=[p]) == 3 * 4 * 8


def test_breakdown_sums_to_the_total_and_deep_graphs_work():
    x = _leaf(10)
    y = x
    for _ in range(5000):                # deeper than Python's recursion limit
        y = y + 0.0                      # Add keeps shapes only
    z = F.gelu(y)                        # keeps its input and tanh: 2 x 10 float64
    parts = saved_by_op(z)
    assert parts == {"Gelu": 160} and sum(parts.values()) == saved_bytes(z)
