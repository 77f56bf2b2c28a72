import pytest

from engine.base.errors import CorruptModelError, ModelNotFoundError
from engine.models.gguf_files import summarize_gguf
from engine.models.loading import LoadRequest, load_model
from tests.tiny import write_gguf


@pytest.fixture
def small_gguf(tmp_path):
    return write_gguf(tmp_path / "small.gguf")


def test_summary_of_a_good_file(small_gguf):
    summary = summarize_gguf(small_gguf)
    assert (summary.architecture, summary.name, summary.file_type) == ("llama", "small", "ALL_F32")
    assert summary.tensor_types == {"F32": 2}


@pytest.mark.parametrize("keep", [100, 0.6])
def test_truncated_gguf_is_refused(tmp_path, small_gguf, keep):
    data = small_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(CorruptModelError, match="cut.gguf"):
        summarize_gguf(cut)


def test_not_a_gguf(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(CorruptModelError, match="not a GGUF"):
        summarize_gguf(fake)


def test_gguf_header_with_garbage(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(CorruptModelError, match="bad.gguf"):
        summarize_gguf(bad)


def test_loading_a_corrupt_gguf_says_so_and_leaves_no_cache(tmp_path, isolated_cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CorruptModelError, match="broken.gguf"):
        load_model(LoadRequest(str(bad), "fp32", "cpu"))
    converted = isolated_cache / "converted"
    assert not converted.exists() or not any(converted.iterdir())


def test_missing_gguf(tmp_path):
    with pytest.raises(ModelNotFoundError):
        summarize_gguf(tmp_path / "absent.gguf")
