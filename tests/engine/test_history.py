from engine.storage import history
from engine.base.request import GenerationRequest
from engine.generation.generate import generate


def test_records_round_trip_and_a_broken_file_is_skipped(tmp_path, loaded_llama):
    finished = list(generate(loaded_llama, GenerationRequest("fox", mode="raw", max_new_tokens=4, ignore_eos=True)))[-1]
    record = history.record_from(loaded_llama.info, finished)
    path = history.save(record, tmp_path)
    (tmp_path / "broken.json").write_text('{"kind": "single", "when"')  # a crash mid-write of an old version
    (tmp_path / ".x.json.tmp").write_text("half")
    records = history.load_all(tmp_path)
    assert records == [record] and path.exists()
    assert records[0].hardware == "this-machine" and records[0].context == finished.prompt_tokens + 4


def test_gpu_runs_map_to_their_profile():
    assert history.hardware_for("cuda:0", "NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert history.hardware_for("cuda:0", "NVIDIA H200") == "h200"
    assert history.hardware_for("cpu", "Intel Xeon") == "this-machine"


def test_a_reload_parses_only_new_or_changed_files(tmp_path, monkeypatch):
    import json

    from engine.storage import history

    record = dict(kind="single", when="2026-01-01T00:00:00", model="one", model_ref="default", precision="fp32",
                  device="cpu", device_name="cpu", hardware="this-machine", parameters=1, weights_bytes=1,
                  kv_cache_bytes=1, kv_bytes_per_token=1, prompt_tokens=1, tokens=1, batch=1,
                  decode_tokens_per_s=1.0, ttft_s=0.1, peak_memory_bytes=1)
    first = tmp_path / "2026-01-01T000000-a.json"
    first.write_text(json.dumps(record), encoding="utf-8")
    assert [r.model for r in history.load_all(tmp_path)] == ["one"]
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(history.json, "loads", lambda text: parsed.append(1) or real_loads(text))
    second = tmp_path / "2026-01-02T000000-b.json"
    second.write_text(json.dumps({**record, "model": "two"}), encoding="utf-8")
    assert [r.model for r in history.load_all(tmp_path)] == ["one", "two"]
    assert len(parsed) == 1  # the first file was not read again
    first.write_text(json.dumps({**record, "model": "one, edited"}), encoding="utf-8")
    assert [r.model for r in history.load_all(tmp_path)][0] == "one, edited"
