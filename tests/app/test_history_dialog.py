"""File → Run history: a server run's requests are one row; kind, model and text filters; delete."""

from __future__ import annotations

from engine.storage import history
from engine.storage.history import RunRecord


def record(kind: str, when: str, model: str = "tiny", **extra) -> RunRecord:
    return RunRecord(kind=kind, when=when, model=model, model_ref=model, precision="fp32", device="cpu",
                     device_name="CPU", hardware="this-machine", parameters=1, weights_bytes=1, kv_cache_bytes=1,
                     kv_bytes_per_token=1, prompt_tokens=4, tokens=8, batch=1, decode_tokens_per_s=10.0, ttft_s=0.1,
                     peak_memory_bytes=1, extra=extra)


def test_the_history_groups_a_servers_requests_filters_searches_and_deletes(qtbot, tmp_path, monkeypatch):
    from app.history_dialog import HistoryDialog

    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path / "data"))
    history.save(record("single", "2026-01-01T10:00:00", transcript_markdown="**You:** what is a KV cache?"))
    for second in range(3):  # one server run's three requests
        history.save(record("served", f"2026-01-01T10:01:0{second}", serving="2026-01-01T10:00:30",
                            client=f"127.0.0.1:{5000 + second}"))
    history.save(record("served", "2026-01-01T11:00:00", serving="2026-01-01T10:59:00"))  # another server run
    history.save(record("sweep", "2026-01-01T12:00:00", model="other", batch=4))

    dialog = HistoryDialog()
    qtbot.addWidget(dialog)
    qtbot.waitSignal(dialog.ready, timeout=30_000).wait()
    kinds = [dialog.cell(r, 1) for r in range(dialog.model.rowCount())]
    assert kinds == ["sweep", "served", "served", "single"]  # newest first, each server run one row
    assert dialog.cell(2, 10) == "3 requests" and dialog.cell(2, 6) == "24"
    dialog.table.selectRow(2)
    assert "A server run: 3 requests" in dialog.details.toPlainText()

    dialog.kind.setCurrentIndex(dialog.kind.findData("served"))
    assert dialog.model.rowCount() == 2
    dialog.kind.setCurrentIndex(0)
    dialog.model_pick.setCurrentIndex(dialog.model_pick.findData("other"))
    assert [dialog.cell(r, 1) for r in range(dialog.model.rowCount())] == ["sweep"]
    dialog.model_pick.setCurrentIndex(0)
    dialog.search.setText("KV CACHE")  # the transcript's text, case ignored
    assert [dialog.cell(r, 1) for r in range(dialog.model.rowCount())] == ["single"]
    dialog.search.setText("nothing like this")
    assert dialog.model.rowCount() == 0 and "No run matches" in dialog.details.toPlainText()
    dialog.search.clear()

    dialog.table.selectRow(2)
    assert dialog.delete_selected(confirm=False) == 3  # the server run: its three requests' files
    assert [dialog.cell(r, 1) for r in range(dialog.model.rowCount())] == ["sweep", "served", "single"]
    assert len(history.load_all()) == 3  # gone from the folder, not only from the list
