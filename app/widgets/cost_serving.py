"""The Cost explorer's *Serving* section: latency against load for the model and hardware it shows,
simulated (engine/estimates/simulator.py) off the GUI thread, the most load a latency target
allows, and two charts: the latency curves, and the KV cache over time at the load where the
target gives way."""

from __future__ import annotations

import html
import math
import threading
from collections.abc import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QDoubleSpinBox, QHBoxLayout, QLabel, QPushButton, QSpinBox

from app.background import Background
from app.widgets.live_plots import PlotPanel
from engine.base.errors import EngineError
from engine.base.memory import DEFAULT_KV_BUDGET_CAP
from engine.estimates.simulator import RATE_SHARES, USERS, EngineLimits, capacity, most_load, serving_curve
from engine.estimates.step_cost import for_gpu, remember, remembered
from engine.base.units import format_seconds

MEMORY_SHARE = 0.9
"""Of the device's memory, what the server may take in all (vLLM's ``--gpu-memory-utilization``
default): the KV cache gets what the weights and activations leave of it."""
LONGEST = 131_072
"""The longest prompt or answer the section simulates (a token limit keeps each simulation short)."""
COLOURS = {"p50": "#2d7dd2", "p90": "#c0392b", "tpot": "#27ae60", "target": "#7f8c8d", "kv": "#f39c12",
           "running": "#2d7dd2", "preempted": "#c0392b"}


class ServingSection:
    """Its inputs (rows for the explorer's form) and its results (a label under the figures, two
    charts placed by ``place(panel, index)``). One simulation runs at a time; a choice made
    meanwhile is simulated after it, the ones between skipped, and a change of the latency target
    alone only reads the last curve again."""

    def __init__(self, background: Background, changed: Callable[[], None]) -> None:
        self.background = background
        self.changed = changed
        self.place: Callable[[PlotPanel, int], None] | None = None
        """Puts a chart in the explorer's grid (set by the explorer)."""
        self.request_for: Callable[[], tuple] = lambda: (None, "")
        """What this machine would load for the explorer's choice: (a ``LoadRequest`` or ``None``,
        why not) (set by the explorer)."""
        self.time_button = QPushButton("Time its steps here")
        self.time_button.setObjectName("serveTimeSteps")
        self.time_button.clicked.connect(self.time_steps)
        self._timing: str | None = None  # the key of the steps being timed
        self._timed: dict = {}  # key → the steps timed here for it (None: none yet)
        self._batch = 1  # the explorer's batch, which a timing of its steps runs up to
        self._note = ""  # why the last timing failed, under the figures until the choice changes
        self.prompt, self.answer = QSpinBox(), QSpinBox()
        for box, value, what in ((self.prompt, 1024, "prompt"), (self.answer, 256, "answer")):
            box.setObjectName(f"serve{what.capitalize()}")
            box.setRange(1, LONGEST)
            box.setValue(value)
            box.setSuffix(f" tokens ({what})")
            box.setToolTip(f"Each simulated request's {what} (the shared prefix above is the start of every prompt).")
        self.load = QComboBox()
        self.load.setObjectName("serveLoad")
        self.load.addItem("users, each waiting for its answer", "users")
        self.load.addItem("requests arriving a second", "rate")
        self.load.setToolTip("Users: each sends its next request when its answer ends (a chat app). Requests a "
                             "second: they arrive at random at that rate whatever the server's speed (an API), as "
                             "shares of what the server completes when never idle.")
        self.token_budget = QSpinBox()
        self.token_budget.setObjectName("serveTokenBudget")
        self.token_budget.setRange(16, 1 << 20)
        self.token_budget.setValue(8192)
        self.token_budget.setSuffix(" tokens a step")
        self.token_budget.setToolTip("The prompt and decode tokens one step may take (vLLM's "
                                     "--max-num-batched-tokens, SGLang's --chunked-prefill-size): a longer prompt "
                                     "is read in chunks between other requests' decode steps.")
        self.target = QDoubleSpinBox()
        self.target.setObjectName("serveTarget")
        self.target.setRange(0.01, 600)
        self.target.setDecimals(2)
        self.target.setValue(1.0)
        self.target.setSuffix(" s p90 TTFT")
        self.target.setToolTip("The load a plan serves is the most whose time to first token stays within this for "
                               "nine requests in ten.")
        for box in (self.prompt, self.answer, self.token_budget):
            box.valueChanged.connect(changed)
        self.load.currentIndexChanged.connect(changed)
        self.target.valueChanged.connect(lambda *_: self._show())
        self.label = QLabel()
        self.label.setObjectName("costServing")
        self.label.setWordWrap(True)
        self.label.setTextFormat(Qt.RichText)
        self.label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.label.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        self.latency_plot: PlotPanel | None = None
        self.usage_plot: PlotPanel | None = None
        self._wanted = None  # (key, work) of the choice shown
        self._running = None  # the key being simulated
        self._done: tuple | None = None  # (key, cost, curve, batch, kv blocks, capacity) of the last simulation
        self._closed = False
        self._idle = threading.Event()  # no simulation running on the background thread
        self._idle.set()

    def add_rows(self, form) -> None:
        for label, boxes in (("Serving", (self.prompt, self.answer)), ("Load", (self.load, self.token_budget))):
            row = QHBoxLayout()
            for box in boxes:
                row.addWidget(box)
            form.addRow(label, row)
        row = QHBoxLayout()
        row.addWidget(self.target, 1)
        row.addWidget(self.time_button)
        form.addRow("", row)

    def close(self) -> None:
        """The explorer closes: a simulation under way stops at its next step, and is waited for
        (no thread of it outlives the window's widgets), and nothing more starts."""
        self._closed = True
        self._wanted = None
        self._idle.wait(10.0)

    def stale(self) -> None:
        """The explorer shows no figures for its current choice (yet): nor does this section."""
        self._wanted = None
        if self._timing is None:
            self._note = ""
        self.label.setText("")
        for panel in (self.latency_plot, self.usage_plot):
            if panel is not None:
                panel.plot.clear()
                panel.set_title(None)  # the load it named is gone with it

    def update(self, estimate, profile, gpus: int, prefix: int) -> None:
        """Simulate ``estimate``'s model on ``profile`` (``gpus`` of it) at its batch."""
        e = estimate
        self._batch = e.batch
        prompt, answer, budget, mode = (self.prompt.value(), self.answer.value(), self.token_budget.value(),
                                        self.load.currentData())
        timed = self._timed_cost(profile)
        key = (e.model, e.precision, e.kv_dtype, e.batch, profile.id, gpus, prompt, answer, prefix, budget,
               timed.source if timed else "", mode)
        if prompt + answer > e.context:
            self._wanted = None
            self.label.setText(f"<b>Serving</b>: a {prompt:,}-token prompt and a {answer:,}-token answer don't fit "
                               f"the {e.context:,}-token Context above: a server started with it refuses them. "
                               "Raise the Context, or shorten them.")
            return
        memory = e.device_memory_bytes * gpus * MEMORY_SHARE - e.weights_bytes - e.activation_bytes
        per_token = e.kv_bytes_per_token or 0
        if memory <= 0 or not per_token:
            self._wanted = None
            self.label.setText("<b>Serving</b>: the weights leave no room for a KV cache here.")
            return
        if profile.kind == "cpu":  # a desktop's memory is shared: the KV pool `serve` takes here by default
            memory = min(memory, DEFAULT_KV_BUDGET_CAP)
        blocks = int(memory // (16 * per_token))
        limits = EngineLimits(max_batch=e.batch, token_budget=budget, prefill_chunk=budget, kv_blocks=blocks,
                              prefix_caching=prefix > 0)
        try:
            cost = timed or for_gpu(profile, e.weights_read_bytes, e.parameters, per_token, gpus)
        except EngineError as exc:
            self._wanted = None
            self.label.setText(f"<b>Serving</b>: {html.escape(str(exc))}")
            return
        shared = min(prefix, prompt - 1)
        cancelled = lambda: self._closed  # noqa: E731

        def work():
            if mode == "rate":
                most = capacity(cost, limits, prompt, answer, shared, cancelled)
                loads = [share * most for share in RATE_SHARES] if most > 0 else []
            else:
                most, loads = 0.0, [n for n in USERS if n <= max(4 * e.batch, 4)]
            curve = serving_curve(cost, limits, prompt, answer, shared, loads, cancelled=cancelled,
                                  rate=mode == "rate")
            return cost, curve, e.batch, blocks, most
        self._wanted = (key, work)
        if self._done is not None and self._done[0] == key:
            self._show()
        elif self._running is None:
            self._start()
        else:
            self.label.setText("<b>Serving</b>: <i>simulating…</i>")

    def _timing_key(self) -> tuple[str | None, object, str]:
        """The key this machine's timing of the explorer's choice is kept under, its load request,
        and why there is none."""
        request, why = self.request_for()
        if request is None:
            return None, None, why
        return f"cost explorer|{request.model}|{request.precision}|{request.kv_dtype}", request, ""

    def _timed_cost(self, profile):
        """The explorer's choice as its steps were timed on this machine (``None``: not timed yet,
        or another machine shown)."""
        key, _, why = self._timing_key() if profile.kind == "cpu" else (None, None, "")
        if key is not None and key not in self._timed:  # read from disk once; this section writes it after
            self._timed[key] = remembered(key)
        cost = self._timed.get(key) if key else None
        self.time_button.setEnabled(key is not None and self._timing is None)
        self.time_button.setText("Time its steps again" if cost is not None else "Time its steps here")
        if profile.kind != "cpu":
            why = "Steps are timed on this machine: choose it under Hardware."
        self.time_button.setToolTip(why or "Load this model here and time its engine's steps (about half a minute, "
                                           "kept for the next time): the simulation then runs on them, not on this "
                                           "machine's bandwidth and FLOP/s.")
        return cost

    def time_steps(self) -> None:
        """Load the explorer's choice here and time its steps (off the GUI thread); the simulation
        then uses them."""
        key, request, why = self._timing_key()
        if key is None or self._timing is not None:
            return
        self._timing, self._note = key, f"<br><i>Timing {html.escape(request.model)}'s steps here (loading it, " \
                                        "then about half a minute)…</i>"
        self.time_button.setEnabled(False)
        self._show()
        batch, budget = max(1, self._batch), self.token_budget.value()

        def work():
            from engine.estimates.step_cost import calibrate  # lazy: the engine (torch)
            from engine.generation.core import CoreSettings  # lazy: the engine (torch)
            from engine.models.loading import load_model  # lazy: the engine (torch)

            loaded = load_model(request)
            try:
                if loaded.fast is not None:
                    from engine.generation.compiled_step import compile_decoder  # lazy: torch's compiler

                    compile_decoder(loaded.fast)  # a server runs its compiled steps
                cost = calibrate(loaded, CoreSettings(max_batch=batch, token_budget=budget, prefill_chunk=budget),
                                 30.0)
            finally:
                loaded.close()
            remember(key, cost)
            return cost

        def ended(cost=None, error: BaseException | None = None) -> None:
            self._timing, self._note = None, ""
            if self._closed:
                return
            if error is None:
                self._timed[key] = cost
                self.changed()  # simulated again, on the timed steps
                return
            self.time_button.setEnabled(True)
            self._note = (f"<br><span style='color:#c0392b'>Its steps couldn't be timed here: "
                          f"{html.escape(str(error))}</span>")
            self._show()  # the simulation shown stays, with why it wasn't run on timed steps
        self.background.submit(work, ended, lambda exc: ended(error=exc))

    def _start(self) -> None:
        if self._closed or self._wanted is None:
            return
        key, work = self._wanted
        self._running = key
        self.label.setText("<b>Serving</b>: <i>simulating…</i>")
        idle = self._idle
        idle.clear()  # from now, not from when a pool thread takes it: a close meanwhile waits for it too

        def simulate():
            try:
                return work()
            finally:
                idle.set()
        self.background.submit(simulate, lambda result: self._finished(key, result),
                               lambda exc: self._failed(key, exc))

    def _finished(self, key, result) -> None:
        self._running = None
        self._done = (key, *result)
        if self._wanted is None:
            return
        if self._wanted[0] == key:
            self._show()
        else:  # the choice changed meanwhile: its own simulation now
            self._start()

    def _failed(self, key, exc: BaseException) -> None:
        self._running = None
        if self._wanted is not None and self._wanted[0] == key:
            self.label.setText(f"<b>Serving</b>: <span style='color:#c0392b'>{html.escape(str(exc))}</span>")
        elif self._wanted is not None:
            self._start()

    def _show(self) -> None:
        if self._wanted is None or self._done is None or self._done[0] != self._wanted[0] or self._closed:
            return
        key, cost, curve, batch, blocks, most = self._done
        rate = key[-1] == "rate"
        if not curve:
            self.label.setText("<b>Serving</b>: the server completes no request here.")
            return
        target = self.target.value()
        best = most_load(curve, target)
        unit = "requests/s" if rate else "users"
        rows = "".join(f"<tr><td>{_load(p.load, rate)}</td><td>{_seconds(p.summary.ttft, 'median')}</td>"
                       f"<td>{_seconds(p.summary.ttft, 'p90')}</td><td>{_seconds(p.summary.tpot, 'median')}</td>"
                       f"<td>{p.summary.output_throughput:,.0f}</td><td>{p.preemptions}</td></tr>" for p in curve)
        if best is None:
            verdict = f"not even {_amount(curve[0].load, rate)} gets p90 TTFT ≤ {target:g} s"
        elif best == curve[-1].load:
            verdict = (f"all the loads simulated, up to <b>{_load(best, rate)}</b> {unit}, keep p90 TTFT ≤ "
                       f"{target:g} s")
        else:
            beyond = next(p.load for p in curve if p.load > best)
            verdict = (f"<b>{_load(best, rate)}</b> {unit} keep p90 TTFT ≤ {target:g} s, {_load(beyond, rate)} "
                       "don't")
        if rate:
            load = (f"requests arriving at random at {', '.join(_load(p.load, rate) for p in curve)} a second "
                    f"({', '.join(f'{s:.0%}' for s in RATE_SHARES)} of the {most:.3g} a second it completes when "
                    "never idle)")
        else:
            load = (f"loads of {', '.join(str(int(p.load)) for p in curve)} users, each sending the next request "
                    "as soon as one ends")
        self.label.setText(
            f"<b>Serving</b>, simulated: {load}, each a {key[6]:,}-token prompt for a {key[7]:,}-token answer, at "
            f"most {batch} at once (the Batch above), {key[9]:,} tokens a step and a KV cache of "
            f"{blocks:,} blocks of 16 tokens: {verdict}."
            f"<table cellspacing=3><tr><th>{unit}</th><th>TTFT p50</th><th>p90</th><th>TPOT p50</th><th>tok/s</th>"
            f"<th>preempted</th></tr>{rows}</table><small>The engine's scheduler on a simulated clock; "
            f"{html.escape(cost.source)}. The copy buttons give this plan's commands (its batch and tokens a step). "
            "What a server measures: the load generator (View → Traffic).</small>" + self._note)
        self._draw(curve, target, best, rate, blocks, batch)

    def _draw(self, curve, target: float, best, rate: bool, blocks: int, batch: int) -> None:
        """The latency curves with the target across them; the KV cache over time at the first load
        past the target (the largest, when none is)."""
        if self.place is None:
            return
        if self.latency_plot is None:
            self.latency_plot = PlotPanel(
                "cost-serving-latency", "Simulated latency against load: time to first token (p50, p90) and time "
                "per output token (p50), log scale; the dashed line is the p90 TTFT target.", "seconds (log₁₀)",
                "load")
            for name, colour in (("TTFT p50", COLOURS["p50"]), ("TTFT p90", COLOURS["p90"]),
                                 ("TPOT p50", COLOURS["tpot"]), ("target", COLOURS["target"])):
                self.latency_plot.add_legend(name, colour, "╍╍" if name == "target" else "━━")
            self.usage_plot = PlotPanel(
                "cost-serving-usage", "Simulated KV cache over time at one load: blocks held (% of the pool) and "
                "requests running (% of the batch); red marks: preemptions (a request's blocks taken back, its "
                "prompt read again later).", "% of the pool / batch", "seconds")
            for name, colour in (("KV blocks", COLOURS["kv"]), ("running", COLOURS["running"]),
                                 ("preempted", COLOURS["preempted"])):
                self.usage_plot.add_legend(name, colour, "✕" if name == "preempted" else "━━")
            self.place(self.latency_plot, 4)
            self.place(self.usage_plot, 5)
        plot = self.latency_plot
        plot.plot.clear()
        xs = np.array([p.load for p in curve], dtype=float)
        lx = xs if rate else np.log2(xs)
        top = [np.nan]
        for key, colour, name in (("median", COLOURS["p50"], "ttft"), ("p90", COLOURS["p90"], "ttft"),
                                  ("median", COLOURS["tpot"], "tpot")):
            ys = np.array([math.log10(s[key]) if (s := getattr(p.summary, name)) and s[key] > 0 else np.nan
                           for p in curve])
            plot.plot.plot(lx, ys, pen=pg.mkPen(colour, width=2), symbol="o", symbolSize=5, symbolBrush=colour,
                           connect="finite")
            top.extend(ys)
        goal = math.log10(target)
        plot.plot.plot([lx[0], lx[-1]], [goal, goal], pen=pg.mkPen(COLOURS["target"], width=2, style=Qt.DashLine))
        finite = np.array([y for y in [*top, goal] if np.isfinite(y)])
        low, high = float(finite.min()) - 0.2, float(finite.max()) + 0.2
        plot.item.setXRange(float(lx[0]), float(lx[-1]), padding=0.03)
        plot.item.setYRange(low, high, padding=0)
        plot.item.getAxis("left").setTicks([_log_ticks(low, high)])
        # users: each load labelled on its log₂ axis; rates: pyqtgraph's own ticks (the rates crowd near 100%)
        plot.item.getAxis("bottom").setTicks(None if rate else [[(float(x), _load(v, rate)) for x, v in zip(lx, xs)]])
        plot.set_label("bottom", "requests arriving a second" if rate else "users (log₂)")
        if best is not None:
            x = float(best if rate else math.log2(best))
            plot.plot.addItem(pg.InfiniteLine(x, angle=90, pen=pg.mkPen(COLOURS["target"], style=Qt.DotLine)))
        shown = next((p for p in curve if best is None or p.load > best), curve[-1])
        usage = self.usage_plot
        usage.plot.clear()
        moments = shown.timeline
        if not moments:
            return
        ts = np.array([m.t for m in moments])
        usage.plot.plot(ts, [100 * m.kv_blocks / blocks for m in moments], pen=pg.mkPen(COLOURS["kv"], width=2))
        usage.plot.plot(ts, [100 * m.running / batch for m in moments], pen=pg.mkPen(COLOURS["running"]))
        marks = [m.t for a, m in zip(moments, moments[1:]) if m.preemptions > a.preemptions]
        usage.plot.plot(marks, [100.0] * len(marks), pen=None, symbol="x", symbolSize=9,
                        symbolBrush=COLOURS["preempted"], symbolPen=COLOURS["preempted"])
        usage.item.setXRange(0, float(ts[-1]) or 1.0, padding=0.02)
        usage.item.setYRange(0, 105, padding=0)
        usage.set_title(f"at {_amount(shown.load, rate)}: {shown.preemptions} preempted", "9pt")


def _load(value: float, rate: bool) -> str:
    return f"{value:.3g}" if rate else str(int(value))


def _amount(value: float, rate: bool) -> str:
    """A load with its unit: "1 user", "16 users", "2.5 requests/s"."""
    if rate:
        return f"{value:.3g} requests/s"
    return f"{int(value)} user{'s' if int(value) != 1 else ''}"


def _seconds(stats: dict | None, key: str) -> str:
    return format_seconds(stats[key]) if stats else "n/a"


def _log_ticks(low: float, high: float) -> list[tuple[float, str]]:
    """Seconds on a log₁₀ axis: each power of ten and its doubles and fives, thinned to at most seven."""
    ticks = []
    for k in range(math.floor(low), math.ceil(high) + 1):
        for m in (1, 2, 5):
            x = math.log10(m * 10 ** k)
            if low <= x <= high:
                seconds = m * 10 ** k
                ticks.append((x, f"{seconds * 1e3:g} ms" if seconds < 1 else f"{seconds:g} s"))
    return ticks[::max(1, math.ceil(len(ticks) / 7))]
