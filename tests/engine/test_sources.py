import hashlib
import os
from pathlib import Path

import pytest

from engine.base.errors import HubModelUnavailableError, ModelNotFoundError, NotAModelError
from engine.base.events import TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine.models.sources import classify, list_models, resolve
from engine.generation.generate import generate


def make_hub_cache(cache: Path, repo_id: str, source: Path, revision: str = "0" * 40) -> Path:
    """Lay out ``source`` the way huggingface_hub caches a download: blobs + snapshot links."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.mark.parametrize("ref,kind", [
    ("default", "default"), ("DEFAULT", "default"), ("HuggingFaceTB/SmolLM2-135M-Instruct", "hub"),
    ("org/model@main", "hub"),
])
def test_classify_without_touching_disk(ref, kind):
    assert classify(ref)[0] == kind


def test_classify_paths(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "readme.md").write_text("x")
    assert classify(str(tmp_path)) == ("folder", str(tmp_path))
    assert classify(str(tmp_path / "m.gguf"))[0] == "gguf"
    assert classify(str(tmp_path / "config.json")) == ("folder", str(tmp_path))
    with pytest.raises(NotAModelError):
        classify(str(tmp_path / "readme.md"))
    for missing in ("/no/such/dir", "./rel/x", "~/nope.gguf", "a/b/c", "not a model", ""):
        with pytest.raises(ModelNotFoundError):
            classify(missing)


def test_hub_id_loads_from_the_local_cache_offline(tmp_path, tiny_llama, monkeypatch):
    cache = tmp_path / "hub"
    make_hub_cache(cache, "tiny/llama", tiny_llama)
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    resolved = resolve("tiny/llama", offline=True, hub_cache=cache)
    assert resolved.source == "hub" and resolved.name == "tiny/llama"
    assert (resolved.folder / "config.json").exists()
    loaded = load_model(LoadRequest("tiny/llama", "fp32", "cpu", offline=True))
    assert loaded.info.source == "hub"
    assert any(isinstance(e, TokenGenerated)
               for e in generate(loaded, GenerationRequest("fox", mode="raw", max_new_tokens=2)))


def test_uncached_hub_id_offline_names_the_id(tmp_path):
    with pytest.raises(HubModelUnavailableError, match="nobody/no-such-model"):
        resolve("nobody/no-such-model", offline=True, hub_cache=tmp_path)


def test_uncached_hub_id_with_network_attempt_fails_clearly(tmp_path):
    # Our machines reach no hub; a connected machine is told the repo doesn't exist.
    with pytest.raises(HubModelUnavailableError, match="nobody-x9/no-such-model-x9"):
        resolve("nobody-x9/no-such-model-x9", hub_cache=tmp_path)


def test_list_models_shows_default_then_cached_models(tmp_path, tiny_llama, isolated_cache):
    cache = tmp_path / "hub"
    make_hub_cache(cache, "tiny/llama", tiny_llama)
    make_hub_cache(cache, "tiny/not-a-model", tiny_llama.parent / "gpt2", revision="1" * 40)
    (cache / "models--tiny--not-a-model" / "snapshots" / ("1" * 40) / "config.json").unlink()
    entries = list_models(cache)
    assert entries[0].ref == "default" and entries[0].ready is False
    assert [e.ref for e in entries[1:]] == ["tiny/llama"]
    assert entries[1].size_bytes > 0 and entries[1].ready


def test_list_models_without_a_cache(tmp_path, isolated_cache):
    assert [e.ref for e in list_models(tmp_path / "missing")] == ["default"]


def test_an_unreadable_file_is_a_permission_problem(tiny_llama, tmp_path, monkeypatch):
    """(As root every file is readable, so the check is made to fail for one file.)"""
    import os
    import shutil

    from engine.models import sources
    from engine.base.errors import NotAModelError

    folder = tmp_path / "locked"
    shutil.copytree(tiny_llama, folder)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path).endswith(".safetensors") else real(path, mode))
    with pytest.raises(NotAModelError, match="Permission denied reading .*model.safetensors"):
        sources.inspect_folder(folder)
