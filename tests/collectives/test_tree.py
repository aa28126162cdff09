"""The binomial tree's shape: parents, children and subtrees agree for every W, and the
picture in tree.py's docstring is the one the code draws."""

import textwrap

from minidist.collectives import tree


def test_docstring_picture_is_drawn_by_the_code():
    assert textwrap.indent(tree.render(6), "    ") in tree.__doc__


def test_parents_children_and_subtrees_agree():
    for W in range(1, 40):
        seen = []
        for v in range(W):
            for c in tree._children(v, W):
                assert c - tree._lowbit(c) == v, f"W={W}: child {c} of {v} has another parent"
                seen.append(c)
            # a subtree is v itself plus its children's subtrees, a contiguous block
            assert tree._subtree(v, W) == 1 + sum(tree._subtree(c, W) for c in
                                                  tree._children(v, W))
        assert sorted(seen) == list(range(1, W)), f"W={W}: every non-root has one parent"
        # the root sends once per round: ceil(log2 W) children
        assert len(tree._children(0, W)) == (W - 1).bit_length()
