from engine.storage import history
from engine.request import GenerationRequest


def test_records_round_trip_and_a_broken_file_is_skipped(tmp_path, loaded_llama):
    finished = list(loaded_llama.generate(GenerationRequest("fox", mode="raw", max_new_tokens=4, ignore_eos=True)))[-1]
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
