"""The fast path's own CPU kernels: int8 × int8 matrix products in blocks of 32 (q8_gemm.cpp,
``torch.ops.workbench.q8_linear`` and ``q4_linear``), compiled once per machine, PyTorch version
and source into the user cache, the first time a quantized fast precision loads (about a minute
on two cores; the load says so).

They need AVX-512 (F, BW, VL, DQ) with VNNI and F16C; elsewhere, or where the compiler fails,
:func:`kernels` is ``False``, :func:`unavailable` says why, and the quantized layers keep using
PyTorch's weight-only kernels (engine/models/quantize.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

from engine.storage.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q8_gemm.cpp")
NEEDED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
"""/proc/cpuinfo's names for what q8_gemm.cpp is compiled for."""
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma"]
DIR_ENV = "INFERENCE_WORKBENCH_KERNELS"
"""The folder of builds, set once they are loaded, for child processes."""
DISABLE_ENV = "INFERENCE_WORKBENCH_NO_INT8_KERNELS"
"""Set (to anything): don't use them (the weight-only kernels run; for comparisons)."""

_lock = threading.Lock()
_ready: bool | None = None
_why_not: str | None = None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def expected() -> bool:
    """Whether a quantized fast precision will use them here (the CPU has what they need and they
    aren't turned off), without compiling anything: what the memory estimate counts."""
    import os

    if _ready is not None:
        return _ready
    return not os.environ.get(DISABLE_ENV) and all(flag in cpu_flags() for flag in NEEDED_FLAGS)


def build_dir() -> Path:
    """Where this source's build lives: the user cache's ``kernels`` folder, or the one a parent
    process built in (``INFERENCE_WORKBENCH_KERNELS``: the compiled step's child loads the
    parent's build instead of compiling its own)."""
    import os

    import torch

    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(CFLAGS).encode()).hexdigest()
    root = os.environ.get(DIR_ENV)
    return (Path(root) if root else cache_dir() / "kernels") / key[:20]


def is_built() -> bool:
    """Compiled on this machine already (loading them takes a moment, not a minute)."""
    return any(build_dir().glob("*.so"))


def _build() -> None:
    import os

    from torch.utils import cpp_extension

    try:  # the ninja package's binary, where the venv's bin folder isn't on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=f"workbench_q8_{folder.name}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                       build_directory=str(folder), is_python_module=False, verbose=False)


def kernels() -> bool:
    """Whether ``torch.ops.workbench.q8_linear``/``q4_linear`` are there to use: compiled (once)
    and loaded on the first call; ``False`` where they can't be (:func:`unavailable` says why)."""
    global _ready, _why_not
    if _ready is not None:
        return _ready
    with _lock:
        if _ready is not None:
            return _ready
        import os

        missing = [flag for flag in NEEDED_FLAGS if flag not in cpu_flags()]
        if os.environ.get(DISABLE_ENV):
            _why_not = f"turned off ({DISABLE_ENV} is set)"
        elif missing:
            _why_not = f"this CPU lacks {', '.join(missing)}"
        else:
            try:
                _build()
            except Exception as exc:  # a compiler missing or failing: the weight-only kernels stay
                _why_not = f"compiling {SOURCE.name} failed: {type(exc).__name__}: {str(exc).strip()[:300]}"
                log.warning("int8 kernels unavailable: %s", _why_not)
        _ready = _why_not is None
        if _ready:
            _register_fakes()
            os.environ[DIR_ENV] = str(build_dir().parent)
        return _ready


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
