"""The fast path's compiled decode steps, built ahead of time in a child process and kept on disk.

The step (:func:`engine.models.fast._decode_step`) is exported once (``torch.export``, the
cache's capacity a dynamic dimension, so one build serves every cache size) and compiled by
AOTInductor with the fast path's CPU options (frozen weights, C++ GEMM micro-kernels picked by
timing on this machine) into a package in the user cache. Loading the package takes about a
second; the step then runs in C++ from its first kernel to its last, with no Python wrapper and
no guards between them.

A second package holds the batched step (:func:`engine.models.fast._decode_rows`: two sequences
or more, the batch a dynamic dimension too), built by the same child after the first. It calls
the int8 kernels' attention, so it is built where they are (every precision: the child compiles
them if the load didn't). The eager step's ~20 small operations a layer (norms, rotary, silu·up,
the activations' quantization) are fused. The one-sequence step attends with the kernels too
wherever they load (the child loads them before exporting it, the parent before loading it),
with two matmuls and a softmax elsewhere.

The one-sequence step's fp32 and bf16 products are Inductor's, on weights it packs for them; the
batched step's are the kernels' ``dense_linear`` (engine/models/kernels/dense.h), which read the
weights once for a tile of rows where Inductor's dynamic-batch products did not keep up. Each
choice was measured alternating in one process: docs/benchmarks.md, "The dense products".

Why not ``torch.compile`` in a thread of the app, as before: while inductor traces, torch.fx patches
``nn.Module.__call__`` for the whole process, and a generation running meanwhile failed with
"NameError: module is not installed as a submodule"; inductor's Python held the GIL so long that
such a generation crawled for the whole compile; and inductor's own disk cache refuses graphs
holding prepacked (mkldnn) weights, so every load compiled again, for every cache size. A child
process at the lowest priority avoids all three, and what it leaves on disk is loaded by every later
load of the same weights.

The package holds the model's weights and the GEMM kernels' packed copies; on loading, the
model's own tensors take the weights' place (``user_managed``: no second copy), so memory grows
by the packed copies only. A package is named by what its code depends on: a fingerprint of the
weights, the thread count, PyTorch's version, the CPU's vector ISA, whether the int8 kernels
are expected here and the fast path's source (fast.py, quantize.py, this module).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from engine.models import fast, huge_pages, quantize
from engine.storage.paths import cache_dir
from engine.models.fast import (MAX_COMPILED_CAPACITY, MIN_CAPACITY, _rotary_tables, CPU_COMPILE_OPTIONS, _decode_rows,
                                _decode_step)
from engine.generation.kv_manager import BLOCK_TOKENS
from engine.models.loading import load_model

PACKAGES_KEPT = 4
"""Packages of each kind kept in the user cache (the least recently used go first): about twice
the weights' bytes each."""
STEP, ROWS = "step", "rows"
"""The two packages a decoder gets: the one-sequence step (:func:`engine.models.fast._decode_step`)
and the batched step (:func:`engine.models.fast._decode_rows`, two sequences or more), which
needs the kernels' attention; each named by its kind."""
MAX_POOL_BLOCKS = 1 << 24
"""The most blocks a pool the compiled steps read may have (the pool's size is a dynamic dimension)."""
MAX_ROWS = 4096
"""The most sequences the compiled batched step is built for (the batch is a dynamic dimension)."""
EXAMPLE_ROWS = 16
"""The batch the batched step is exported (and its GEMM kernels tuned) at."""
WAIT_POLL_S = 0.2
"""How often the wait for the child looks at the cancel flag."""


@dataclass(frozen=True)
class CompileReport:
    """The compiled step is ready (or could not be made: ``error``; the eager step runs)."""

    seconds: float
    threads: int
    """PyTorch threads the step was built for (and runs at)."""
    package: str
    """The package's path (in the user cache)."""
    built: bool = False
    """Built now by a child process (else loaded from an earlier build)."""
    package_bytes: int = 0
    error: str | None = None
    rows_error: str | None = None
    """Why there is no compiled batched step (``None``: there is one, beside the one-sequence step)."""
    rows_bytes: int = 0
    """The batched step's package size."""
    rows_built: bool = False
    """The batched step built now (else loaded from an earlier build, or none: ``rows_error``)."""

    def describe(self) -> str:
        """One line: how the steps were made ready, or why they weren't."""
        if self.error:
            return f"no compiled step, the eager step is in use: {self.error}"
        how = "built" if self.built else "loaded from the cache"
        if self.rows_error:
            return (f"compiled step {how} in {self.seconds:.1f} s ({self.threads} threads, "
                    f"{self.package_bytes / 2**20:.0f} MiB in {self.package}); batches run the eager step: "
                    f"{self.rows_error}")
        rows_how = "built" if self.rows_built else "loaded from the cache"
        return (f"compiled steps ready in {self.seconds:.1f} s ({self.threads} threads): the one-sequence step "
                f"{how} ({self.package_bytes / 2**20:.0f} MiB in {self.package}), the batched step {rows_how} "
                f"({self.rows_bytes / 2**20:.0f} MiB)")


class StepModule(torch.nn.Module):
    """The decode step as a module for ``torch.export``: the model and the fused q/k/v and
    gate/up projections registered, so every weight has a name the loader can hand back."""

    def __init__(self, d) -> None:
        super().__init__()
        self.model = d.model
        self.fused = torch.nn.ModuleList([m for layer in d.layers for m in layer.fused])
        object.__setattr__(self, "decoder", d)  # not a submodule: its modules are registered above

    def forward(self, keys, values, cos, sin, ids, position, table):
        return _decode_step(self.decoder, keys, values, cos, sin, ids, position, table)


class RowsModule(StepModule):
    """The batched decode step as a module for ``torch.export`` (the same weights' names)."""

    def forward(self, keys, values, cos, sin, ids, positions, table):
        return _decode_rows(self.decoder, keys, values, cos, sin, ids, positions, table)


def _named_tensors(d) -> dict[str, torch.Tensor]:
    module = StepModule(d)
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def fingerprint(d) -> str:
    """A digest of the decoder's weights: names, shapes, dtypes and ~4,000 values of each (so a
    package is never loaded beside other weights than those it was built from)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(_named_tensors(d).items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].contiguous()
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return digest.hexdigest()[:24]


def _source_digest() -> str:
    digest = hashlib.sha256()
    for module in (fast, quantize):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:12]


def package_path(d, threads: int, weights: str | None = None, kind: str = STEP) -> Path:
    """Where the package of ``kind`` (:data:`STEP` or :data:`ROWS`) for this decoder's weights
    at ``threads`` threads lives."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa


    from engine.models import kernels  # lazy: whether the step is built with the kernels' attention

    key = json.dumps([weights or fingerprint(d), threads, torch.__version__, str(pick_vec_isa()), _source_digest(),
                      kernels.expected(), bool(os.environ.get(fast.NO_DENSE_ENV)), str(d.kv_dtype), d.exit_layers])
    return cache_dir() / "compiled" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt2"


def _failed(path: Path) -> Path:
    """Where a batched step's failed build leaves its reason (so later loads don't try again)."""
    return path.with_suffix(".failed")


def _example_pool(d, blocks: int = 64, block_tokens: int = BLOCK_TOKENS) -> tuple[list, list]:
    """Example pools: ``blocks`` blocks for the full layers, fewer for the sliding-window layers'
    own pool (so the export sees two sizes)."""
    def pool(layer):
        shape = (blocks // 2 if layer.window else blocks, d.kv_heads, block_tokens, d.kv_row)
        return torch.zeros(shape, dtype=d.kv_dtype, device=d.device)

    return [pool(layer) for layer in d.layers], [pool(layer) for layer in d.layers]


def _example_table(d, rows: int, width: int) -> torch.Tensor:
    """An example block table of ``width`` blocks a row (twice that where some layers slide a window:
    the full layers' blocks, then theirs)."""
    halves = 2 if d.windowed else 1
    return torch.arange(rows * width * halves, dtype=torch.long, device=d.device).view(rows, width * halves) % 32


def _pool_dims(d, rows=None) -> tuple:
    """The dynamic dimensions of a step's inputs: the pools' blocks (the full layers' and the
    window layers'), the rotary tables' length, the block table's width (and the batch's rows)."""
    blocks = torch.export.Dim("blocks", min=2, max=MAX_POOL_BLOCKS)
    window_blocks = torch.export.Dim("window_blocks", min=2, max=MAX_POOL_BLOCKS)
    rotary = torch.export.Dim("rotary", min=MIN_CAPACITY, max=MAX_COMPILED_CAPACITY)
    width = torch.export.Dim("width", min=1, max=MAX_COMPILED_CAPACITY)
    pools = [{0: window_blocks if layer.window else blocks} for layer in d.layers]
    table_width = 2 * width if d.windowed else width
    if rows is None:
        return (pools, pools, {2: rotary}, {2: rotary}, None, None, {1: table_width})
    return (pools, pools, {2: rotary}, {2: rotary}, {0: rows}, {0: rows}, {0: rows, 1: table_width})


def export_step(d):
    """``torch.export`` of the one-sequence step over a 64-block pool, a 512-position rotary table
    and an 8-block table, those sizes left dynamic."""

    keys, values = _example_pool(d)
    cos, sin = _rotary_tables(d, 512)
    ids = torch.zeros((1, 1), dtype=torch.long, device=d.device)
    position = torch.zeros(1, dtype=torch.long, device=d.device)
    table = _example_table(d, 1, 8)
    with torch.no_grad():
        return torch.export.export(StepModule(d), (keys, values, cos.clone(), sin.clone(), ids, position, table),
                                   dynamic_shapes=_pool_dims(d), strict=False)


def export_rows(d):
    """``torch.export`` of the batched step at :data:`EXAMPLE_ROWS` sequences, each with a 4-block
    table over a 64-block pool, the batch, the pool, the tables' width and the rotary tables' length
    left dynamic."""

    keys, values = _example_pool(d)
    batch = EXAMPLE_ROWS
    cos, sin = _rotary_tables(d, 512)
    ids = torch.zeros((batch, 1), dtype=torch.long, device=d.device)
    positions = torch.arange(batch, dtype=torch.long, device=d.device)
    table = _example_table(d, batch, 4)
    rows = torch.export.Dim("rows", min=2, max=MAX_ROWS)
    with torch.no_grad():
        return torch.export.export(RowsModule(d), (keys, values, cos.clone(), sin.clone(), ids, positions, table),
                                   dynamic_shapes=_pool_dims(d, rows), strict=False)


def _partial(path: Path, pid: int) -> Path:
    """Where the process ``pid`` writes ``path`` before renaming it into place."""
    return path.with_name(f"{path.stem}.{pid}.partial.pt2")


def build_package(d, path: Path, threads: int, weights: str, kind: str = STEP) -> None:
    """Export and compile the step of ``kind`` into ``path`` (written whole, then renamed into place)."""

    torch.set_num_threads(threads)
    program = export_step(d) if kind == STEP else export_rows(d)
    options = dict(CPU_COMPILE_OPTIONS) if d.device.type == "cpu" else {}
    options.update({"aot_inductor.package_constants_in_so": False,
                    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
                    "aot_inductor.metadata": {"weights": weights, "threads": str(threads)}})
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(path, os.getpid())
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def load_package(d, path: Path, weights: str):
    """The compiled step from ``path``, its weights the decoder's own tensors and its packed
    copies read from the package. Refuses a package built from other weights."""
    import io

    from torch.export.pt2_archive._package import PT2ArchiveReader
    from torch.export.pt2_archive.constants import AOTINDUCTOR_DIR, WEIGHTS_DIR

    runner = _load_runner(path)
    built_from = runner.get_metadata().get("weights")
    if built_from != weights:
        raise ValueError(f"the package was built from other weights ({built_from}, these are {weights})")
    ours = _named_tensors(d)
    constants: dict[str, torch.Tensor] = {}
    files: dict[str, torch.Tensor] = {}
    with PT2ArchiveReader(str(path)) as reader:
        config = json.loads(reader.read_string(f"{AOTINDUCTOR_DIR}model/weights_config.json"))
        for name, (file, shape, stride, offset) in config.items():
            mine = ours.get(name)
            if mine is not None and tuple(mine.shape) == tuple(shape) and tuple(mine.stride()) == tuple(stride):
                constants[name] = mine
                continue
            if file not in files:  # a packed copy: on huge pages where the weights are (as they are read alike)
                files[file] = huge_pages.copied(
                    torch.load(io.BytesIO(reader.read_bytes(WEIGHTS_DIR + file)), weights_only=True))
            constants[name] = files[file].as_strided(shape, stride, offset)
    # the runner keeps pointers: the tensors stay alive with the step. It is handed aliases that
    # own nothing (see _borrowed), so that what it keeps of them once it is gone pins no memory
    runner.load_constants({name: _borrowed(t) for name, t in constants.items()}, check_full_update=True,
                          user_managed=True)
    os.utime(path)  # recently used: kept when old packages are pruned
    return _LoadedStep(runner, constants)


def _borrowed(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory under a tensor that doesn't own it (same dtype, shape, strides and
    address; its storage is a ctypes array over that memory).

    PyTorch's AOTI runner keeps a reference to every tensor handed to ``load_constants(…,
    user_managed=True)`` that it never lets go, even after the runner is destroyed (PyTorch
    2.13): every load of a compiled fast precision pinned the model's weights for the rest of
    the process, so unloading a model (a Compare lane, a precision switch) gave none of its
    weights back (measured: +195 MiB a load and unload of int8-fast, after ``malloc_trim``). Handed
    borrowed aliases, the runner pins only those; the step keeps the real tensors alive as
    long as the runner may read them."""
    import ctypes

    storage = tensor.untyped_storage()
    if not storage.nbytes():
        return tensor
    memory = (ctypes.c_byte * storage.nbytes()).from_address(storage.data_ptr())
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # holds the ctypes array, which owns nothing
    return raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


_loading = threading.Lock()
"""One package loads at a time in this process: :func:`_load_runner` tells its own extraction
folders from others' by what appeared while it loaded."""
_EXTRACTED = re.compile(r"aotinductor_\w{6}")


def _load_runner(path: Path):
    """``torch._inductor.aoti_load_package(path)``, without the folder it leaves behind.

    PyTorch's loader extracts the package into a fresh ``aotinductor_XXXXXX`` folder of the
    temporary directory (~4 MB for the default model) and removes it only in its destructor, so
    a process that is killed or crashes, or a load that fails, leaves it there for good: this
    machine's /tmp held 224 of them (822 MB) after a few days of test runs, and a user's /tmp is
    often memory. Once loaded, the runner reads nothing more from it (its library is mapped, the
    weights are the model's own tensors), so the folders it maps are removed now; a load that
    fails takes the folders holding this package that appeared while it ran. Linux names a
    process's mapped files in /proc/self/maps; elsewhere the destructor alone cleans up."""
    import tempfile

    temp = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())  # where the loader extracts
    with _loading:
        before = set(temp.glob("aotinductor_*"))
        try:
            runner = torch._inductor.aoti_load_package(str(path))
        except BaseException:
            import zipfile

            try:
                with zipfile.ZipFile(path) as archive:
                    root = archive.namelist()[0].split("/", 1)[0]
            except (OSError, zipfile.BadZipFile, IndexError):
                root = None
            for folder in set(temp.glob("aotinductor_*")) - before:
                if root and (folder / root).exists():
                    shutil.rmtree(folder, ignore_errors=True)
            raise
        for folder in _mapped_extractions():
            shutil.rmtree(folder, ignore_errors=True)
    return runner


def _mapped_extractions() -> set[Path]:
    """The loader's extraction folders that hold a file this process has mapped (and that still
    exist): the folders of the packages it loaded."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    folders = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5].endswith(" (deleted)"):
            continue
        parts = Path(fields[5]).parts
        for i, part in enumerate(parts):
            if _EXTRACTED.fullmatch(part):
                folders.add(Path(*parts[:i + 1]))
                break
    return {folder for folder in folders if folder.is_dir()}


class _LoadedStep:
    """A loaded package, called as the step is (the decoder argument is its own, already inside).

    It hands the runner its inputs as the flat list they export to (keys, values, cos, sin, ids,
    position): the package's own ``__call__`` parsed its call spec and flattened the 60-odd
    tensors again at every token, a visible share of a quantized step (benchmarks/batch_step.py)."""

    def __init__(self, runner, constants: dict[str, torch.Tensor]) -> None:
        self.runner, self.constants = runner, constants
        self._run = runner.loader.boxed_run

    def __call__(self, d, keys, values, cos, sin, ids, position, table) -> torch.Tensor:
        return self._run([*keys, *values, cos, sin, ids, position, table])[0]


def _prune(folder: Path, keep: Path) -> None:
    """Keep the :data:`PACKAGES_KEPT` most recently used packages of each kind; drop partial
    files a build process left when it was killed with its parent (older than an hour)."""
    for kind in (STEP, ROWS):
        mine = keep.with_name(kind + keep.name.removeprefix(STEP).removeprefix(ROWS))
        packages = sorted(folder.glob(f"{kind}-*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
        partial = [p for p in packages if ".partial" in p.name]
        for old in [p for p in packages if p != mine and p not in partial][PACKAGES_KEPT - 1:]:
            old.unlink(missing_ok=True)
            old.with_suffix(".log").unlink(missing_ok=True)
            _failed(old).unlink(missing_ok=True)
        for old in partial:
            if time.time() - old.stat().st_mtime > 3600:
                old.unlink(missing_ok=True)


def _memory_shortfall(d) -> str | None:
    """Why a child can't build the package beside the loaded model now, or ``None``."""
    import psutil

    weights = sum(t.numel() * t.element_size() for t in set(_named_tensors(d).values()))
    needed = 3 * weights + (1 << 30)  # its own copy of the model, the packed copies, inductor itself
    free = psutil.virtual_memory().available
    if free < needed:
        return (f"not enough free memory to build it beside the loaded model (about {needed / 2**30:.1f} GiB "
                f"needed, {free / 2**30:.1f} GiB free); the eager step is in use")
    return None


def _compile_each_kernel_template_once() -> None:
    """In the build process only: inductor compiles a jinja template from its source for every
    C++ GEMM kernel it renders (~4,700 compilations of 36 distinct sources for the default model);
    each source is compiled once here, which takes a good share off every build."""
    try:
        from torch._inductor.codegen.common import KernelTemplate
    except ImportError:  # another PyTorch: its own behaviour
        return
    original = KernelTemplate.__dict__.get("_template_from_string")
    if not isinstance(original, staticmethod):
        return
    compiled: dict[str, object] = {}

    def once(source: str):
        if source not in compiled:
            compiled[source] = original.__func__(source)
        return compiled[source]

    KernelTemplate._template_from_string = staticmethod(once)


def _message(exc: BaseException) -> str:
    message = f"{type(exc).__name__}: {exc}"
    return message if len(message) <= 600 else message[:600] + " …"


def _child(request, threads: int, paths: dict[str, str], weights: str, conn, exit_layers: int | None = None) -> None:
    """In the child process: load the model as the parent did (``exit_layers``: and take the
    early-exit view of its first layers a speculative draft runs), check it is the same, build the
    packages of ``paths`` (kind → path), the one-sequence step first. Sends the one-sequence
    step's error, ``None`` once the builds are done; a batched step that fails leaves its reason
    in its ``.failed`` file, which the parent reads."""
    step_error = None
    try:
        import psutil

        psutil.Process().nice(19 if os.name == "posix" else psutil.IDLE_PRIORITY_CLASS)
        # the weights exported as the tensors they were loaded as: views of one huge-page
        # mapping (engine/models/huge_pages.py) export as offsets into a storage the package
        # can't hold (its load asked for 45 TB); the parent's views take their place on loading
        os.environ[huge_pages.DISABLE_ENV] = "1"
        first = Path(next(iter(paths.values())))
        first.parent.mkdir(parents=True, exist_ok=True)
        log = open(first.with_suffix(".log"), "w")  # inductor's autotuning tables, not the app's terminal
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)

        loaded = load_model(request)
        if exit_layers:
            loaded.fast = fast.early_exit_decoder(loaded.fast, exit_layers)
        mine = fingerprint(loaded.fast)
        if mine != weights:
            raise ValueError("the model on disk changed since it was loaded; load it again")
        _compile_each_kernel_template_once()
        from engine.models import kernels  # lazy: loaded (built the first time) only where they are expected

        # the one-sequence step attends with the kernels wherever they load (the parent loads
        # them before the package, package_path's key says whether they were expected)
        loaded.fast.step_attention = kernels.expected() and kernels.kernels()
        # one row's products are Inductor's, on weights it packs (they read faster than the
        # kernels' dense_linear there); a batch's are dense_linear's (faster from 2 rows to 64)
        loaded.fast.dense = False
        if STEP in paths:
            build_package(loaded.fast, Path(paths[STEP]), threads, weights)
        if ROWS in paths:
            try:
                if not kernels.kernels():
                    raise RuntimeError(f"it needs the int8 kernels' attention: {kernels.unavailable()}")
                loaded.fast.dense = fast.dense_op()
                build_package(loaded.fast, Path(paths[ROWS]), threads, weights, ROWS)
            except Exception as exc:  # the one-sequence step stands; batches run the eager step
                _failed(Path(paths[ROWS])).write_text(_message(exc), encoding="utf-8")
    except BaseException as exc:  # the parent reports it; the eager step keeps running
        step_error = _message(exc)
    conn.send(step_error)


def child_context():
    import multiprocessing

    return multiprocessing.get_context("spawn")  # a fresh interpreter: no state (or threads) forked from the app


def compile_step(d, threads: int, cancelled: Callable[[], bool] = lambda: False,
                 rows: bool = True) -> tuple[object, object, CompileReport]:
    """The compiled steps for decoder ``d`` (loaded with ``d.request``): loaded from the user
    cache, or built there first by a child process at the lowest priority (the caller waits with
    the GIL released; ``cancelled`` ends the child). Returns (one-sequence step or ``None``,
    batched step or ``None``, report). A batched step that can't be built (no kernels) leaves
    its reason beside its package's name, and the one-sequence step stands alone. ``rows``
    ``False``: the one-sequence step only (a benchmark of one sequence, tests of other things)."""
    start = time.perf_counter()
    weights = fingerprint(d)
    path = package_path(d, threads, weights)
    rows_path = package_path(d, threads, weights, ROWS)

    def report(**fields) -> CompileReport:
        size = path.stat().st_size if path.exists() else 0
        rows_size = rows_path.stat().st_size if rows_path.exists() else 0
        return CompileReport(time.perf_counter() - start, threads, str(path), package_bytes=size,
                             rows_bytes=rows_size, **fields)

    if cancelled():
        return None, None, report(error="cancelled")
    built = False
    kinds = ((STEP, path), (ROWS, rows_path)) if rows else ((STEP, path),)
    wanted = {kind: str(where) for kind, where in kinds if not where.exists() and not _failed(where).exists()}
    if wanted:
        if d.request is None:
            return None, None, report(error="the model was not loaded from a source a child process can load again")
        shortfall = _memory_shortfall(d)
        if shortfall:
            return None, None, report(error=shortfall)
        context = child_context()
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_child, args=(d.request, threads, wanted, weights, send, d.exit_layers),
                                name="fast-path-build", daemon=True)
        child.start()
        send.close()
        try:
            while child.is_alive() and not cancelled():
                child.join(WAIT_POLL_S)
            if child.is_alive():
                child.kill()
                child.join()
                for where in (path, rows_path):
                    _partial(where, child.pid).unlink(missing_ok=True)
                return None, None, report(error="cancelled")
            try:
                error = receive.recv()
            except EOFError:  # it ended without a word: killed, out of memory, exited on import
                error = f"the build process ended with code {child.exitcode} before it finished"
        finally:
            receive.close()
        if error:
            return None, None, report(error=error)
        built = STEP in wanted
        _prune(path.parent, path)
    try:
        from engine.models import kernels  # lazy: as in the build

        if kernels.expected():  # the step may call their attention: it loads them (built by the child)
            kernels.kernels()
            d.dense = fast.dense_op()  # the eager steps' products too
        step = load_package(d, path, weights)
    except Exception as exc:  # a damaged or foreign package: removed, so the next load builds afresh
        path.unlink(missing_ok=True)
        return None, None, report(error=f"{type(exc).__name__}: {exc}")
    batched, rows_error = None, None
    if not rows:
        rows_error = "not asked for"
    elif _failed(rows_path).exists():
        rows_error = _failed(rows_path).read_text(encoding="utf-8")
    else:
        try:
            from engine.models import kernels  # lazy: the batched step calls their attention

            if not kernels.kernels():  # built by the child already: this loads them
                raise RuntimeError(f"the int8 kernels can't load: {kernels.unavailable()}")
            batched = load_package(d, rows_path, weights)
        except Exception as exc:  # as above: the next load builds it afresh
            rows_path.unlink(missing_ok=True)
            rows_error = f"{type(exc).__name__}: {exc}"
    return step, batched, report(built=built, rows_error=rows_error,
                                 rows_built=batched is not None and ROWS in wanted)


def compile_decoder(d, threads: int | None = None, cancelled: Callable[[], bool] | None = None,
                    rows: bool = True) -> CompileReport:
    """Make decoder ``d``'s compiled steps usable (``d.compiled``, ``d.compiled_rows`` for
    batches): loaded from the user cache (about a second), or first built there by a child
    process (a few minutes on two cores; generations meanwhile run the eager steps, the child
    at the lowest priority)."""
    threads = threads or torch.get_num_threads()
    step, batched, report = compile_step(d, threads, cancelled or d._stop_compile.is_set, rows)
    if step is not None:
        d.compiled, d.compiled_rows, d.compiled_threads = step, batched, threads
        d.rows_attention = d.rows_attention or batched is not None  # the kernels are loaded now
    return report


def compile_in_background(d, on_done: Callable[[CompileReport], None] | None = None,
                          rows: bool = True) -> threading.Thread:
    """:func:`compile_decoder` on a daemon thread; generations use the eager step until it is ready."""
    d._stop_compile.clear()
    threads = torch.get_num_threads()  # the generating thread's (OpenMP keeps a count per thread)

    def run() -> None:
        report = compile_decoder(d, threads, rows=rows)
        if on_done is not None:
            on_done(report)

    d._compile_thread = threading.Thread(target=run, name="fast-path-compile", daemon=True)
    d._compile_thread.start()
    return d._compile_thread


def stop_compiling(d, timeout: float | None = None) -> None:
    """End ``d``'s build in progress (its child process is killed within a fraction of a second)."""
    d._stop_compile.set()
    if d._compile_thread is not None:
        d._compile_thread.join(timeout)
