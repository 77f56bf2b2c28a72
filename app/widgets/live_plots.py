"""Four live plots: tokens/sec, per-token latency, KV-cache bytes, memory.

They redraw from a :class:`Run` when a timer asks (about 20 times a second), never
per token, and cheaply, because on a 2-core machine every millisecond the GUI thread
spends is taken from the model's matrix multiplies:

- axis ranges grow in steps (x to the next multiple of a round number, y by half again)
  instead of auto-ranging every frame, so axes re-layout a few times per run, not per frame;
- labels change only when their unit does; no grid; the legend is part of the caption
  below the plot (a QLabel that doesn't repaint with the data), not an item in the scene;
- only the changed rectangle of the scene is repainted;
- downsampling and clip-to-view are set on each PlotItem (where pyqtgraph honours them),
  pens are 1 px and antialiasing is off.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QFont, QFontMetrics, QPalette
from PySide6.QtWidgets import QGraphicsView, QLabel, QVBoxLayout, QWidget

from app.glossary import linked, open_glossary
from engine.base.units import binary_unit, format_seconds
from engine.runs import Run

pg.setConfigOptions(antialias=False, background=None)

_COLOURS = {"main": "#2d7dd2", "second": "#f39c12", "third": "#27ae60", "fourth": "#8e44ad", "muted": "#7f8c8d"}
ROLLING_WINDOW = 16
SPIKE_FACTOR = 3.0
"""The latency view ends at this many times the 95th percentile (spikes above it are counted)."""
SPIKE_MIN_TOKENS = 20
MIN_PLOT_HEIGHT = 120
"""Below this a plot is hard to read: its caption gives up its sentence (to a tooltip) first."""
"""Below this many tokens the latency view holds every step."""


def _pen(colour: str, style=Qt.SolidLine):
    return pg.mkPen(_COLOURS[colour], width=1, style=style)


def _step_up(value: float) -> float:
    """The next 'round' limit at or above value: 1, 2, 5 × 10^k."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if value <= step * power:
            return step * power
    return 10 * power


_STYLE_GLYPH = {Qt.SolidLine: "━━", Qt.DashLine: "╍╍", Qt.DotLine: "┅┅"}


TICK_ROOM = 9
"""Pixels kept free above a plot, for its top tick label."""


class PlotPanel(QWidget):
    """A plot with a caption: a legend line, then one sentence saying what it shows."""

    def __init__(self, title: str, caption: str, left: str, bottom: str) -> None:
        super().__init__()
        self.plot = pg.PlotWidget(enableMenu=False)  # no context menu (set below anyway): ~15 ms less to make
        self.plot.setObjectName(title)
        # axes and text in the palette's text colour, so a dark desktop theme works too
        ink = self.palette().color(QPalette.WindowText)
        for axis in ("left", "bottom"):
            self.plot.getAxis(axis).setPen(ink)
            self.plot.getAxis(axis).setTextPen(ink)
        self.plot.getPlotItem().titleLabel.setAttr("color", ink.name())
        self.plot.setViewportUpdateMode(QGraphicsView.BoundingRectViewportUpdate)
        self.item = self.plot.getPlotItem()
        # room above the top tick's label: at the view's top edge pyqtgraph centres it there, half
        # outside the plot ("1.0" cut to its lower half); the sides keep pyqtgraph's 1 px (a wider
        # plot would not fit a narrow dock)
        self.item.layout.setContentsMargins(1, TICK_ROOM, 1, 1)
        self.item.setDownsampling(auto=True, mode="peak")
        self.item.setClipToView(True)
        self.item.setLabel("bottom", bottom)
        self.item.setMenuEnabled(False)
        self.item.disableAutoRange()
        self.item.setXRange(0, 1, padding=0)
        self.item.setYRange(0, 1, padding=0)
        self._labels: dict[str, str] = {}
        self._legend: list[str] = []
        self._sentence = caption
        self.set_label("left", left)
        self._x_limit = self._y_limit = self._shown_y = 0.0
        self._unit = ""
        self._unavailable: str | None = None
        self._note = None
        self._title: tuple[str, str] | None = None  # (text, size) asked for
        self._shown_title: str | None = None
        self.caption = QLabel(caption)
        self.caption.setWordWrap(True)
        self.caption.setTextFormat(Qt.RichText)
        self.caption.setObjectName("plotCaption")
        self.caption.setOpenExternalLinks(False)
        self.caption.linkActivated.connect(
            lambda link: open_glossary(link.removeprefix("glossary:"), self.window()))
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.caption)
        self.plot.installEventFilter(self)  # its title is cut again to each new width

    def set_title(self, title: str | None, size: str = "9pt") -> None:
        """The plot's title (``None``: none), cut to the plot's width with "…" and whole in the
        plot's tooltip. pyqtgraph lays a title out on one line and makes the plot at least as wide:
        a long one (the latency plot's "… steps above the view, longest …", a comparison's served
        lanes) had widened the plot past its dock, out of sight, the last tokens with it."""
        self._title = None if title is None else (title, size)
        self._show_title()

    def eventFilter(self, watched, event) -> bool:
        if watched is self.plot and self._title is not None:
            if event.type() == QEvent.Resize:
                self._show_title(event.size().width())  # before the view has its new size
            elif event.type() == QEvent.Show:
                self._show_title()
        return super().eventFilter(watched, event)

    @property
    def full_title(self) -> str | None:
        """The whole title asked for (what the plot shows may be cut short, with "…")."""
        return None if self._title is None else self._title[0]

    def _show_title(self, width: int | None = None) -> None:
        if self._title is None:
            if self._shown_title is not None:
                self._shown_title = None
                self.plot.setTitle(None)
            self.plot.setToolTip("")
            return
        title, size = self._title
        if width is None:  # not shown yet: no width to cut to (it is cut when shown)
            width = self.plot.viewport().width() if self.plot.isVisible() else 1 << 20
        font = QFont(self.font())
        font.setPointSizeF(float(size.removesuffix("pt")))
        axis = self.item.getAxis("left")  # the title sits over the plot area, right of this axis
        room = width - (axis.width() if axis.isVisible() else 0) - 12
        shown = QFontMetrics(font).elidedText(title, Qt.ElideRight, max(40, int(room)))
        if shown != self._shown_title:
            self._shown_title = shown
            self.plot.setTitle(shown, size=size)
            self.item.titleLabel.setMinimumWidth(0)  # never what widens the plot
        self.plot.setToolTip(title if shown != title else "")

    def set_unavailable(self, reason: str | None) -> None:
        """Grey the plot out with ``reason`` over it (a figure this run can't have: a server's KV
        bytes), or back to normal with ``None``. Greyed, not zeros: nothing is drawn as if measured."""
        if reason == self._unavailable:
            return
        self._unavailable = reason
        if self._note is None:
            self._note = pg.TextItem(anchor=(0.5, 0.5), color=_COLOURS["muted"])
            self._note.setZValue(10)
            self.plot.addItem(self._note, ignoreBounds=True)
        self._note.setText(reason or "")
        self._note.setVisible(reason is not None)
        self._note.setPos(0.5 * self._x_limit or 0.5, 0.5 * (self._shown_y or 1.0))
        # greyed: the palette's disabled window colour behind the plot, the reason over it
        grey = self.palette().color(QPalette.Disabled, QPalette.Midlight)
        self.plot.setBackground(grey if reason is not None else None)

    @property
    def unavailable(self) -> str | None:
        return self._unavailable

    def set_legend(self, entries: list[tuple[str, str, str]], sentence: str | None = None) -> None:
        """Replace the caption's legend (``(name, colour, glyph)`` each) and, if given, its sentence."""
        if sentence is not None:
            self._sentence = sentence
        self._legend = []
        for name, colour, glyph in entries:
            self.add_legend(name, colour, glyph)
        if not entries:
            self._show_caption()

    def curve(self, name: str, colour: str, style=Qt.SolidLine, **kwargs):
        self.add_legend(name, colour, _STYLE_GLYPH.get(style, "━━"))
        return self.plot.plot([], [], pen=_pen(colour, style), **kwargs)

    def add_legend(self, name: str, colour: str, glyph: str) -> None:
        """``colour``: one of ours by name, or any '#rrggbb'."""
        colour = colour if colour.startswith("#") else _COLOURS[colour]
        self._legend.append(f"<span style='color:{colour}'>{glyph}</span>&nbsp;{name}")
        self._show_caption()

    def remove_legend(self, name: str) -> None:
        """Drop ``name``'s legend entry (its curve left the plot)."""
        self._legend = [entry for entry in self._legend if not entry.endswith(f"&nbsp;{name}")]
        self._show_caption()

    def _show_caption(self) -> None:
        """The legend and the sentence; where the panel is too short for both beside a readable
        plot (a laptop screen), the legend alone, the sentence in its tooltip (and a note saying so)."""
        legend = " &nbsp; ".join(self._legend)
        sentence = linked(self._sentence)  # its terms open the glossary (Help → Glossary)
        full = f"{legend}<br>{sentence}" if legend else sentence
        self.caption.setText(full)
        self.caption.setToolTip("")
        height = self.height()
        if height <= 0 or not self.isVisible():
            return
        need = self.caption.heightForWidth(max(1, self.caption.width()))
        if height - need < MIN_PLOT_HEIGHT + 12 and legend:
            self.caption.setText(f"{legend} &nbsp; <span style='color:{_COLOURS['muted']}'>(hover: what it shows)</span>")
            self.caption.setToolTip(self._sentence)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if event.oldSize().height() != event.size().height() or event.oldSize().width() != event.size().width():
            self._show_caption()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self._show_caption()

    def set_label(self, axis: str, text: str) -> None:
        if self._labels.get(axis) != text:  # a label change re-lays-out the whole plot
            self._labels[axis] = text
            self.item.setLabel(axis, text)

    def fit(self, x_max: float, y_max: float, unit: str = "", x_min: float = 0.0, shrink: bool = False) -> None:
        """Grow the view to hold x_max and y_max, in round steps; never shrink within a run
        (unless the unit of y changed, or ``shrink``: y follows ``y_max`` down too)."""
        if unit != self._unit or shrink:
            self._unit = unit
            self._y_limit = 0.0
        x_limit = _step_up(max(x_max, 8.0))
        y_limit = _step_up(y_max * 1.1) if y_max > 0 else 1.0
        if x_limit != self._x_limit:
            self._x_limit = x_limit
            self.item.setXRange(x_min, x_limit, padding=0)
        if y_limit > self._y_limit:
            changed = y_limit != self._shown_y
            self._y_limit = self._shown_y = y_limit
            if changed:
                self.item.setYRange(0, y_limit, padding=0)

    def reset_view(self) -> None:
        self._x_limit = self._y_limit = 0.0
        self._unit = ""


def _short_seconds(s: float) -> str:
    """A time for a plot's title, short enough for a narrow plot: "184 ms", "1.56 s"."""
    return f"{s * 1000:.0f} ms" if s < 1 else format_seconds(s)


def _robust_top(values: np.ndarray, n: int) -> tuple[float, int]:
    """The top of a view of ``values`` (one per decode step of ``n`` tokens) and how many lie above
    it: the largest, or past :data:`SPIKE_MIN_TOKENS` at most :data:`SPIKE_FACTOR` × the 95th
    percentile, so a few outliers (a busy moment; a served answer's chunk of tokens arriving at
    once, thousands of tok/s) don't flatten the rest."""
    finite = values[np.isfinite(values)]
    if n <= 1 or not finite.size:
        return 0.0, 0
    top = float(finite.max())
    if n <= SPIKE_MIN_TOKENS:
        return top, 0
    cap = SPIKE_FACTOR * float(np.percentile(finite, 95))
    return min(top, cap), int(np.sum(finite > cap))


class LivePlots:
    """Owns the four plot panels and redraws them from a Run."""

    def __init__(self) -> None:
        self.speed = PlotPanel(
            "speed", f"Speed of each token (1 ÷ its latency) and the mean of the last {ROLLING_WINDOW}. "
            "The first token waits for the whole prompt: its time is the TTFT.",
            "tokens / s", "token")
        self.latency = PlotPanel(
            "latency", "Time each decode step took: one forward pass through the whole model per "
            "token. Spikes are the machine doing something else.", "latency (ms)", "token")
        self.kv = PlotPanel(
            "kv", "KV-cache bytes held after each token (dots): on a *-fast precision the whole "
            "16-token blocks of the pool this request holds (a sliding-window layer's only while in its "
            "window), on the others its cache tensors' bytes, read from the tensors; and predicted from "
            "the config: 2 × layers × KV heads × head dim × bytes, a window's tokens at most (line), the bytes "
            "those of the KV-cache dtype the model runs (the Model panel's KV cache box: int8 is 34 bytes a 32 "
            "values). Shaded: the prompt's part found in the prefix cache (earlier turns), not "
            "computed: read in place on *-fast, copied in on the others.",
            "KV cache", "token")
        self.memory = PlotPanel(
            "memory", "Memory while generating: the model's own (its weights, measured from its tensors, "
            "and its KV cache, measured from the cache) beside the process's RSS (Python, Qt, PyTorch and "
            "every model loaded; and device memory on a GPU). A decode step's activations are read from "
            "PyTorch's allocator once per model, by a throwaway sequence before the first answer (on a CPU "
            "the reading slows the step it reads: no answer's step is read).", "memory", "time since request (s)")
        self.panels = {"speed": self.speed, "latency": self.latency, "kv": self.kv, "memory": self.memory}
        self._speed_now = self.speed.curve("each token", "muted")
        self._speed_mean = self.speed.curve(f"mean of last {ROLLING_WINDOW}", "main")
        self._latency = self.latency.curve("latency", "main")
        self._kv_predicted = self.kv.curve("predicted", "second", Qt.DashLine)
        # measured: dots over the predicted line (at most ~48 of them, so drawing stays cheap)
        self._kv_measured = self.kv.plot.plot([], [], pen=None, symbol="o", symbolSize=5,
                                              symbolBrush=_COLOURS["main"], symbolPen=None)
        self.kv.add_legend("measured", "main", "●")
        self._kv_cached = self.kv.plot.plot([], [], pen=None, fillLevel=0, brush=pg.mkBrush(39, 174, 96, 70))
        self.kv.add_legend("from the prefix cache", "third", "██")
        self._rss = self.memory.curve("process RSS", "main")
        self._model = self.memory.curve("the model's: weights + KV + activations", "fourth", Qt.DashDotLine)
        # a served model's run: what the server's /metrics said, where the local figures go
        self._server_kv = self.kv.plot.plot([], [], pen=_pen("third"), stepMode=None)
        self._server_running = self.memory.plot.plot([], [], pen=_pen("main"))
        self._server_waiting = self.memory.plot.plot([], [], pen=_pen("second"))
        self._modes: dict = {}  # panel -> its local legend and sentence, while it shows a server's
        self._served = False
        # device curves join the plot (and its legend) only once a GPU reports them
        self._device_specs = {
            "device_allocated": ("device allocated", "third", Qt.SolidLine),
            "device_reserved": ("device reserved", "fourth", Qt.SolidLine),
            "device_peak": ("device peak", "second", Qt.DotLine),
        }
        self._device: dict[str, object] = {}
        self._weights = pg.InfiniteLine(angle=0, pen=_pen("muted", Qt.DashLine))
        self._weights.setVisible(False)
        self.memory.plot.addItem(self._weights)
        self.memory.add_legend("weights", "muted", "╍╍")
        # the memory-bandwidth ceiling of one request, once measured (Help → Tour, step 5)
        self.ceiling: float | None = None
        self._ceiling = pg.InfiniteLine(angle=0, pen=_pen("third", Qt.DashLine),
                                        label="bandwidth ceiling {value:,.0f} tok/s",
                                        labelOpts={"position": 0.5, "color": _COLOURS["third"], "anchors": [(0.5, 1), (0.5, 1)]})
        self._ceiling.setVisible(False)
        self.speed.plot.addItem(self._ceiling)
        self._drawn: dict[str, tuple] = {}  # plot name -> (run, version) it shows
        self._titles: dict[PlotPanel, str | None] = {}
        self.redraws = 0

    def set_ceiling(self, tokens_per_s: float | None) -> None:
        """Draw the memory-bandwidth ceiling across the speed plot (bandwidth ÷ bytes read per
        token: one request can't decode faster); ``None`` takes it away (another model loaded)."""
        self.ceiling = tokens_per_s if tokens_per_s and math.isfinite(tokens_per_s) else None
        self._ceiling.setVisible(self.ceiling is not None)
        if self.ceiling is not None:
            self._ceiling.setValue(self.ceiling)
            self.speed.fit(max(self.speed._x_limit, 1.0), self.ceiling)

    def refresh(self, buffer: Run, only: str | None = None) -> bool:
        """Redraw from the buffer: every plot, or ``only`` one of them (the window cycles through
        them while generating, so one tick pays for one plot). Returns whether anything changed."""
        names = [only] if only else list(self.panels)
        state = (id(buffer), buffer.version)
        if all(self._drawn.get(name) == state for name in names):
            return False
        if buffer.count == 0:
            for panel in self.panels.values():
                panel.reset_view()
        self._set_mode(buffer.served)
        for name in names:
            if self._drawn.get(name) != state:
                self._drawn[name] = state
                getattr(self, f"_draw_{name}")(buffer)
        self.redraws += 1
        return True

    def _draw_speed(self, buffer: Run) -> None:
        """Speed per decode step; the first token's "speed" is 1/TTFT, shown in the title instead."""
        x, n = buffer.index(), buffer.count
        speed_now = buffer.tokens_per_s()[1:]
        self._speed_now.setData(x[1:], speed_now, connect="finite")
        self._speed_mean.setData(x[1:], buffer.rolling_tokens_per_s(ROLLING_WINDOW)[1:], connect="finite")
        top, above = _robust_top(speed_now, n)
        note = (f" · {above} step{'s' if above > 1 else ''} above the view, fastest "
                f"{float(np.nanmax(speed_now)):,.0f} tok/s" if above else "")
        self._set_title(self.speed, buffer, note)
        self.speed.fit(n, max(top, self.ceiling or 0.0))

    def _draw_latency(self, buffer: Run) -> None:
        """Latency of each decode step; the first token's (the TTFT) is in the title. A few spikes
        (the machine busy elsewhere for a moment) don't flatten the rest: the view stops at
        :data:`SPIKE_FACTOR` × the 95th percentile and the title says what lies above."""
        x, n = buffer.index(), buffer.count
        latency_ms = buffer.column("latency_s")[1:] * 1000
        self._latency.setData(x[1:], latency_ms, skipFiniteCheck=True)
        top, above = _robust_top(latency_ms, n)
        note = (f" · {above} step{'s' if above > 1 else ''} above the view, longest "
                f"{format_seconds(float(np.nanmax(latency_ms)) / 1000)}" if above else "")
        self._set_title(self.latency, buffer, note)
        self.latency.fit(n, top, shrink=True)

    def _set_title(self, panel: PlotPanel, buffer: Run, note: str = "") -> None:
        title = f"time to first token: {_short_seconds(float(buffer.column('latency_s')[0]))}{note}" \
            if buffer.count else None
        if self._titles.get(panel) != title:  # a title change re-lays-out the plot
            self._titles[panel] = title
            panel.set_title(title)

    def _set_mode(self, served: bool) -> None:
        """Local figures, or a server's: the KV and memory plots change what they hold and say."""
        if served == self._served:
            return
        self._served = served
        for item in (self._kv_measured, self._kv_predicted, self._rss, *self._device.values()):
            item.setVisible(not served)
        self._weights.setVisible(False)
        for item in (self._server_kv, self._server_running, self._server_waiting):
            item.setData([], [])
            item.setVisible(served)
        if served:
            self._modes = {panel: (list(panel._legend), panel._sentence) for panel in (self.kv, self.memory)}
            self.kv.set_legend([("server's KV cache in use", "third", "━━")],
                               "A served model's KV cache is the server's: its share in use, all its requests "
                               "together, as its /metrics said while this answer streamed.")
            self.memory.set_legend([("running", "main", "━━"), ("waiting", "second", "━━")],
                                   "A served model's memory is the server's: its requests running and waiting, "
                                   "as its /metrics said while this answer streamed.")
        else:
            if self._titles.get(self.memory) is not None:  # the server's slots, said over its requests only
                self._titles[self.memory] = None
                self.memory.set_title(None)
            for panel in (self.kv, self.memory):
                legend, sentence = self._modes[panel]
                panel._legend = list(legend)
                panel._sentence = sentence
                panel._show_caption()
                panel.set_unavailable(None)

    def _draw_server_kv(self, buffer: Run) -> None:
        """The server's KV in use (%) at each token, from its samples (each at the token then arriving)."""
        samples = [s for s in buffer.server_samples if s.kv_usage is not None]
        if not samples:
            why = ("its /metrics has no KV-cache figure" if buffer.server_samples
                   else "it shows no /metrics with vLLM, SGLang or llama.cpp names")
            self.kv.set_unavailable(f"The server doesn't say its KV cache:\n{why}" if buffer.count else None)
            self._server_kv.setData([], [])
            return
        self.kv.set_unavailable(None)
        self.kv.set_label("left", "server KV in use (%)")
        elapsed = buffer.column("elapsed_s")
        x = np.searchsorted(elapsed, [s.at_s for s in samples]).astype(float)
        y = np.array([100 * s.kv_usage for s in samples])
        self._server_kv.setData(x, y)
        self.kv.fit(buffer.count, float(y.max()), "%")

    def _draw_server_memory(self, buffer: Run) -> None:
        samples = [s for s in buffer.server_samples if s.running is not None]
        if not samples:
            self.memory.set_unavailable("Memory is the server's: not visible from here" if buffer.count else None)
            self._server_running.setData([], [])
            self._server_waiting.setData([], [])
            return
        self.memory.set_unavailable(None)
        self.memory.set_label("left", "server requests")
        at = np.array([s.at_s for s in samples])
        running = np.array([s.running for s in samples], dtype=float)
        waiting = np.array([np.nan if s.waiting is None else s.waiting for s in samples], dtype=float)
        self._server_running.setData(at, running, connect="finite")
        self._server_waiting.setData(at, waiting, connect="finite")
        top = float(np.nanmax(np.concatenate([running, waiting])))
        slots = next((s for s in reversed(samples) if s.slots_total), None)
        title = None if slots is None else f"its slots: {slots.slots_busy} of {slots.slots_total} busy (/slots)"
        if self._titles.get(self.memory) != title:
            self._titles[self.memory] = title
            self.memory.set_title(title)
        elapsed = buffer.column("elapsed_s")
        self.memory.fit(max(float(at[-1]), float(elapsed[-1]) if buffer.count else 0.0), top, "requests")

    def _draw_kv(self, buffer: Run) -> None:
        """KV-cache bytes in binary units: the predicted line, and measured dots over it."""
        if buffer.served:
            return self._draw_server_kv(buffer)
        x, n = buffer.index(), buffer.count
        kv = buffer.column("kv_bytes")
        largest = float(np.nanmax(kv)) if n else 0.0
        divisor, unit = binary_unit(largest)
        self.kv.set_label("left", f"KV cache ({unit})")
        every = max(1, -(-n // 48))
        picked = np.arange(n - 1, -1, -every)[::-1]  # always include the newest token
        self._kv_measured.setData(x[picked], kv[picked] / divisor, skipFiniteCheck=True)
        self._kv_predicted.setData(x, buffer.column("kv_predicted") / divisor, connect="finite")
        p = buffer.prefilled
        if n and p is not None and p.cached_tokens and p.kv_cache_bytes:  # the prompt's KV is in proportion to its tokens
            level = p.kv_cache_bytes * p.cached_tokens / p.prompt_tokens / divisor
            self._kv_cached.setData([float(x[0]), float(x[-1])], [level, level])
        else:
            self._kv_cached.setData([], [])
        self.kv.fit(n, largest / divisor, unit)

    def _draw_memory(self, buffer: Run) -> None:
        """Memory over time: RSS, device memory where there is a GPU, the weights as a baseline."""
        if buffer.served:
            return self._draw_server_memory(buffer)
        n = buffer.count
        elapsed = buffer.column("elapsed_s")
        rss = buffer.column("rss")
        present = [k for k in self._device_specs if buffer.has(k)]
        largest = max([float(np.nanmax(rss)) if buffer.has("rss") else 0.0, float(buffer.weights_bytes or 0)]
                      + [float(np.nanmax(buffer.column(k))) for k in present])
        divisor, unit = binary_unit(largest)
        self.memory.set_label("left", f"memory ({unit})")
        self._rss.setData(elapsed, rss / divisor, connect="finite")
        if buffer.weights_bytes:
            known = buffer.prefilled.activation_bytes if buffer.prefilled is not None else None
            self._model.setData(elapsed, (buffer.weights_bytes + buffer.column("kv_bytes") + (known or 0)) / divisor,
                                connect="finite")
        for key in present:
            if key not in self._device:
                self._device[key] = self.memory.curve(*self._device_specs[key])
        for key, curve in self._device.items():
            curve.setData(elapsed, buffer.column(key) / divisor, connect="finite")
        if buffer.weights_bytes:
            self._weights.setValue(buffer.weights_bytes / divisor)
            self._weights.setVisible(True)
        self.memory.fit(float(elapsed[-1]) if n else 0.0, largest / divisor, unit)

    def point_counts(self) -> dict[str, int]:
        """Points each curve holds (tests check one per token)."""
        def count(curve) -> int:
            xs, _ = curve.getOriginalDataset()
            return 0 if xs is None else len(xs)

        return {"speed": count(self._speed_mean), "latency": count(self._latency),
                "kv_predicted": count(self._kv_predicted), "kv_measured_dots": count(self._kv_measured),
                "memory": count(self._rss)}
