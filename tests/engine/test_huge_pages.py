"""The fast path's weights, and the compiled steps' packed copies, on huge pages (engine/models/huge_pages.py)."""

import sys
from pathlib import Path

import pytest
import torch

from engine.base.request import GenerationRequest
from engine.generation.generate import generate
from engine.models import huge_pages
from engine.models.loading import LoadRequest, load_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(huge_pages.mmap, "MADV_HUGEPAGE"),
                                reason="huge pages are advised on Linux only")


def advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding ``address`` is advised for huge pages (smaps' VmFlags "hg")."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


def advised_when_disabled(folder: str, precision: str) -> int:
    """How many of the model's weights lie in memory advised for huge pages when it loads with
    them switched off, in a process of its own: a long test process holds mappings that other
    tests advised, which its allocator may hand out again."""
    import os
    import subprocess

    code = (f"from tests.engine.test_huge_pages import advised_for_huge_pages, weights\n"
            f"from engine.models.loading import LoadRequest, load_model\n"
            f"plain = load_model(LoadRequest({folder!r}, {precision!r}, 'cpu'))\n"
            f"print(sum(advised_for_huge_pages(t.data_ptr()) for t in weights(plain.fast)))\n")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                            env={**os.environ, huge_pages.DISABLE_ENV: "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.strip().splitlines()[-1])


def weights(decoder) -> list[torch.Tensor]:
    return [t for m in decoder.modules() for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]


def answer(loaded) -> list[int]:
    return list(generate(loaded, GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=12,
                                                   ignore_eos=True)))[-1].token_ids


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, byte_tokenizer):
    """A llama whose quantized weights span a few huge pages (int8 ~15 MiB, int4 ~8; the tiny ones hold ~0.2)."""
    from tests.tiny import build_model_folder

    return build_model_folder(tmp_path_factory.mktemp("wide") / "llama", "llama", byte_tokenizer, hidden_size=256,
                              intermediate_size=2048, num_hidden_layers=8)


def first_tensor(module) -> torch.Tensor:
    return next(t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)


@pytest.mark.parametrize("precision", ["fp32-fast", "bf16-fast", "int8-fast", "int4-fast"])
def test_the_weights_move_to_huge_pages_and_answer_the_same(wide_llama, precision, monkeypatch):
    from engine.models import kernels

    if precision in ("int8-fast", "int4-fast") and not kernels.kernels():
        pytest.skip(f"the int8 kernels don't load here: {kernels.unavailable()}")
    folder = str(wide_llama)
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "1")
    plain = load_model(LoadRequest(folder, precision, "cpu"))
    assert plain.fast.huge_page_bytes == 0
    assert advised_when_disabled(folder, precision) == 0
    monkeypatch.delenv(huge_pages.DISABLE_ENV)
    moved = load_model(LoadRequest(folder, precision, "cpu"))
    tensors = weights(moved.fast)
    before = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weights(plain.fast)}
    # the same bytes (no padding: the weights' measured size stays the predicted one), in one
    # storage of exactly that size, from a 2 MiB boundary; its whole huge pages advised, the tail not
    assert moved.fast.huge_page_bytes == sum(before.values()) == moved.info.weights_bytes == plain.info.weights_bytes
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert tensors[0].untyped_storage().nbytes() == moved.fast.huge_page_bytes
    base = tensors[0].untyped_storage().data_ptr()
    whole = moved.fast.huge_page_bytes // huge_pages.HUGE_PAGE * huge_pages.HUGE_PAGE
    assert base % huge_pages.HUGE_PAGE == 0 and whole >= 2 * huge_pages.HUGE_PAGE
    assert all(advised_for_huge_pages(t.data_ptr()) == (t.data_ptr() < base + whole) for t in tensors)
    # the values unchanged, views still views: q/k/v's weights lie inside the fused one
    for mine, theirs in zip(weights(moved.fast), weights(plain.fast)):
        assert mine.shape == theirs.shape and mine.stride() == theirs.stride() and torch.equal(mine, theirs)
    layer = moved.fast.layers[0]
    fused, part = first_tensor(layer.qkv), first_tensor(layer.projections[0])
    assert part.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert answer(moved) == answer(plain)


def test_a_copy_keeps_every_view_of_its_storage():
    """A compiled step's packed copy is read from its package as one tensor, and the step's
    constants are views of it at offsets into its storage (engine/generation/compiled_step.py):
    copied onto huge pages, every such view reaches the same values it did."""
    storage = torch.randn(3 * huge_pages.HUGE_PAGE // 4 + 7)
    tensor = storage[5:5 + 2 * 1000].view(2, 1000)
    copy = huge_pages.copied(tensor)
    assert copy.data_ptr() != tensor.data_ptr() and advised_for_huge_pages(copy.data_ptr())
    assert copy.shape == tensor.shape and copy.stride() == tensor.stride()
    assert copy.storage_offset() == tensor.storage_offset() and torch.equal(copy, tensor)
    assert copy.untyped_storage().nbytes() == storage.untyped_storage().nbytes()
    for shape, stride, offset in (((7,), (1,), 0), ((3, 4), (1, 3), 11), ((2,), (1,), storage.numel() - 2)):
        assert torch.equal(copy.as_strided(shape, stride, offset), tensor.as_strided(shape, stride, offset))


def test_a_buffer_is_zeroed_aligned_and_advised():
    buffer = huge_pages.huge_page_buffer(3 * huge_pages.HUGE_PAGE + 5)
    assert buffer.numel() == 3 * huge_pages.HUGE_PAGE + 5 and buffer.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert buffer.untyped_storage().nbytes() == buffer.numel() and int(buffer.count_nonzero()) == 0
    last_whole = buffer.data_ptr() + 3 * huge_pages.HUGE_PAGE
    assert advised_for_huge_pages(buffer.data_ptr()) and advised_for_huge_pages(last_whole - 1)
    assert not advised_for_huge_pages(last_whole)  # the 5 bytes' page: a huge page there would be ~2 MiB of nothing
