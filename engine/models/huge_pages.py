"""The fast path's weights on transparent huge pages (Linux).

A decode step reads every weight once, front to back, from memory: 142 MiB a token for the
default model in int8-fast, 513 MiB in fp32-fast. In ordinary 4 KiB pages that is tens of
thousands of pages a step, each a TLB miss and a page walk, and the CPU's stream prefetcher
stops at every page's end. In 2 MiB pages it is a few hundred. Linux gives a process huge pages
where it asks for them (``madvise(MADV_HUGEPAGE)``; most distributions ship transparent huge pages
in that "madvise" mode), but PyTorch allocates each tensor on its own, and most weights are too
small for a huge page of their own. So once the fast decoder is built, its weights are copied
into one anonymous mapping advised for huge pages, each tensor becoming a view of its copy
(tensors that shared memory, such as q/k/v's views of their fused weight, still share it). The
compiled steps' packed copies of the fp32 and bf16 weights, read from their package as they
load, are copied onto huge pages the same way (:func:`copied`).

Measured by ``benchmarks/huge_pages.py`` (the model loaded twice in one process, one moved,
64-token decodes alternating round by round): docs/benchmarks.md, "Huge pages".

``INFERENCE_WORKBENCH_NO_HUGE_PAGES=1`` leaves the weights where they are (for comparisons).
Where the platform has no ``MADV_HUGEPAGE`` (macOS, Windows) nothing moves.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable

import torch
from torch import nn

HUGE_PAGE = 2 << 20
"""x86-64's transparent huge page: 2 MiB."""
DISABLE_ENV = "INFERENCE_WORKBENCH_NO_HUGE_PAGES"


def available() -> bool:
    """Whether this platform can advise memory for huge pages (and it isn't turned off)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and not os.environ.get(DISABLE_ENV)


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory as a uint8 tensor (its storage exactly ``nbytes``), starting
    on a 2 MiB boundary of an anonymous private mapping whose whole 2 MiB pages are advised for
    huge pages (the tail stays in ordinary pages: a huge page there would hold up to 2 MiB of
    nothing). The mapping lives as long as a view of it does."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = -torch.frombuffer(mapping, dtype=torch.uint8).data_ptr() % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole:
        mapping.madvise(mmap.MADV_HUGEPAGE, skip, whole)
    return torch.frombuffer(memoryview(mapping)[skip:skip + nbytes], dtype=torch.uint8)  # holds the mapping


def _alignment(size: int) -> int:
    """The largest power of two, up to 64, that divides ``size``."""
    return min(size & -size, 64) if size else 64


def _by_storage(modules: Iterable[nn.Module]) -> tuple[dict[int, list[tuple[nn.Module, str, torch.Tensor]]],
                                                       dict[int, int]]:
    """The CPU parameters and buffers of ``modules`` as (module, name, tensor), grouped by the
    address of their storage, and each storage's bytes. (A function of its own: its loop
    variables, which would hold the last tensor, go when it returns.)"""
    storages: dict[int, list[tuple[nn.Module, str, torch.Tensor]]] = {}
    sizes: dict[int, int] = {}
    seen: set[int] = set()
    for module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.device.type == "cpu" and tensor.numel():
                    storage = tensor.untyped_storage()
                    storages.setdefault(storage.data_ptr(), []).append((module, name, tensor))
                    sizes[storage.data_ptr()] = storage.nbytes()
    return storages, sizes


def _copy_storage(place: torch.Tensor, tensor: torch.Tensor) -> None:
    """``tensor``'s whole storage, byte for byte, into ``place`` (uint8, as many bytes)."""
    place.copy_(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()))


def _view_in(place: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as it lies in its storage, over ``place`` (uint8: a copy of that storage):
    the same dtype, shape, strides and offset."""
    typed = place[:place.numel() - place.numel() % tensor.element_size()].view(tensor.dtype)
    return typed.as_strided(tensor.shape, tensor.stride(), typed.storage_offset() + tensor.storage_offset())


def copied(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``'s whole storage in a :func:`huge_page_buffer`, viewed with its shape,
    strides and offset (``as_strided`` over it reaches what it reached over the original); the
    tensor itself where :func:`available` is false or it isn't in CPU memory."""
    nbytes = tensor.untyped_storage().nbytes()
    if not available() or tensor.device.type != "cpu" or not nbytes:
        return tensor
    place = huge_page_buffer(nbytes)
    with torch.no_grad():
        _copy_storage(place, tensor)
    return _view_in(place, tensor)


def move_to_huge_pages(modules: Iterable[nn.Module]) -> int:
    """Copy every CPU parameter and buffer of ``modules`` into one :func:`huge_page_buffer`, each
    becoming a view of its copy with the same shape, strides and offset; tensors sharing storage
    keep sharing it. One storage at a time, so the old copy goes as soon as its last tensor has
    moved (memory grows by one storage, not by the whole model). Returns the bytes moved: 0
    where :func:`available` is false or there is nothing to move."""
    if not available():
        return 0
    storages, sizes = _by_storage(modules)
    total = sum(sizes.values())
    if not total:
        return 0
    arena = huge_page_buffer(total)
    offset = 0
    with torch.no_grad():
        # the most aligned sizes first (a cache line's multiples, then the scales' 32 bytes…):
        # each lands aligned as it was, with no padding, so the weights take the bytes they did
        for key in sorted(storages, key=lambda k: -_alignment(sizes[k])):
            users = storages.pop(key)
            size = sizes[key]
            place = arena[offset:offset + size]
            _copy_storage(place, users[0][2])
            for module, name, tensor in users:
                view = _view_in(place, tensor)
                table = module._parameters if name in module._parameters else module._buffers
                table[name] = nn.Parameter(view, requires_grad=tensor.requires_grad) \
                    if isinstance(tensor, nn.Parameter) else view
            del users, tensor  # the old storage's last references here
            offset += size
    return total
