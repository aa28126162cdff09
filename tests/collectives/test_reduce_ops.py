"""Reduction operators: what each op computes, in which operand order, and what it refuses."""

import numpy as np
import pytest

from minidist.collectives.reduce_ops import OPS, check_op, combine, finish, fold_in_order

RNG = np.random.default_rng(0)
A, B = RNG.standard_normal(50), RNG.standard_normal(50)


@pytest.mark.parametrize("op, ufunc", [("sum", np.add), ("avg", np.add), ("max", np.maximum),
                                        ("min", np.minimum), ("prod", np.multiply)])
def test_combine_is_the_ufunc_and_in_place_gives_the_same_bits(op, ufunc):
    assert np.array_equal(combine(op, A, B), ufunc(A, B))
    acc = A.copy()
    assert combine(op, acc, B, out=acc) is acc
    assert np.array_equal(acc, ufunc(A, B))


def test_fold_in_order_is_the_sequential_left_fold():
    xs = [RNG.standard_normal(1000) * 10.0 ** k for k in range(-5, 6)]
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    folded = fold_in_order("sum", xs)
    assert np.array_equal(folded, acc)
    assert not np.shares_memory(folded, xs[0]) and np.array_equal(xs[0], xs[0])
    # the order matters: folding the reversed list gives different bits somewhere
    assert not np.array_equal(fold_in_order("sum", xs[::-1]), acc)
    assert np.array_equal(fold_in_order("max", xs), np.max(xs, axis=0))


def test_finish_divides_only_avg_and_keeps_the_dtype():
    s = np.array([3.0, 7.0], np.float32)
    out = finish("avg", s, 4)
    assert out.dtype == np.float32 and out.tolist() == [0.75, 1.75]
    assert np.array_equal(finish("avg", np.array([1.0, 2.0]), 3), np.array([1.0, 2.0]) / 3.0)
    for op in ("sum", "max", "min", "prod"):
        assert finish(op, s, 4) is s


def test_check_op_accepts_numeric_dtypes():
    for op in OPS:
        for dt in (np.float16, np.float32, np.float64, np.complex128):
            assert check_op(op, dt) == op
    for dt in (np.int8, np.int32, np.int64, np.uint16):
        assert check_op("sum", dt) == "sum"


@pytest.mark.parametrize("op, dtype, words", [
    ("mean", np.float64, "Use one of"), (None, np.float64, "unknown op"),
    ("avg", np.int64, "op='sum'"), ("avg", np.uint8, "op='sum'"),
    ("sum", np.bool_, "x.astype"), ("sum", np.dtype("U3"), "int, float or complex"),
    ("max", np.dtype(object), "int, float or complex")])
def test_check_op_refuses_with_a_fix(op, dtype, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        check_op(op, dtype, "all_reduce")
