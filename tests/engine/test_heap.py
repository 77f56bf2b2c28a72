"""Frozen long-lived objects: collections skip them, and a release frees a dropped model's cycles."""

import gc
import weakref

from engine.base import heap


class Node:
    pass


def test_settled_cycles_survive_collections_until_released(monkeypatch):
    monkeypatch.setattr(heap, "_collector", None)  # as the CLI and the server have it (the app collects on its GUI thread)
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


def test_a_release_is_handed_to_the_collector_where_one_is_named(monkeypatch):
    """The app's GUI thread collects (Qt widgets in garbage cycles must be destroyed there)."""
    asked = []
    monkeypatch.setattr(heap, "_collector", None)
    heap.collect_on(lambda: asked.append(True))
    try:
        node = Node()
        node.me = node
        alive = weakref.ref(node)
        heap.settle()
        del node
        heap.release()
        assert asked == [True] and alive() is not None  # not collected here
        heap.collect()  # what the collector runs
        assert alive() is None
    finally:
        heap.collect_on(None)
        gc.unfreeze()
