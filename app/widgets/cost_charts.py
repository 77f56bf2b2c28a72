"""The cost explorer's charts: the memory a setup needs, the decode speed ceiling against batch,
$ per 1M tokens against batch, and KV bytes against context, with measured runs on them; and two
cells for the serving section's charts (app/widgets/cost_serving.py).

Built one chart per turn of the event loop (each pyqtgraph plot takes a frame or more to make), so
opening the window never blocks the GUI for long; ``ready`` says they are all there.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QGridLayout, QStackedWidget, QWidget

from app.frame_budget import in_turns
from app.widgets.live_plots import PlotPanel
from engine.base.errors import EngineError
from engine.base.units import binary_unit
from engine.estimates import costs
from engine.estimates.costs import ALL_PRECISIONS
from engine.estimates.parallel import ceiling_for, plan_tensor_parallel
from engine.storage.history import RunRecord

CONTEXTS = [2 ** k for k in range(7, 18)]  # 128 … 131072
BATCHES = [2 ** k for k in range(0, 12)]  # 1 … 2048
COLOURS = {"weights": "#2d7dd2", "kv": "#f39c12", "activations": "#8e44ad", "memory": "#2d7dd2",
           "compute": "#c0392b", "ceiling": "#27ae60", "measured": "#e74c3c", "device": "#7f8c8d",
           "load": "#8e44ad"}


def _pen(colour: str, style=Qt.SolidLine, width: int = 1):
    return pg.mkPen(colour, width=width, style=style)


class CostCharts(QWidget):
    """The four charts in a 2 × 2 grid, and a third column for the serving section's two."""

    ready = Signal()  # the four charts are made
    drawn = Signal()  # a draw finished

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._prefix = 0
        self._grid = QGridLayout(self)
        # a cell per chart from the start: a chart placed later fills its cell without resizing (and
        # repainting) the others
        self._cells = [QStackedWidget() for _ in range(6)]
        for index, cell in enumerate(self._cells):
            cell.addWidget(QWidget())
            self._grid.addWidget(cell, *((index // 2, index % 2) if index < 4 else (index - 4, 2)))
        self._curves: dict[str, object] = {}
        self._run_labels: list = []
        self._loads: list = []
        self._gpus = 1
        self._money_title: str | None = None
        self.load_shares: list[float] = []
        """The drawn load points' shares of the ceiling (%), in the order of the records."""
        self._drawing = 0
        self.memory_bars: list[float] = []
        self.speed_ceiling = None
        self.ridge_log2: float | None = None
        self.built = False
        in_turns([self._build_memory, self._build_speed, self._build_money, self._build_kv], self._on_built, owner=self)

    def _on_built(self) -> None:
        self.built = True
        self.ready.emit()

    def place(self, panel: PlotPanel, index: int) -> None:
        """``panel`` in cell ``index``: 0-3 the grid's, 4 and 5 the third column's."""
        panel.item.getAxis("left").enableAutoSIPrefix(False)  # our ticks carry their units; no "(x0.001)"
        self._cells[index].addWidget(panel)
        self._cells[index].setCurrentWidget(panel)

    def _build_memory(self) -> None:
        self.memory_plot = PlotPanel(
            "cost-memory", "Memory the model needs (stacked: weights, KV cache for batch × context, "
            "activations) against the device's memory (grey line); measured runs as red dots.", "memory", "")
        self.memory_plot.item.getAxis("bottom").setTicks([[(0, "weights + KV + activations")]])
        for name, colour in (("weights", COLOURS["weights"]), ("KV cache", COLOURS["kv"]),
                             ("activations", COLOURS["activations"])):
            self.memory_plot.add_legend(name, colour, "■")
        self.memory_plot.add_legend("device memory", COLOURS["device"], "╍╍")
        self.place(self.memory_plot, 0)

    def _build_speed(self) -> None:
        self.speed_plot = PlotPanel(
            "cost-speed", "Decode tokens/sec ceiling against batch: reading the weights (and KV) bounds small "
            "batches (blue region), compute bounds large ones (red region); the ceiling is the lower of the two, "
            "drawn up to the largest batch whose memory fits. "
            "Dots: measured runs, labelled with their % of the ceiling. Diamonds: load sweeps against servers "
            "of this model (concurrency as the batch), each under a bar at its own ceiling: the plan's GPU "
            "count at that batch and the load's context.",
            "tokens / s (all requests)", "batch")
        for name, colour, glyph in (("memory-bound", COLOURS["memory"], "╍╍"), ("compute-bound", COLOURS["compute"], "╍╍"),
                                    ("ceiling", COLOURS["ceiling"], "━━"), ("measured", COLOURS["measured"], "●"),
                                    ("server loads", COLOURS["load"], "◆"), ("their ceilings", COLOURS["load"], "▬")):
            self.speed_plot.add_legend(name, colour, glyph)
        self._regions = [pg.LinearRegionItem(movable=False, brush=pg.mkBrush(45, 125, 210, 28), pen=pg.mkPen(None)),
                         pg.LinearRegionItem(movable=False, brush=pg.mkBrush(192, 57, 43, 28), pen=pg.mkPen(None))]
        for region in self._regions:
            self.speed_plot.plot.addItem(region, ignoreBounds=True)
        self.place(self.speed_plot, 1)

    def _build_money(self) -> None:
        self.money_plot = PlotPanel(
            "cost-money", "$ per 1M output tokens at the ceiling: batching shares the weight reads, so it falls "
            "until compute takes over.", "$ per 1M tokens", "batch")
        self._money_note = pg.TextItem("", color=COLOURS["device"], anchor=(0.5, 0.5))
        self._money_note.textItem.setTextWidth(240)  # wraps inside the plot however narrow
        self.money_plot.plot.addItem(self._money_note, ignoreBounds=True)
        self.place(self.money_plot, 2)

    def _build_kv(self) -> None:
        self.kv_plot = PlotPanel(
            "cost-kv", "KV-cache bytes of one sequence against context length; sliding-window layers stop "
            "growing at their window. Red dots: measured runs.", "KV cache", "context (tokens)")
        self.place(self.kv_plot, 3)

    def _curve(self, key: str, panel: PlotPanel, **style):
        if key not in self._curves:
            self._curves[key] = panel.plot.plot([], [], **style)
        return self._curves[key]

    def draw(self, e, config, profile, runs: list[RunRecord], kv_dtype: str, count, loads=(), gpus: int = 1,
             prefix: int = 0) -> None:
        """Draw ``e`` (the estimate at the chosen batch and context), the sweeps around it, and the
        measured ``runs`` of this model, precision and hardware: one chart per turn of the event
        loop (with a thousand runs a chart and its repaint take a frame or two); ``drawn`` follows.
        A new call restarts the drawing. ``loads``: load-sweep settings against servers of this model,
        drawn on the speed chart as shares of the ceiling of ``gpus`` GPUs."""
        self._loads, self._gpus, self._prefix = list(loads), gpus, prefix
        self._drawing += 1
        drawing = self._drawing
        # the batch sweep the speed and $ charts share, estimated once
        sweep = [costs.estimate(config, profile, e.precision, e.kv_dtype, e.context, int(b), None, e.model, count)
                 for b in BATCHES]
        args = (e, config, profile, runs, kv_dtype, count, sweep)
        in_turns([lambda draw=draw: draw(*args) for draw in (self._draw_memory, self._draw_speed, self._draw_money,
                                                             self._draw_kv)],
                 self.drawn.emit, wanted=lambda: drawing == self._drawing, owner=self)

    def cancel(self) -> None:
        """Drop a draw in progress (its inputs changed): only the newest draw says ``drawn``."""
        self._drawing += 1


    def _draw_memory(self, e, config, profile, runs, kv_dtype, count, sweep) -> None:
        """The stacked memory bar against the device's memory."""
        divisor, unit = _unit(max(e.total_bytes, profile.memory_bytes))
        plot = self.memory_plot.plot
        for name in ("bars",):
            if name in self._curves:
                plot.removeItem(self._curves.pop(name))
        heights = [e.weights_bytes / divisor, e.kv_bytes_total / divisor, e.activation_bytes / divisor]
        bottoms = [0, heights[0], heights[0] + heights[1]]
        bars = pg.BarGraphItem(x=[0, 0, 0], height=heights, y0=bottoms, width=0.6,
                               brushes=[COLOURS["weights"], COLOURS["kv"], COLOURS["activations"]])
        plot.addItem(bars)
        self._curves["bars"] = bars
        self.memory_bars = heights
        device = self._curve("device-line", self.memory_plot, pen=_pen(COLOURS["device"], Qt.DashLine, 2))
        device.setData([-0.5, 0.5], [profile.memory_bytes / divisor] * 2)
        measured = [(r.weights_bytes + r.kv_cache_bytes) / divisor for r in runs]
        self._curve("memory-runs", self.memory_plot, pen=None, symbol="o", symbolSize=7,
                    symbolBrush=COLOURS["measured"]).setData([0.35] * len(measured), measured)
        self.memory_plot.set_label("left", f"memory ({unit})")
        self.memory_plot.item.setXRange(-0.6, 0.6, padding=0)
        self.memory_plot.item.setYRange(0, max(e.total_bytes, profile.memory_bytes) / divisor * 1.1, padding=0)

    def _draw_speed(self, e, config, profile, runs, kv_dtype, count, sweep) -> None:
        """tok/s against batch (log2 x, log10 y): the memory- and compute-bound lines, the ceiling,
        the measured runs."""
        lx = np.log2(np.array(BATCHES, dtype=float))
        memory_rate = np.array([s.memory_bound_tokens_per_s for s in sweep])
        compute_rate = np.array([s.compute_bound_tokens_per_s for s in sweep])
        ceiling = np.array([s.decode_tokens_per_s_ceiling for s in sweep])  # the lower of the two
        self._curve("memory-bound", self.speed_plot, pen=_pen(COLOURS["memory"], Qt.DashLine)).setData(lx, np.log10(memory_rate))
        self._curve("compute-bound", self.speed_plot, pen=_pen(COLOURS["compute"], Qt.DashLine)).setData(lx, np.log10(compute_rate))
        fits = np.array([s.fits for s in sweep], dtype=bool)  # the ceiling ends where the batch's memory does
        self._curve("ceiling", self.speed_plot, pen=_pen(COLOURS["ceiling"], width=2)).setData(
            lx[fits], np.log10(ceiling[fits]))
        self.speed_ceiling = ceiling
        runs_x = [math.log2(r.batch) for r in runs if r.decode_tokens_per_s]
        runs_y = [math.log10(r.decode_tokens_per_s * r.batch) for r in runs if r.decode_tokens_per_s]
        self._curve("speed-runs", self.speed_plot, pen=None, symbol="o", symbolSize=7,
                    symbolBrush=COLOURS["measured"]).setData(runs_x, runs_y)
        self.speed_plot.set_label("left", "tokens / s, all requests (log₁₀)")
        # the measured dots stay in view, however far below the ceiling they are
        _log_axes(self.speed_plot, lx, np.concatenate([np.log10(np.concatenate([ceiling, memory_rate, compute_rate])),
                                                       np.array(runs_y, dtype=float)]))
        self._label_runs(runs, profile, config, kv_dtype, count)  # after the axes: they size its labels
        low, high = float(lx.min()), float(lx.max())
        ridge = math.log2(e.ridge_batch) if e.ridge_batch else None
        split = high if ridge is None else min(max(ridge, low), high)
        self._regions[0].setRegion((low, split))  # memory-bound
        self._regions[1].setRegion((split, high))  # compute-bound
        self.ridge_log2 = ridge
        marker = self._curve("batch-marker", self.speed_plot, pen=None, symbol="t", symbolSize=10,
                             symbolBrush=COLOURS["ceiling"])
        marker.setData([math.log2(e.batch)], [math.log10(e.decode_tokens_per_s_ceiling)])
        self._draw_loads(e, config, profile)

    def _draw_loads(self, e, config, profile) -> None:
        """Load sweeps against servers of this model: all requests' tok/s at the concurrency reached,
        each labelled with its share of the ceiling of the plan's GPU count at that batch and context."""
        for item in getattr(self, "_load_labels", []):
            self.speed_plot.plot.removeItem(item)
        self._load_labels = []
        xs, ys, tops, self.load_shares = [], [], [], []
        for record in self._loads:
            rate = record.extra["aggregate_tokens_per_s"]
            try:
                ceiling = ceiling_for(config, profile, e.precision, e.kv_dtype, max(record.context, 1), record.batch,
                                      self._gpus)
            except EngineError:
                continue
            share = 100 * rate / ceiling
            xs.append(math.log2(record.batch))
            ys.append(math.log10(rate))
            tops.append(math.log10(ceiling))
            self.load_shares.append(share)
            gpus = f" of its {self._gpus}-GPU ceiling" if self._gpus > 1 else " of its ceiling"
            label = pg.TextItem(f"{share:.0f}%{gpus if len(self._load_labels) == 0 else ''}",
                                color=COLOURS["load"], anchor=(-0.08, 0.5))
            label.setPos(xs[-1], ys[-1])
            self.speed_plot.plot.addItem(label)
            self._load_labels.append(label)
        self._curve("load-runs", self.speed_plot, pen=None, symbol="d", symbolSize=9,
                    symbolBrush=COLOURS["load"]).setData(xs, ys)
        # each point's own ceiling (its GPUs, batch and context) as a bar above it: the share made visible
        self._curve("load-ceilings", self.speed_plot, pen=None, symbol="_", symbolSize=16,
                    symbolPen=pg.mkPen(COLOURS["load"], width=2)).setData(xs, tops)
        if ys:  # the points stay in view
            low, high = self.speed_plot.item.viewRange()[1]
            self.speed_plot.item.setYRange(min(low, min(ys) - 0.2), max(high, max(tops) + 0.2), padding=0)

    def _draw_money(self, e, config, profile, runs, kv_dtype, count, sweep) -> None:
        """$ per 1M tokens against batch (only for batches that fit, and hardware with a price)."""
        lx = np.log2(np.array(BATCHES, dtype=float))
        ceiling = np.array([s.decode_tokens_per_s_ceiling for s in sweep])
        fits = np.array([s.fits for s in sweep])
        gpus = self._gpus
        if gpus > 1:  # past one GPU: the plan's GPUs at every batch, as the numbers beside it price them
            ceiling, fits = _on_gpus(config, profile, e, gpus)
        title = f"on {gpus} GPUs, as planned" if gpus > 1 else None  # short: a narrow chart clips it
        if self._money_title != title:
            self._money_title = title
            self.money_plot.set_title(title)
        usd_curve = self._curve("usd", self.money_plot, pen=_pen(COLOURS["ceiling"], width=2))
        if profile.usd_per_hour and fits.any():
            usd = gpus * profile.usd_per_hour / (ceiling * 3600) * 1e6
            usd_curve.setData(lx[fits], np.log10(usd[fits]))
            _log_axes(self.money_plot, lx, np.log10(usd[fits]))
            self._money_note.setVisible(False)
        else:
            usd_curve.setData([], [])
            self._money_note.setText("No price for this hardware: set its $ / hour in Edit hardware…"
                                     if not profile.usd_per_hour else "Does not fit at any batch: no price.")
            self._money_note.setPos(float(lx.mean()), 0.5)
            _log_axes(self.money_plot, lx, np.array([0.0, 1.0]))
            self.money_plot.item.setYRange(0, 1, padding=0)
            self.money_plot.item.getAxis("left").setTicks([[]])
            self._money_note.setVisible(True)

    def _draw_kv(self, e, config, profile, runs, kv_dtype, count, sweep) -> None:
        """KV bytes of one sequence against context; with a batch, the whole batch's, and with a
        shared prefix, the batch's when the prefix is held once."""
        contexts = np.array(CONTEXTS, dtype=float)

        @functools.lru_cache(maxsize=None)
        def kv_of(tokens: int) -> int:
            return costs.estimate(config, profile, e.precision, e.kv_dtype, int(tokens), 1, None, e.model,
                                  count).kv_bytes_total

        kv = [kv_of(c) for c in CONTEXTS]
        batch, prefix = e.batch, self._prefix
        pairs = [costs.shared_prefix_kv(kv_of, int(c), batch, prefix) for c in CONTEXTS] if batch > 1 or prefix else []
        top = max([*kv, *(p[0] for p in pairs)])
        divisor, unit = _unit(top)
        self._curve("kv-line", self.kv_plot, pen=_pen(COLOURS["kv"], width=2)).setData(np.log2(contexts), np.array(kv) / divisor)
        batch_line = self._curve("kv-batch", self.kv_plot, pen=_pen(COLOURS["kv"], Qt.DashLine))
        shared_line = self._curve("kv-shared", self.kv_plot, pen=_pen(COLOURS["ceiling"], Qt.DotLine, width=2))
        if pairs:
            batch_line.setData(np.log2(contexts), np.array([p[0] for p in pairs]) / divisor)
            shared_line.setData(np.log2(contexts), np.array([p[1] for p in pairs]) / divisor) if prefix \
                else shared_line.setData([], [])
        else:
            batch_line.setData([], [])
            shared_line.setData([], [])
        self.kv_plot.set_legend(
            [("one sequence", COLOURS["kv"], "━━"),
             *([(f"batch of {batch}", COLOURS["kv"], "╍╍")] if pairs else []),
             *([(f"batch of {batch}, {prefix:,}-token prefix held once", COLOURS["ceiling"], "┅┅")]
               if pairs and prefix else []),
             ("measured runs", COLOURS["measured"], "●")])
        measured_kv = [(math.log2(max(r.context - 1, 1)), r.kv_cache_bytes / divisor) for r in runs if r.kv_cache_bytes]
        self._curve("kv-runs", self.kv_plot, pen=None, symbol="o", symbolSize=7, symbolBrush=COLOURS["measured"]).setData(
            [p[0] for p in measured_kv], [p[1] for p in measured_kv])
        self.kv_plot.set_label("left", f"KV cache per sequence ({unit})")
        self.kv_plot.item.setXRange(math.log2(CONTEXTS[0]), math.log2(CONTEXTS[-1]), padding=0.02)
        self.kv_plot.item.getAxis("bottom").setTicks([[(math.log2(c), token_count(c)) for c in CONTEXTS[::2]]])
        self.kv_plot.item.setYRange(0, top / divisor * 1.05, padding=0)

    def _label_runs(self, runs, profile, config, kv_dtype: str, count) -> None:
        """One label per batch size (runs at the same batch would print over each other): the
        median share of the ceiling, with the range and count where there are several."""
        for item in getattr(self, "_run_labels", []):
            self.speed_plot.plot.removeItem(item)
        self._run_labels = []
        by_batch: dict[int, list[tuple[float, float]]] = {}
        ceilings: dict[tuple, float] = {}  # one estimate per (precision, context, batch), however many runs share it
        for r in runs:
            if not r.decode_tokens_per_s:
                continue
            key = (r.precision if r.precision in ALL_PRECISIONS else "bf16", max(r.context, 1), r.batch)
            if key not in ceilings:
                ceilings[key] = costs.estimate(config, profile, key[0], kv_dtype, key[1], key[2],
                                               None, "", count).decode_tokens_per_s_ceiling
            rate = r.decode_tokens_per_s * r.batch
            by_batch.setdefault(r.batch, []).append((100 * rate / ceilings[key], rate))
        # labels alternate above and below their dots; one that would run into a label already
        # placed goes to the other side, shortened to its median if it must, and is left out (its
        # dot stays) where even that has no room (measured where they are drawn: in the scene)
        view = self.speed_plot.plot.getViewBox()
        plot = self.speed_plot.plot
        ordered = sorted(by_batch.items())
        xs = [math.log2(batch) for batch, _ in ordered]
        placed: list = []  # the labels' rectangles in the scene, a few pixels of margin round them

        def put(text: str, x: float, y: float, above: bool):
            label = pg.TextItem(text, color=COLOURS["measured"], anchor=(0, 1) if above else (0, 0))
            label.setPos(x, y)
            plot.addItem(label)
            return label, label.sceneBoundingRect().adjusted(-LABEL_GAP / 2, -1, LABEL_GAP / 2, 1)

        for i, (batch, shares) in enumerate(ordered):
            values = sorted(share for share, _ in shares)
            short = f"{float(np.median(values)):.0f}%" + (" of ceiling" if not self._run_labels else "")
            full = short + (f" ({values[0]:.0f}–{values[-1]:.0f}%, {len(values)} runs)" if len(values) > 1 else "")
            x, y = xs[i], math.log10(float(np.median([rate for _, rate in shares])))
            if i + 2 < len(xs):  # the whole label only where it ends before the next but one dot
                label, box = put(full, x, y, True)
                plot.removeItem(label)
                if box.right() > view.mapViewToScene(pg.Point(xs[i + 2], y)).x():
                    full = short
            for text, above in ((t, a) for t in dict.fromkeys((full, short)) for a in (i % 2 == 0, i % 2 == 1)):
                label, box = put(text, x, y, above)
                if not any(box.intersects(other) for other in placed):
                    placed.append(box)
                    self._run_labels.append(label)
                    break
                plot.removeItem(label)


LABEL_GAP = 6
"""Pixels kept between two labels side by side."""


def _on_gpus(config, profile, e, gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """The decode ceiling and whether it fits, at every batch of the chart, on ``gpus`` GPUs with
    tensor parallelism (engine/estimates/parallel.py)."""
    options = []
    for batch in BATCHES:
        plan = plan_tensor_parallel(config, profile, e.precision, e.kv_dtype, e.context, batch, model=e.model)
        options.append(next((o for o in plan.options if o.gpus == gpus), None))
    return (np.array([o.decode_tokens_per_s_ceiling if o else np.nan for o in options]),
            np.array([o is not None and o.fits for o in options]))


def _unit(largest: float) -> tuple[float, str]:
    return binary_unit(largest)


def _log_axes(panel: PlotPanel, xs: np.ndarray, ys: np.ndarray) -> None:
    finite = ys[np.isfinite(ys)]
    panel.item.setXRange(float(xs.min()), float(xs.max()), padding=0.02)
    if finite.size:
        panel.item.setYRange(float(finite.min()) - 0.2, float(finite.max()) + 0.2, padding=0)
    # every other power of two labelled (1, 4, 16 …: "512" and "1024" side by side collide), the rest as minor ticks
    major = [(float(x), str(int(round(2 ** x)))) for i, x in enumerate(xs) if i % 2 == 0]
    minor = [(float(x), "") for i, x in enumerate(xs) if i % 2 == 1]
    panel.item.getAxis("bottom").setTicks([major, minor])
    lo = float(finite.min()) - 0.2 if finite.size else 0.0
    hi = float(finite.max()) + 0.2 if finite.size else 1.0
    panel.item.getAxis("left").setTicks([_log_ticks(lo, hi)])


def _log_ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    """Ticks for a log10 axis from ``lo`` to ``hi``: each power of ten, and 2× and 5× when the
    range spans too few powers to show any (a narrow range must still have numbers)."""
    decades = range(math.floor(lo), math.ceil(hi) + 1)
    ticks = [(float(k), _pretty(10 ** k)) for k in decades if lo <= k <= hi]
    if len(ticks) < 3:
        ticks = [(math.log10(m * 10 ** k), _pretty(m * 10 ** k)) for k in decades for m in (1, 2, 5)
                 if lo <= math.log10(m * 10 ** k) <= hi]
    return ticks


def token_count(tokens: int) -> str:
    """A context length as people say it: 2048 → "2k", 131072 → "128k" (not "2.05k", "131k")."""
    if tokens >= 1 << 20 and tokens % (1 << 20) == 0:
        return f"{tokens >> 20}M"
    if tokens >= 1024 and tokens % 1024 == 0:
        return f"{tokens >> 10}k"
    return f"{tokens:,}"


def _pretty(value: float) -> str:
    for size, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"
