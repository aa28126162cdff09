"""The oracle itself, checked on cases small enough to work out by hand."""

import numpy as np

from minidist.collectives import simulated

XS = [np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0]), np.array([100.0, 200.0, 300.0])]


def test_reductions_by_hand():
    assert all(r.tolist() == [111.0, 222.0, 333.0] for r in simulated.all_reduce(XS))
    assert all(r.tolist() == [37.0, 74.0, 111.0] for r in simulated.all_reduce(XS, "avg"))
    assert simulated.all_reduce(XS, "min")[2].tolist() == [1.0, 2.0, 3.0]
    assert simulated.all_reduce(XS, "prod")[0].tolist() == [1000.0, 8000.0, 27000.0]
    red = simulated.reduce(XS, root=1, op="max")
    assert red[0] is None and red[2] is None and red[1].tolist() == [100.0, 200.0, 300.0]
    # 3 elements over 3 ranks: one each; 3 over 2 ranks would be [2, 1] (np.array_split)
    assert [c.tolist() for c in simulated.reduce_scatter(XS)] == [[111.0], [222.0], [333.0]]
    two = simulated.reduce_scatter(XS[:2])
    assert [c.tolist() for c in two] == [[11.0, 22.0], [33.0]]


def test_data_movement_by_hand():
    assert all(b.tolist() == [10.0, 20.0, 30.0] for b in simulated.broadcast(XS, root=1))
    assert all(g.shape == (3, 3) and g[2, 0] == 100.0 for g in simulated.all_gather(XS))
    gathered = simulated.gather(XS, root=2)
    assert gathered[0] is None and gathered[2][1].tolist() == [10.0, 20.0, 30.0]
    assert [s.tolist() for s in simulated.scatter(np.arange(6).reshape(3, 2), 3)] == \
        [[0, 1], [2, 3], [4, 5]]


def test_all_to_all_by_hand():
    # rank 0 sends row a0 to 0 and rows a1, a2 to 1; rank 1 sends nothing to 0, b0 to 1.
    xs = [np.array(["a0", "a1", "a2"]), np.array(["b0"])]
    out = simulated.all_to_all(xs, [[1, 2], [0, 1]])
    assert out[0].tolist() == ["a0"] and out[1].tolist() == ["a1", "a2", "b0"]
