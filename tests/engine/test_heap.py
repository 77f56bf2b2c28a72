"""Frozen long-lived objects: collections skip them, and a release frees a dropped model's cycles."""

import gc
import weakref

from engine import heap


class Node:
    pass


def test_settled_cycles_survive_collections_until_released():
    try:
        node = Node()
        node.me = node  # a reference cycle, as a model's modules and hooks make
        alive = weakref.ref(node)
        heap.settle()
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()  # a collection skips frozen objects: the cycle is kept
        assert alive() is not None
        heap.release()  # what closing a model does
        assert alive() is None
        assert gc.get_freeze_count() > 0  # what is left is frozen again
    finally:
        gc.unfreeze()
