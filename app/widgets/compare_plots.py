"""The comparison's four plots, one curve per lane in the lane's colour: decode speed, step
latency, KV-cache bytes and process memory. Redrawn only when a lane's run changed."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from app.widgets.lane_widget import LaneWidget
from app.widgets.live_plots import ROLLING_WINDOW, PlotPanel
from engine.units import binary_unit


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
        self._drawn: tuple = ()  # (run, version) of each lane it shows
        self.redraws = 0

    def _curve(self, name: str, lane: LaneWidget):
        key = (name, lane.index)
        if key not in self._curves:
            panel = self.panels[name]
            panel.add_legend(f"lane {lane.index + 1}", lane.colour, "━━")
            self._curves[key] = panel.plot.plot([], [], pen=_pen_for(lane.colour))
        return self._curves[key]

    def refresh(self, lanes: list[LaneWidget]) -> bool:
        """Redraw when a lane's run changed (returns whether it did); the views start over only
        when a new comparison starts, so the axes grow in steps as the plots do in the main window."""
        state = tuple((id(lane.run), lane.run.version) for lane in lanes)
        if state == self._drawn:
            return False
        if [s[0] for s in state] != [s[0] for s in self._drawn]:
            for panel in self.panels.values():
                panel.reset_view()
        self._drawn = state
        self.redraws += 1
        top = {"speed": 0.0, "latency": 0.0, "kv": 0.0, "memory": 0.0}
        longest, longest_time = 0, 0.0
        kv_unit = binary_unit(max((float(np.nanmax(l.run.column("kv_bytes"))) for l in lanes if l.run.count),
                                  default=0.0))
        mem_unit = binary_unit(max((float(np.nanmax(l.run.column("rss"))) for l in lanes if l.run.has("rss")),
                                   default=0.0))
        for lane in lanes:
            buffer = lane.run
            x = buffer.index()
            n = buffer.count
            if n < 1:
                for name in self.panels:
                    self._curve(name, lane).setData([], [])
                continue
            rolling = buffer.rolling_tokens_per_s(ROLLING_WINDOW)[1:]
            latency = buffer.column("latency_s")[1:] * 1000
            kv = buffer.column("kv_bytes") / kv_unit[0]
            rss = buffer.column("rss") / mem_unit[0]
            elapsed = buffer.column("elapsed_s")
            self._curve("speed", lane).setData(x[1:], rolling, connect="finite")
            self._curve("latency", lane).setData(x[1:], latency, skipFiniteCheck=True)
            self._curve("kv", lane).setData(x, kv, skipFiniteCheck=True)
            self._curve("memory", lane).setData(elapsed, rss, connect="finite")
            if n > 1:
                top["speed"] = max(top["speed"], float(np.nanmax(rolling)))
                top["latency"] = max(top["latency"], float(np.nanmax(latency)))
            top["kv"] = max(top["kv"], float(np.nanmax(kv)))
            top["memory"] = max(top["memory"], float(np.nanmax(rss)) if buffer.has("rss") else 0.0)
            longest, longest_time = max(longest, n), max(longest_time, float(elapsed[-1]))
        self.kv.set_label("left", f"KV cache ({kv_unit[1]})")
        self.memory.set_label("left", f"memory ({mem_unit[1]})")
        for name in ("speed", "latency", "kv"):
            self.panels[name].fit(longest, top[name], kv_unit[1] if name == "kv" else "")
        self.memory.fit(longest_time, top["memory"], mem_unit[1])
        return True

    def point_counts(self, lane: LaneWidget) -> dict[str, int]:
        counts = {}
        for name in self.panels:
            xs, _ = self._curve(name, lane).getOriginalDataset()
            counts[name] = 0 if xs is None else len(xs)
        return counts


def _pen_for(colour: str):
    return pg.mkPen(colour, width=1)
