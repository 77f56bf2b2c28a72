"""Which build of the int8 kernels a CPU takes (engine/models/kernels): chosen at run time from
its flags, best first, or as INFERENCE_WORKBENCH_KERNELS_ISA names; none where no build fits,
with the reason. Nothing is compiled here, except by the last test: this CPU's build."""

from __future__ import annotations

import pytest

from engine.models import kernels

AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}


@pytest.mark.parametrize("flags,wanted,chosen", [
    (AVX512 | {"amx_tile", "amx_int8"}, None, "avx512-amx"),
    (AVX512 | {"amx_tile", "amx_int8"}, "avx512-vnni", "avx512-vnni"),
    (AVX512 | {"amx_tile", "amx_bf16"}, None, "avx512-vnni"),  # AMX without its int8 products
    (AVX512, None, "avx512-vnni"),
    (AVX512, "avx2", "avx2"),
    ({"avx2", "fma", "f16c"}, None, "avx2"),
    ({"avx2", "fma", "f16c"}, "avx512-vnni", None),  # asked for what the CPU lacks
    (AVX512 - {"avx512_vnni"}, None, "avx2"),  # AVX-512 without VNNI (Skylake-SP): the AVX2 build
    ({"avx", "sse4_2", "fma", "f16c"}, None, None),
])
def test_the_build_follows_the_cpu_flags(monkeypatch, flags, wanted, chosen):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set(flags))
    if wanted:
        monkeypatch.setenv(kernels.ISA_ENV, wanted)
    else:
        monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    choice = kernels.isa()
    assert (choice.name if choice else None) == chosen
    if chosen is None:
        assert "lacks" in kernels._why_no_isa()


def test_a_name_that_is_no_build_says_so(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set(AVX512))
    monkeypatch.setenv(kernels.ISA_ENV, "neon")
    assert kernels.isa() is None
    assert "names no build" in kernels._why_no_isa() and "avx2" in kernels._why_no_isa()


def test_each_build_has_its_own_folder(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set(AVX512))
    folders = {kernels.build_dir(choice) for choice in kernels.ISAS}
    assert len(folders) == len(kernels.ISAS)
    assert all(folder.name.startswith(choice.name) for folder, choice in
               zip(sorted(folders), sorted(kernels.ISAS, key=lambda c: c.name)))


def test_this_cpus_build_compiles_and_loads():
    """Where the CPU takes a build, it has to compile: test_kernels.py skips its tests where the
    kernels are unavailable (a machine without them), which would hide a build that fails."""
    import os

    if kernels.isa() is None or os.environ.get(kernels.DISABLE_ENV):
        pytest.skip(f"no build for this CPU: {kernels._why_no_isa()}" if kernels.isa() is None
                    else f"{kernels.DISABLE_ENV} is set")
    assert kernels.kernels(), kernels.unavailable()
