"""Gang placement (cluster/placement.py): one node, best fit, for g <= G; whole empty nodes
for g > G; fragmentation refuses a gang although enough GPUs are free in total."""

import pytest

from minidist.cluster.placement import Cluster, give_back, place, take


def test_small_job_goes_to_the_fullest_node_that_fits():
    assert place([4, 1, 2, 3], 2, 4) == ((2, 2),)          # 2 free beats 3 and 4 free
    assert place([4, 2, 2], 2, 4) == ((1, 2),)             # a tie goes to the lower index
    assert place([4, 1, 2, 3], 4, 4) == ((0, 4),)
    assert place([0, 0, 0], 1, 4) is None


def test_fragmentation_four_free_gpus_but_no_node_with_three():
    free = [1, 1, 2]
    assert sum(free) >= 3 and place(free, 3, 4) is None
    assert place(free, 2, 4) == ((2, 2),)


def test_big_job_takes_whole_empty_nodes_in_index_order():
    assert place([8, 7, 8, 8], 16, 8) == ((0, 8), (2, 8))
    assert place([8, 7, 8, 7], 24, 8) is None               # two whole nodes, not three


def test_take_and_give_back_keep_the_books_and_refuse_overdrafts():
    free = [4, 4]
    take(free, ((1, 3),))
    assert free == [4, 1]
    with pytest.raises(RuntimeError, match="node 1 has 1 free"):
        take(free, ((1, 2),))
    give_back(free, ((1, 3),), 4)
    assert free == [4, 4]
    with pytest.raises(RuntimeError, match="more than its 4"):
        give_back(free, ((0, 1),), 4)


def test_cluster_refuses_jobs_it_can_never_place():
    c = Cluster(2, 8)
    assert c.capacity == 16
    c.check_fits("ok", 16)
    with pytest.raises(ValueError, match="needs 32 GPUs, but the cluster has only 2 x 8 = 16"):
        c.check_fits("big", 32)
    with pytest.raises(ValueError, match="use 8 or 16 GPUs"):
        c.check_fits("odd", 12)
    with pytest.raises(ValueError, match="nodes must be an int >= 1"):
        Cluster(0, 8)
