"""The comparison's four plots, one curve per lane in the lane's colour: decode speed, step
latency, KV-cache bytes and process memory. Redrawn only when a lane's run changed."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from app.widgets.lane_widget import LaneWidget
from app.widgets.live_plots import PlotPanel, ROLLING_WINDOW
from engine.base.units import binary_unit


class ComparePlots:
    """The four plots with one curve per lane, in the lane's colour."""

    def __init__(self) -> None:
        self.speed = PlotPanel("compare-speed", f"Decode speed of each lane (mean of the last {ROLLING_WINDOW} tokens).",
                               "tokens / s", "token")
        self.latency = PlotPanel("compare-latency", "Time of each decode step, per lane.", "latency (ms)", "token")
        self.kv = PlotPanel("compare-kv", "KV-cache bytes held after each token, per lane (measured).",
                            "KV cache", "token")
        self.memory = PlotPanel("compare-memory", "Process RSS while each lane generated (in concurrent mode "
                                "they share one process).", "memory", "time since request (s)")
        self.panels = {"speed": self.speed, "latency": self.latency, "kv": self.kv, "memory": self.memory}
        self._curves: dict[tuple[str, int], object] = {}
        self._drawn: tuple = ()  # (run, version) of each lane at the last redraw
        self._runs: list = []  # the lanes' runs the views were started for
        self._drawn_panels: dict[str, tuple] = {}  # plot -> the lanes' (run, version) it shows
        self._notes: dict[str, str | None] = {}  # plot -> its title naming the served lanes
        self.redraws = 0

    def _curve(self, name: str, lane: LaneWidget):
        key = (name, lane.index)
        if key not in self._curves:
            panel = self.panels[name]
            panel.add_legend(f"lane {lane.index + 1}", lane.colour, "━━")
            self._curves[key] = panel.plot.plot([], [], pen=_pen_for(lane.colour))
        return self._curves[key]

    def refresh(self, lanes: list[LaneWidget], only: str | None = None) -> bool:
        """Redraw the plots (or ``only`` one: while lanes generate, the window draws one plot a tick)
        whose lanes' runs changed; returns whether any did. The views start over only when a new
        comparison starts, so the axes grow in steps as the plots do in the main window."""
        state = tuple((id(lane.run), lane.run.version) for lane in lanes)
        for name, index in [key for key in self._curves if key[1] >= len(lanes)]:  # a lane removed: its curves go
            panel = self.panels[name]
            panel.plot.removeItem(self._curves.pop((name, index)))
            panel.remove_legend(f"lane {index + 1}")
        runs = [s[0] for s in state]
        if runs != self._runs:
            self._runs = runs
            self._drawn_panels = {}
            for panel in self.panels.values():
                panel.reset_view()
        names = [name for name in ([only] if only else self.panels) if self._drawn_panels.get(name) != state]
        if not names:
            return False
        self._drawn = state
        self.redraws += 1
        for name in names:
            self._drawn_panels[name] = state
            getattr(self, f"_draw_{name}")(lanes)
        return True

    def _draw_series(self, name: str, lanes, series) -> tuple[float, float]:
        """``series(run) -> (x, y)`` of each lane into plot ``name``; returns (largest x, largest y)."""
        top_x = top_y = 0.0
        for lane in lanes:
            run = lane.run
            if run.count < 1:
                self._curve(name, lane).setData([], [])
                continue
            x, y = series(run)
            self._curve(name, lane).setData(x, y, connect="finite")
            if len(x):
                top_x = max(top_x, float(x[-1]) + (1 if name != "memory" else 0))
            finite = y[np.isfinite(y)]
            if finite.size:
                top_y = max(top_y, float(finite.max()))
        return top_x, top_y

    def _draw_speed(self, lanes) -> None:
        x, y = self._draw_series("speed", lanes, lambda r: (r.index()[1:], r.rolling_tokens_per_s(ROLLING_WINDOW)[1:]))
        self.speed.fit(max(x, max(l.run.count for l in lanes)), y)

    def _draw_latency(self, lanes) -> None:
        x, y = self._draw_series("latency", lanes, lambda r: (r.index()[1:], r.column("latency_s")[1:] * 1000))
        self.latency.fit(max(l.run.count for l in lanes), y)

    def _served_note(self, panel, lanes) -> None:
        """A title naming the lanes whose figure is a server's (so their missing curve isn't read as zero)."""
        served = [str(lane.index + 1) for lane in lanes if lane.run.served]
        title = (f"lane{'s' if len(served) > 1 else ''} {', '.join(served)}: served, the server's own (not seen "
                 "from here)" if served else None)
        if self._notes.get(panel.plot.objectName()) != title:
            self._notes[panel.plot.objectName()] = title
            panel.set_title(title, size="8pt")

    def _draw_kv(self, lanes) -> None:
        self._served_note(self.kv, lanes)
        unit = binary_unit(max((float(np.nanmax(l.run.column("kv_bytes"))) for l in lanes if l.run.has("kv_bytes")),
                               default=0.0))
        _, y = self._draw_series("kv", lanes, lambda r: (r.index(), r.column("kv_bytes") / unit[0]))
        self.kv.set_label("left", f"KV cache ({unit[1]})")
        self.kv.fit(max(l.run.count for l in lanes), y, unit[1])

    def _draw_memory(self, lanes) -> None:
        self._served_note(self.memory, lanes)
        unit = binary_unit(max((float(np.nanmax(l.run.column("rss"))) for l in lanes if l.run.has("rss")), default=0.0))
        x, y = self._draw_series("memory", lanes, lambda r: (r.column("elapsed_s"), r.column("rss") / unit[0]))
        self.memory.set_label("left", f"memory ({unit[1]})")
        self.memory.fit(x, y, unit[1])

    def point_counts(self, lane: LaneWidget) -> dict[str, int]:
        counts = {}
        for name in self.panels:
            xs, _ = self._curve(name, lane).getOriginalDataset()
            counts[name] = 0 if xs is None else len(xs)
        return counts


def _pen_for(colour: str):
    return pg.mkPen(colour, width=1)
