"""Compare's Quality run: every lane's model reads the same text (engine/jobs.py's QualityJob),
lane 1 first, whose kept distributions are the others' reference; one lane at a time, so each
lane's time is its own and only one text's logits are in memory. A served lane is sent lane 1's
tokens and scored from the prompt log-probabilities its server returns
(engine/measure/served_quality.py)."""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from app.widgets.quality_view import LaneQuality
from engine.jobs import QualityJob, QualityResult
from engine.models.sources import reference_weights


class QualityRun(QObject):
    progressed = Signal(object, str)  # lane, what it is doing
    overall = Signal(str)  # the whole run: which lane of how many, and about how long is left in all
    finished = Signal(object)  # list[LaneQuality], one per lane that measured
    failed = Signal(str)  # why the run ended early (the lanes measured so far are in ``rows``)

    def __init__(self, lanes, text: str | None = None, ctx: int = 512, chunks: int | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.lanes = list(lanes)
        self.text, self.ctx, self.chunks = text, ctx, chunks
        self.rows: list[LaneQuality] = []
        self.first = None
        """Lane 1's result: its kept distributions are the others' reference, and a served lane is
        sent its tokens."""
        self._queue = list(self.lanes)
        self._current = None
        self._job: int | None = None
        self.running = False
        self.stopped = False

    @property
    def reference(self):
        """Lane 1's kept distributions (``None`` until lane 1 has read the text)."""
        return None if self.first is None else self.first.reference

    def start(self) -> None:
        self.running = True
        self._next()

    def stop(self) -> None:
        self.stopped = True
        self._queue = []
        if self._current is not None and self._job is not None:
            self._current.session.cancel(self._job)

    def _next(self) -> None:
        self._disconnect()
        if self.stopped:  # a lane may have finished its last chunk before Stop reached it
            self.running = False
            self.failed.emit(f"Quality stopped: {len(self.rows)} of {len(self.lanes)} lanes measured.")
            return
        if not self._queue:
            self.running = False
            self.finished.emit(self.rows)
            return
        lane = self._current = self._queue.pop(0)
        session = lane.session
        session.job_events.connect(self._on_events)
        session.job_finished.connect(self._on_finished)
        session.job_failed.connect(self._on_failed)
        self._job = session.submit(QualityJob(self.text, self.ctx, self.chunks, self.reference, read_by=self.first))
        self.progressed.emit(lane, "quality: reading the text…")

    def _disconnect(self) -> None:
        lane, self._current = self._current, None
        if lane is None:
            return
        for signal, slot in ((lane.session.job_events, self._on_events), (lane.session.job_finished, self._on_finished),
                             (lane.session.job_failed, self._on_failed)):
            try:
                signal.disconnect(slot)
            except (RuntimeError, TypeError):
                pass

    def _on_events(self, job_id: int, events) -> None:
        if job_id != self._job:
            return
        p = events[-1]
        eta = f", {p.eta_s:,.0f} s left" if p.eta_s is not None else ""
        self.progressed.emit(self._current, f"quality: chunk {p.chunks_done}/{p.chunks} · "
                                            f"{p.tokens_per_s:,.0f} tok/s{eta}")
        self.overall.emit(self.describe(p.chunks_done, p.chunks, p.eta_s))

    def describe(self, done: int, chunks: int, eta_s: float | None) -> str:
        """The whole run in a line: the lane reading now, and the time left in all (this lane's
        estimate, and each lane still queued at the mean of the lanes measured so far, or at this
        lane's own pace before any has finished)."""
        lane = len(self.rows) + 1
        said = f"Quality: lane {lane} of {len(self.lanes)}, chunk {done}/{chunks}"
        if eta_s is None:
            return said + "."
        measured = [row.report.seconds for row in self.rows]
        each = sum(measured) / len(measured) if measured else eta_s * chunks / max(chunks - done, 1)
        left = eta_s + each * len(self._queue)
        return said + f" · about {left:,.0f} s left in all."

    def _on_finished(self, job_id: int, result: QualityResult) -> None:
        if job_id != self._job:
            return
        lane = self._current
        if self.first is None:
            self.first = result
        run = lane.run.finished if lane.run is not None else None
        speed = run.decode_tokens_per_s if run is not None else None
        info = lane.loaded
        weights_from = "" if info is None else reference_weights(info.original_format, info.precision,
                                                                  served=info.source == "endpoint")
        self.rows.append(LaneQuality(lane.index + 1, lane.spec().label, lane.colour, lane.spec().precision, speed,
                                     result.report, result.pieces, weights_from,
                                     None if info is None else info.kv_bytes_per_token))
        report = result.report
        self.progressed.emit(lane, f"quality: perplexity {report.perplexity:.3f}"
                                   + ("" if report.divergence is None else
                                      f", mean KLD {report.divergence.kld_mean:.5f}")
                                   + f" ({report.seconds:.1f} s)")
        self._next()

    def _on_failed(self, job_id: int, exc) -> None:
        if job_id != self._job:
            return
        lane = self._current
        self._queue = []
        self._disconnect()
        self.running = False
        message = str(exc) or type(exc).__name__
        self.progressed.emit(lane, f"quality: {message}")
        self.failed.emit(f"Quality stopped at lane {lane.index + 1}: {message}" if not self.stopped else
                         f"Quality stopped: {len(self.rows)} of {len(self.lanes)} lanes measured.")
