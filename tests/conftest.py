from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _test_downloads() -> Path:
    """Where the tests keep the default model they fetch (a folder of their own, kept between
    runs so each run doesn't download it again, never the app's cache)."""
    override = os.environ.get("INFERENCE_WORKBENCH_TEST_DOWNLOADS")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("inference-workbench-tests", appauthor=False))


# A private cache for the whole session, set before anything imports the engine (which points
# torch's compiled-code cache into it at import): compiled decode steps, inductor's code, kept
# quality references and conversions all land in a temporary folder. Only the default model is
# shared between runs, from the tests' own download folder.
_USERS_CACHE_OVERRIDE = os.environ.get("INFERENCE_WORKBENCH_CACHE")
_SESSION_CACHE = Path(tempfile.mkdtemp(prefix="workbench-test-cache-"))
(_test_downloads() / "default").mkdir(parents=True, exist_ok=True)
(_SESSION_CACHE / "default").symlink_to(_test_downloads() / "default", target_is_directory=True)
os.environ["INFERENCE_WORKBENCH_CACHE"] = str(_SESSION_CACHE)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_SESSION_CACHE / "inductor")
# huggingface_hub's home too (its hub cache, its "checked for an update" marker…), before anything
# imports it: a run wrote ~/.cache/huggingface/.check_for_update_done.
_USERS_HF_HOME = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
for _variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ASSETS_CACHE", "HF_XET_CACHE"):
    os.environ.pop(_variable, None)
os.environ["HF_HOME"] = str(_SESSION_CACHE / "huggingface")

ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "gpt2", "mistral", "gemma2", "gemma3")


def _users(variable: str, where):
    """``where()`` as the app finds it without the test override ``variable``."""
    saved = os.environ.pop(variable, None)
    try:
        return where()
    finally:
        if saved is not None:
            os.environ[variable] = saved


def _users_history() -> tuple[Path, frozenset[str]]:
    """The user's own history folder (what the app uses without an override) and its files now."""
    from engine.storage import history

    folder = _users("INFERENCE_WORKBENCH_DATA", history.history_dir)
    return folder, frozenset(p.name for p in folder.glob("*")) if folder.is_dir() else frozenset()


# A private data folder for the whole session, set before any fixture or thread runs: a module's
# server or a window's history writer that outlives its test (threads finishing after the
# per-test override was undone) wrote the test's runs into the user's History.
_USERS_HISTORY = _users_history()
_SESSION_DATA = os.environ["INFERENCE_WORKBENCH_DATA"] = tempfile.mkdtemp(prefix="workbench-test-data-")


def _users_cache() -> tuple[Path, frozenset[str]]:
    """The user's own cache folder and what it holds now (two levels deep)."""
    from engine.storage.paths import cache_dir

    saved = os.environ.pop("INFERENCE_WORKBENCH_CACHE")
    if _USERS_CACHE_OVERRIDE is not None:
        os.environ["INFERENCE_WORKBENCH_CACHE"] = _USERS_CACHE_OVERRIDE
    try:
        folder = cache_dir()
    finally:
        os.environ["INFERENCE_WORKBENCH_CACHE"] = saved
    return folder, _listing(folder)


def _listing(folder: Path) -> frozenset[str]:
    if not folder.is_dir():
        return frozenset()
    return frozenset(str(p.relative_to(folder)) for pattern in ("*", "*/*") for p in folder.glob(pattern))


_USERS_CACHE = _users_cache()
_USERS_HF = _USERS_HF_HOME, _listing(_USERS_HF_HOME)


def _users_profile() -> tuple[Path, bytes | None]:
    """This machine's measured profile in the user cache, and what it holds now."""
    from engine.estimates import hardware

    path = _users("INFERENCE_WORKBENCH_HARDWARE_PROFILE", hardware.profile_path)
    return path, path.read_bytes() if path.is_file() else None


# This machine's profile for the session: a private copy of the user's (measured once, not again
# for each test), so a re-measurement (the thread count is part of its fingerprint, and it adapts
# on a busy machine) never rewrites the user's cache.
_USERS_PROFILE = _users_profile()
_SESSION_PROFILE = Path(_SESSION_DATA) / "this-machine.json"
if _USERS_PROFILE[1] is not None:
    _SESSION_PROFILE.write_bytes(_USERS_PROFILE[1])
os.environ["INFERENCE_WORKBENCH_HARDWARE_PROFILE"] = str(_SESSION_PROFILE)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``alone`` measure the machine's load: beside another test process (pytest -n)
    they would measure that one. The README's test command runs them after the others, alone."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        skip = pytest.mark.skip(reason="measures the machine's load: run it without -n (the README's test command "
                                       "runs it alone after the others)")
        for item in items:
            if item.get_closest_marker("alone"):
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if anything wrote into the user's history folder, profile or cache meanwhile."""
    shutil.rmtree(_SESSION_DATA, ignore_errors=True)
    (_SESSION_CACHE / "default").unlink()  # the link only: the download stays for the next run
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
    for folder, before in (_USERS_CACHE, _USERS_HF):
        if _listing(folder) - before:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            print(f"\nThe tests wrote into the user's cache ({folder}): {sorted(_listing(folder) - before)[:10]}")
    path, before = _USERS_PROFILE
    if (path.read_bytes() if path.is_file() else None) != before:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nThe tests wrote this machine's profile into the user's cache ({path})")
    folder, before = _USERS_HISTORY
    after = frozenset(p.name for p in folder.glob("*")) if folder.is_dir() else frozenset()
    if after - before:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nThe tests wrote into the user's history ({folder}): {sorted(after - before)}")


@pytest.fixture(autouse=True)
def _private_history(tmp_path_factory, monkeypatch):
    """Runs that tests finish go to a private history folder of each test, never the user's."""
    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="session")
def byte_tokenizer():
    from tests.tiny import byte_level_tokenizer

    return byte_level_tokenizer()


@pytest.fixture(scope="session")
def sp_tokenizer():
    from tests.tiny import sentencepiece_tokenizer

    return sentencepiece_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, byte_tokenizer) -> dict[str, Path]:
    """One random-weight model folder per architecture (:data:`ARCHITECTURES`)."""
    from tests.tiny import build_model_folder

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_model_folder(root / arch, arch, byte_tokenizer) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def loaded_llama(tiny_llama):
    from engine.models.loading import LoadRequest, load_model

    return load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    """The real default model, fetched and converted once into the tests' download folder."""
    from engine.models import default_model

    return default_model.ensure()


@pytest.fixture(scope="session")
def default_gguf(default_model_folder) -> Path:
    """The default model's original GGUF file (in the tests' download folder)."""
    from engine.models import default_model

    return default_model.gguf_path()


@pytest.fixture(scope="session")
def default_fp32(default_model_folder):
    from engine.models.loading import LoadRequest, load_model

    return load_model(LoadRequest("default", "fp32", "cpu"))


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """A private workbench cache folder (GGUF conversions, this machine's profile… land here)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("INFERENCE_WORKBENCH_CACHE", str(cache))
    monkeypatch.delenv("INFERENCE_WORKBENCH_HARDWARE_PROFILE")
    return cache
