"""The traffic view's plots, drawn from a :class:`~engine.serve.traffic.TrafficLog` when the
window's timer asks (~20 Hz, and only when the log changed), never per token:

- a timeline, a row per request: waiting (grey), reading its prompt (orange), generating (blue),
  done (green; red if cancelled or failed), a ◆ where it found its prompt's start in the prefix
  cache and a ✕ where it was preempted (then waiting and reading again); hover for its figures,
  click to open it;
- batch size and tokens per step over time;
- the KV cache held, stacked by request, with the blocks running requests share and the prefix
  cache's kept blocks on top, against the budget;
- the KV pool's blocks now, a square each: held by one request, shared (and by how many), cached
  for reuse, or empty;
- output tok/s (all requests) and the queue;
- TTFT, per-token latency and end-to-end distributions with p50/p90/p99.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QGridLayout, QToolTip, QWidget

from app.widgets.live_plots import SPIKE_FACTOR, PlotPanel
from engine.load.metrics import distribution
from engine.serve.traffic import TrafficLog

PHASE_COLOURS = {"waiting": "#9e9e9e", "prefill": "#f39c12", "decode": "#2d7dd2", "done": "#27ae60",
                 "failed": "#d63031"}
WINDOW_S = 60.0
"""The timeline and the step plots show the last minute."""
ROWS = 48
"""Requests on the timeline at most (the newest)."""
KV_SENTENCE = ("The cache each running request holds, stacked (a colour per batch slot, one request at a time); "
               "above them the blocks several running requests share, held once (green: a common "
               "prefix); on top the blocks kept for prefix reuse (grey: evicted first when a request needs "
               "room), against the budget.")
SHARED_BRUSH = pg.mkBrush(39, 174, 96, 120)
BLOCKS_SENTENCE = ("The KV pool's blocks after the last step, a square of 16 tokens each, in the pool's order: "
                   "blue held by one request, green shared by several (darker: more; hover for how many), grey "
                   "cached for a later prompt, pale empty. The pool grows as requests need blocks, up to the budget.")
BLOCK_COLOURS = {"empty": (232, 232, 232, 255), "cached": (150, 150, 150, 255), "held": (45, 125, 210, 255)}


def block_image(holders: tuple[int, ...], columns: int) -> np.ndarray:
    """RGBA rows of ``columns`` squares for the pool's blocks (``holders``: -1 cached, 0 empty,
    else how many requests hold it), shared blocks a darker green the more requests hold them."""
    count = len(holders)
    rows = max(1, -(-count // columns))
    image = np.zeros((rows * columns, 4), dtype=np.uint8)
    values = np.asarray(holders, dtype=np.int64)
    image[:count] = BLOCK_COLOURS["empty"]
    image[:count][values == -1] = BLOCK_COLOURS["cached"]
    image[:count][values == 1] = BLOCK_COLOURS["held"]
    shared = values >= 2
    if shared.any():
        depth = np.clip((values[shared] - 2) * 12, 0, 84).astype(np.uint8)
        image[:count][shared] = np.stack([39 - depth // 4, 174 - depth, 96 - depth // 2,
                                          np.full_like(depth, 255)], axis=1)
    return image.reshape(rows, columns, 4)
KEPT_BRUSH = pg.mkBrush(120, 120, 120, 110)


def band_colour(slot: int) -> QColor:
    colour = pg.intColor(slot, hues=12, values=2, minValue=190, maxValue=240, sat=120)
    colour.setAlpha(200)
    return colour


class Histogram(PlotPanel):
    """A distribution with its p50/p90/p99 marked and written in the caption."""

    def __init__(self, title: str, unit: str, scale: float) -> None:
        super().__init__(title, f"{title}: how many requests (or gaps) took how long.", "count", unit)
        self.unit, self.scale = unit, scale
        self.bars = pg.BarGraphItem(x0=[], x1=[], height=[], brush=PHASE_COLOURS["decode"], pen=None)
        self.plot.addItem(self.bars)
        self.lines = {}
        for name, style in (("median", Qt.SolidLine), ("p90", Qt.DashLine), ("p99", Qt.DotLine)):
            line = pg.InfiniteLine(angle=90, pen=pg.mkPen("#d63031", width=1, style=style))
            line.hide()
            self.plot.addItem(line)
            self.lines[name] = line
        self.title = title
        self._count = -1

    def draw(self, values: list[float]) -> None:
        if len(values) == self._count:
            return
        self._count = len(values)
        if not values:
            self.bars.setOpts(x0=[], x1=[], height=[])
            self._sentence = f"{self.title}: no requests yet."
            self._show_caption()
            return
        data = np.asarray(values) * self.scale
        # a few far outliers (one request that waited minutes) would squeeze the rest into one bar:
        # past 10 values the view stops at 3 × the 95th percentile and the caption says what is above
        shown = data
        if len(data) >= 10 and data.max() > SPIKE_FACTOR * np.percentile(data, 95):
            shown = data[data <= SPIKE_FACTOR * np.percentile(data, 95)]
        counts, edges = np.histogram(shown, bins=min(30, max(5, len(shown) // 3)))
        self.bars.setOpts(x0=edges[:-1], x1=edges[1:], height=counts)
        stats = distribution(data)
        for name, line in self.lines.items():
            line.setValue(stats[name])
            line.show()
        self.item.setXRange(0, float(edges[-1]) * 1.05, padding=0)
        self.item.setYRange(0, float(counts.max()) * 1.15, padding=0)
        fmt = "{:.0f}" if self.scale >= 1000 else "{:.2f}"
        self._sentence = (f"<b>{self.title}</b> ({len(data)}): p50 {fmt.format(stats['median'])} · p90 "
                          f"{fmt.format(stats['p90'])} · p99 {fmt.format(stats['p99'])} {self.unit} "
                          "(red lines: ━ p50, ╍ p90, ┅ p99)" + self._above(data, len(data) - len(shown), fmt))
        self._show_caption()

    def _above(self, data: np.ndarray, above: int, fmt: str) -> str:
        if not above:
            return ""
        return (f" · {above} above the view, the longest {fmt.format(float(data.max()))} {self.unit}")


class TrafficPlots(QWidget):
    request_clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.log: TrafficLog | None = None
        self._version = dict.fromkeys((None, 0, 1, 2, 3), -1)
        self.timeline = PlotPanel("Requests", "A row per request: waiting, reading its prompt, generating, done. "
                                  "Hover for its figures; click to see its prompt and tokens.", "request", "s")
        for phase in ("waiting", "prefill", "decode", "done", "failed"):
            self.timeline.add_legend({"prefill": "prompt", "failed": "cancelled / failed"}.get(phase, phase),
                                     PHASE_COLOURS[phase], "██")
        self.bars = {phase: pg.BarGraphItem(x0=[], x1=[], y=[], height=[], brush=colour, pen=None)
                     for phase, colour in PHASE_COLOURS.items()}
        for bar in self.bars.values():
            self.timeline.plot.addItem(bar)
        self.hits = pg.ScatterPlotItem(symbol="d", size=9, brush=pg.mkBrush("#27ae60"), pen=pg.mkPen("#1e8449"))
        self.preemptions = pg.ScatterPlotItem(symbol="x", size=11, brush=pg.mkBrush("#d63031"), pen=None)
        for marks in (self.hits, self.preemptions):
            marks.setZValue(10)
            self.timeline.plot.addItem(marks)
        self.timeline.add_legend("prompt start from the prefix cache", "#27ae60", "◆")
        self.timeline.add_legend("preempted (KV ran out)", "#d63031", "✕")
        self.timeline.plot.scene().sigMouseMoved.connect(self._hover)
        self.timeline.plot.scene().sigMouseClicked.connect(self._click)

        self.steps = PlotPanel("Batch", "Each step of the engine: requests that got a token (the batch) and "
                               "tokens put through the model (decode + prompt chunks).", "per step", "s")
        self.batch_curve = self.steps.curve("batch", "main")
        self.tokens_curve = self.steps.curve("tokens per step", "second", Qt.DashLine)

        self.kv = PlotPanel("KV cache", KV_SENTENCE, "MiB", "s")
        self.kv.add_legend("budget", "#d63031", "╍╍")
        self.kv.add_legend("shared by running requests (held once)", "#27ae60", "██")
        self.kv.add_legend("prefix cache (kept blocks)", "#787878", "██")
        self.kept_band = self.kv.plot.plot([], [], pen=None, fillLevel=0, brush=KEPT_BRUSH)
        self.kept_band.setZValue(-2)  # under the requests' bands: it shows above their top
        self.shared_band = self.kv.plot.plot([], [], pen=None, fillLevel=0, brush=SHARED_BRUSH)
        self.shared_band.setZValue(-1)
        self.budget_line = pg.InfiniteLine(angle=0, pen=pg.mkPen("#d63031", width=1, style=Qt.DashLine))
        self.budget_line.hide()
        self.kv.plot.addItem(self.budget_line)
        self.kv_bands: list = []

        self.blocks = PlotPanel("KV blocks", BLOCKS_SENTENCE, "", "")
        for name, colour in (("held", "#2d7dd2"), ("shared", "#27ae60"), ("cached", "#969696"), ("empty", "#e8e8e8")):
            self.blocks.add_legend(name, colour, "██")
        self.blocks.item.hideAxis("left")
        self.blocks.item.hideAxis("bottom")
        self.blocks.item.invertY(True)  # the pool's first block top left, read as text
        self.block_squares = pg.ImageItem(axisOrder="row-major")
        self.blocks.plot.addItem(self.block_squares)
        self.blocks.plot.scene().sigMouseMoved.connect(self._hover_block)
        self._block_columns = 1

        self.rate = PlotPanel("Throughput", "Output tokens per second of all requests together (over the last "
                              "second), and the queue.", "tok/s · requests", "s")
        self.rate_curve = self.rate.curve("output tok/s", "main")
        self.running_curve = self.rate.curve("running", "third")
        self.waiting_curve = self.rate.curve("waiting", "second", Qt.DashLine)

        self.ttft = Histogram("TTFT", "ms", 1000.0)
        self.itl = Histogram("Per-token latency", "ms", 1000.0)
        self.e2e = Histogram("End to end", "s", 1.0)

        grid = QGridLayout(self)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.addWidget(self.timeline, 0, 0, 2, 1)
        grid.addWidget(self.steps, 0, 1)
        grid.addWidget(self.kv, 1, 1)
        grid.addWidget(self.rate, 0, 2)
        grid.addWidget(self.ttft, 1, 2)
        grid.addWidget(self.blocks, 2, 0)
        grid.addWidget(self.itl, 2, 1)
        grid.addWidget(self.e2e, 2, 2)
        grid.setColumnStretch(0, 3)
        grid.setColumnStretch(1, 2)
        grid.setColumnStretch(2, 2)
        grid.setRowStretch(0, 3)
        grid.setRowStretch(1, 3)
        grid.setRowStretch(2, 2)
        self._rows: dict[int, int] = {}

    # -- drawing -----------------------------------------------------------------------------
    def refresh(self, log: TrafficLog, only: int | None = None) -> bool:
        """Redraw if ``log`` changed since the last call (``only``: just that one of the four
        groups: timeline, steps and throughput, KV cache, distributions; a window's timer takes
        them in turn, so one tick costs a few ms); ``True`` if it drew."""
        if log is not self.log:
            self._version = dict.fromkeys(self._version, -1)
        elif log.version == self._version[only]:
            return False
        self.log = log
        self._version[only] = log.version
        now = log.now
        start = max(0.0, now - WINDOW_S)
        if only in (None, 0):
            self._draw_timeline(log, start, now)
        if only in (None, 1):
            self._draw_steps(log, start, now)
        if only in (None, 2):
            self._draw_kv(log, start, now)
            self._draw_blocks(log)
        if only in (None, 3):
            self.ttft.draw(log.ttft_s)
            self.itl.draw(log.itl_s)
            self.e2e.draw(log.e2e_s)
        return True

    def _draw_timeline(self, log: TrafficLog, start: float, now: float) -> None:
        tracks = [t for t in log.requests.values()
                  if t.finished_s is None or t.finished_s >= start][-ROWS:]
        self._rows = {t.request_id: i for i, t in enumerate(tracks)}
        spans: dict[str, list] = {phase: [] for phase in PHASE_COLOURS}
        for row, track in enumerate(tracks):
            for phase, a, b in track.spans(now):
                if phase == "decode" and track.finished is not None:
                    phase = "done" if track.finished.reason not in ("cancelled", "error") else "failed"
                elif phase == "prefill" and track.finished is not None and track.first_token_s is None:
                    phase = "failed"
                spans[phase].append((max(a, start), max(b, start), row))
        hits, preempted = [], []
        for row, track in enumerate(tracks):
            if track.cached_tokens and track.admitted_s is not None and track.admitted_s >= start:
                hits.append((track.admitted_s, row))
            preempted += [(at, row) for at in track.preempted_s if at >= start]
        self.hits.setData([at for at, _ in hits], [row for _, row in hits])
        self.preemptions.setData([at for at, _ in preempted], [row for _, row in preempted])
        for phase, bar in self.bars.items():
            rows = spans[phase]
            bar.setOpts(x0=[r[0] for r in rows], x1=[max(r[1], r[0] + 0.005) for r in rows],
                        y=[r[2] for r in rows], height=[0.7] * len(rows))
        self.timeline.item.setXRange(start, max(now, start + 5), padding=0.01)
        self.timeline.item.setYRange(-1, max(len(tracks), 8), padding=0)

    def _draw_steps(self, log: TrafficLog, start: float, now: float) -> None:
        s = log.steps()
        keep = s["at_s"] >= start
        at = s["at_s"][keep]
        self.batch_curve.setData(at, s["batch"][keep])
        self.tokens_curve.setData(at, (s["decode_tokens"] + s["prefill_tokens"])[keep])
        top = float(max(s["batch"][keep].max(initial=1), (s["decode_tokens"] + s["prefill_tokens"])[keep].max(initial=1)))
        self.steps.item.setXRange(start, max(now, start + 5), padding=0.01)
        self.steps.item.setYRange(0, top * 1.1, padding=0)
        t, rate = log.output_rate(steps=s)
        keep_rate = t >= start
        self.rate_curve.setData(t[keep_rate], rate[keep_rate])
        self.running_curve.setData(at, s["running"][keep])
        self.waiting_curve.setData(at, s["waiting"][keep])
        top = float(max(rate[keep_rate].max(initial=1), s["running"][keep].max(initial=1),
                        s["waiting"][keep].max(initial=1)))
        self.rate.item.setXRange(start, max(now, start + 5), padding=0.01)
        self.rate.item.setYRange(0, top * 1.1, padding=0)

    def _draw_kv(self, log: TrafficLog, start: float, now: float) -> None:
        times, table, shared, kept = log.kv_stack(start)
        stacked = np.cumsum(table, axis=0) / 2**20
        slots = len(table)
        while len(self.kv_bands) < slots:
            band = self.kv.plot.plot([], [], pen=None, fillLevel=0, brush=band_colour(len(self.kv_bands)))
            self.kv_bands.append(band)
        for i, band in enumerate(self.kv_bands):
            if i < slots:
                j = slots - 1 - i  # the top band first, so each lower one paints over it
                band.setData(times, stacked[j])
                band.setBrush(band_colour(j))
                band.setZValue(i)
                band.show()
            else:
                band.hide()
        held = stacked[-1] if slots and len(times) else np.zeros(len(times))
        shared = shared / 2**20
        if shared.any():
            self.shared_band.setData(times, held + shared)
        else:
            self.shared_band.setData([], [])
        held = held + shared
        kept = kept / 2**20
        if kept.any():
            self.kept_band.setData(times, held + kept)
        else:
            self.kept_band.setData([], [])
        used = float((held + kept).max()) if len(times) else 0.0
        budget = (log.kv_budget_bytes or 0) / 2**20
        shown = max(used * 1.2, 1.0)
        if budget and budget <= 4 * shown:
            self.budget_line.setValue(budget)
            self.budget_line.show()
            shown = max(shown, budget * 1.05)
            note = ""
        else:
            self.budget_line.hide()
            note = (f" Budget {budget:,.0f} MiB: off the chart ({used / budget:.1%} used at most)." if budget else "")
        self.kv._sentence = KV_SENTENCE + note
        self.kv._show_caption()
        self.kv.item.setXRange(start, max(now, start + 5), padding=0.01)
        self.kv.item.setYRange(0, shown, padding=0)

    def _draw_blocks(self, log: TrafficLog) -> None:
        holders = log.block_map
        count = len(holders)
        view = self.blocks.plot.size()
        aspect = max(view.width(), 1) / max(view.height(), 1)
        columns = max(1, int(np.ceil(np.sqrt(max(count, 1) * aspect))))
        self._block_columns = columns
        image = block_image(holders, columns)
        self.block_squares.setImage(image, levels=(0, 255))
        self.blocks.item.setXRange(0, columns, padding=0)
        self.blocks.item.setYRange(0, image.shape[0], padding=0)
        shared = sum(1 for h in holders if h >= 2)
        self.blocks.set_title(f"{count:,} blocks: {sum(1 for h in holders if h >= 1):,} held ({shared:,} shared), "
                              f"{sum(1 for h in holders if h == -1):,} cached" if count else None)

    def _hover_block(self, scene_pos) -> None:
        holders = self.log.block_map if self.log is not None else ()
        point = self.blocks.item.vb.mapSceneToView(scene_pos)
        column, row = int(point.x()), int(point.y())
        index = row * self._block_columns + column
        if not (0 <= column < self._block_columns and 0 <= index < len(holders)):
            return
        h = holders[index]
        what = {-1: "cached for a later prompt", 0: "empty"}.get(h, "held by one request" if h == 1 else
                                                                  f"shared by {h} requests")
        QToolTip.showText(self.blocks.plot.mapToGlobal(self.blocks.plot.mapFromScene(scene_pos)),
                          f"block {index}: {what}")

    # -- pointing --------------------------------------------------------------------------
    def _track_at(self, scene_pos) -> object:
        if self.log is None:
            return None
        view = self.timeline.item.vb
        if not view.sceneBoundingRect().contains(scene_pos):
            return None
        point: QPointF = view.mapSceneToView(scene_pos)
        row = round(point.y())
        for rid, r in self._rows.items():
            if r == row and abs(point.y() - row) <= 0.4:
                track = self.log.requests.get(rid)
                if track is not None and track.arrived_s <= point.x() <= (track.finished_s or self.log.now) + 0.05:
                    return track
        return None

    def _hover(self, scene_pos) -> None:
        track = self._track_at(scene_pos)
        if track is not None:
            view = self.timeline.plot
            QToolTip.showText(view.mapToGlobal(view.mapFromScene(scene_pos)), track.describe(), view)
        else:
            QToolTip.hideText()

    def _click(self, event) -> None:
        track = self._track_at(event.scenePos())
        if track is not None:
            self.request_clicked.emit(track.request_id)
