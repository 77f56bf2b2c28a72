"""The fast path's own CPU kernels: int8 × int8 matrix products in blocks of 32
(``torch.ops.workbench.q8_linear`` and ``q4_linear``), compiled once per machine, PyTorch version
and source into the user cache, the first time a quantized fast precision loads (about a minute
on two cores; the load says so).

Which source is compiled is chosen at run time from the CPU's flags: q8_gemm_amx.cpp where the
CPU has AMX-INT8 (products of 16 rows or more on AMX tiles, fewer on AVX-512 VNNI), q8_gemm.cpp
for AVX-512 (F, BW, VL, DQ) with VNNI, q8_gemm_avx2.cpp for AVX2 with FMA and F16C (the same
operators, layouts and numerics on 256-bit vectors). Where neither fits, or the compiler fails,
:func:`kernels` is ``False``, :func:`unavailable` says why, and the quantized layers keep using
PyTorch's weight-only kernels (engine/models/quantize.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from engine.storage.paths import cache_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Isa:
    """One build of the kernels: its source, the CPU flags it needs and the compiler's flags."""

    name: str
    source: Path
    flags: tuple[str, ...]
    """/proc/cpuinfo's names for what ``source`` is compiled for."""
    cflags: tuple[str, ...]


_HERE = Path(__file__).parent
HEADERS = (_HERE / "q8_common.h", _HERE / "q8_ops.h", _HERE / "q8_avx512.h", _HERE / "attention.h",
           _HERE / "scores.h", _HERE / "dense.h")
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
_AVX512_CFLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c",
                  "-mfma")
ISAS = (
    Isa("avx512-amx", _HERE / "q8_gemm_amx.cpp", _AVX512 + ("amx_tile", "amx_int8"),
        _AVX512_CFLAGS + ("-mamx-tile", "-mamx-int8")),
    Isa("avx512-vnni", _HERE / "q8_gemm.cpp", _AVX512, _AVX512_CFLAGS),
    Isa("avx2", _HERE / "q8_gemm_avx2.cpp", ("avx2", "f16c", "fma"), ("-O3", "-fopenmp", "-mavx2", "-mf16c", "-mfma")),
)
"""Best first: the first whose flags the CPU has is built. ``-fopenmp``: ATen's ``parallel_for`` is
a header whose ``#pragma omp parallel`` a build without it drops, running every product on one
thread (as these kernels did until it was added); the link names PyTorch's own OpenMP runtime
(torch/lib/libgomp.so.1, the one ATen's pool runs on), so no second pool of threads starts."""
LDFLAGS = ("-l:libgomp.so.1",)
ISA_ENV = "INFERENCE_WORKBENCH_KERNELS_ISA"
"""Set to an :class:`Isa` name: build that one (where the CPU has its flags) instead of the best
(to measure or test the AVX2 kernels on an AVX-512 machine)."""
DIR_ENV = "INFERENCE_WORKBENCH_KERNELS"
"""The folder of builds, set once they are loaded, for child processes."""
DISABLE_ENV = "INFERENCE_WORKBENCH_NO_INT8_KERNELS"
"""Set (to anything): don't use them (the weight-only kernels run; for comparisons)."""

_lock = threading.Lock()
_ready: bool | None = None
_why_not: str | None = None
_loaded: Isa | None = None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags as /proc/cpuinfo names them (empty where it can't be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa() -> Isa | None:
    """The build this CPU takes: the first of :data:`ISAS` whose flags it has, or the one
    ``INFERENCE_WORKBENCH_KERNELS_ISA`` names where it has that one's; ``None`` where none fits."""
    import os

    have = cpu_flags()
    fits = [choice for choice in ISAS if all(flag in have for flag in choice.flags)]
    wanted = os.environ.get(ISA_ENV)
    if wanted:
        fits = [choice for choice in fits if choice.name == wanted]
    return fits[0] if fits else None


def _why_no_isa() -> str:
    import os

    have = cpu_flags()
    wanted = os.environ.get(ISA_ENV)
    named = [choice for choice in ISAS if choice.name == wanted] if wanted else list(ISAS)
    if not named:
        return f"{ISA_ENV}={wanted} names no build (there are {', '.join(c.name for c in ISAS)})"
    return "; ".join(f"this CPU lacks {', '.join(f for f in c.flags if f not in have)} for {c.name}" for c in named)


def expected() -> bool:
    """Whether a quantized fast precision will use them here (the CPU has what one build needs
    and they aren't turned off), without compiling anything: what the memory estimate counts."""
    import os

    if _ready is not None:
        return _ready
    return not os.environ.get(DISABLE_ENV) and isa() is not None


def build_dir(choice: Isa | None = None) -> Path:
    """Where the build for ``choice`` (this CPU's, by default) lives: the user cache's ``kernels``
    folder, or the one a parent process built in (``INFERENCE_WORKBENCH_KERNELS``: the compiled
    step's child loads the parent's build instead of compiling its own)."""
    import os

    import torch

    choice = choice or isa() or ISAS[0]
    text = b"".join(path.read_bytes() for path in (choice.source, *HEADERS))
    flags = " ".join(choice.cflags + LDFLAGS).encode()
    key = hashlib.sha256(text + torch.__version__.encode() + flags).hexdigest()
    root = os.environ.get(DIR_ENV)
    return (Path(root) if root else cache_dir() / "kernels") / f"{choice.name}-{key[:16]}"


def is_built() -> bool:
    """Compiled on this machine already (loading them takes a moment, not a minute)."""
    return any(build_dir().glob("*.so"))


def _build(choice: Isa) -> None:
    import os

    from torch.utils import cpp_extension

    try:  # the ninja package's binary, where the venv's bin folder isn't on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    folder = build_dir(choice)
    folder.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=f"workbench_q8_{folder.name.replace('-', '_')}", sources=[str(choice.source)],
                       extra_cflags=list(choice.cflags), extra_ldflags=list(LDFLAGS), extra_include_paths=[str(_HERE)],
                       build_directory=str(folder), is_python_module=False, verbose=False)


def kernels() -> bool:
    """Whether ``torch.ops.workbench.q8_linear``/``q4_linear`` are there to use: compiled (once)
    and loaded on the first call; ``False`` where they can't be (:func:`unavailable` says why)."""
    global _ready, _why_not, _loaded
    if _ready is not None:
        return _ready
    with _lock:
        if _ready is not None:
            return _ready
        import os

        choice = isa()
        if os.environ.get(DISABLE_ENV):
            _why_not = f"turned off ({DISABLE_ENV} is set)"
        elif choice is None:
            _why_not = _why_no_isa()
        else:
            try:
                _build(choice)
                _loaded = choice
            except Exception as exc:  # a compiler missing or failing: the weight-only kernels stay
                _why_not = f"compiling {choice.source.name} failed: {type(exc).__name__}: {str(exc).strip()[:300]}"
                log.warning("int8 kernels unavailable: %s", _why_not)
        _ready = _why_not is None
        if _ready:
            _register_fakes()
            os.environ[DIR_ENV] = str(build_dir(choice).parent)
        return _ready


def load_if_built() -> Isa | None:
    """The loaded build, loading it first where it was built on this machine already (a moment,
    not the minute a build takes: nothing is compiled here); ``None`` where none is loaded."""
    if _loaded is None and _why_not is None and expected() and is_built():
        kernels()
    return _loaded


def loaded() -> Isa | None:
    """The build :func:`kernels` loaded (``None`` before, or where it couldn't)."""
    return _loaded


def unavailable() -> str | None:
    """Why :func:`kernels` is ``False`` (``None`` while untried or when they work)."""
    return _why_not


def _register_fakes() -> None:
    """Shapes for tracing (torch.export of the compiled decode step)."""
    import torch

    @torch.library.register_fake("workbench::q8_linear")
    def _(x, w, scales):
        return x.new_empty((x.shape[0], w.shape[0] * 16))

    @torch.library.register_fake("workbench::q4_linear")
    def _(x, w, d, mins):
        return x.new_empty((x.shape[0], w.shape[0] * 16))

    @torch.library.register_fake("workbench::dense_linear")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("workbench::attend_rows")
    def _(q, keys, values, positions, scale):
        return q.new_empty(q.shape)

    @torch.library.register_fake("workbench::attend_paged")
    def _(q, keys, values, table, positions, scale, window=0, softcap=0.0):
        return q.new_empty(q.shape)

    @torch.library.register_fake("workbench::write_q8")
    def _(pool, blocks, slots, x):
        return None

    @torch.library.register_fake("workbench::attend_chunk")
    def _(q, keys, values, table, start, scale, window=0, softcap=0.0):
        return q.new_empty(q.shape)
