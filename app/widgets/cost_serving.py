"""The Cost explorer's *Serving* section: latency against load for the model and hardware it shows,
simulated (engine/estimates/simulator.py) off the GUI thread, and the most users a latency target
allows."""

from __future__ import annotations

import html
from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDoubleSpinBox, QHBoxLayout, QLabel, QSpinBox

from app.background import Background
from engine.base.errors import EngineError
from engine.estimates.simulator import EngineLimits, most_users, serving_curve
from engine.estimates.step_cost import for_gpu
from engine.load.report import ms

MEMORY_SHARE = 0.9
"""Of the device's memory, what the server may take in all (vLLM's ``--gpu-memory-utilization``
default): the KV cache gets what the weights and activations leave of it."""
LONGEST = 131_072
"""The longest prompt or answer the section simulates (a token limit keeps each simulation short)."""


class ServingSection:
    """Its inputs (rows for the explorer's form) and its result (a label under the figures). One
    simulation runs at a time; a choice made meanwhile is simulated after it, the ones between
    skipped, and a change of the latency target alone only reads the last curve again."""

    def __init__(self, background: Background, changed: Callable[[], None]) -> None:
        self.background = background
        self.prompt, self.answer = QSpinBox(), QSpinBox()
        for box, value, what in ((self.prompt, 1024, "prompt"), (self.answer, 256, "answer")):
            box.setObjectName(f"serve{what.capitalize()}")
            box.setRange(1, LONGEST)
            box.setValue(value)
            box.setSuffix(f" tokens ({what})")
            box.setToolTip(f"Each simulated user's {what} (the shared prefix above is the start of every prompt).")
        self.target = QDoubleSpinBox()
        self.target.setObjectName("serveTarget")
        self.target.setRange(0.01, 600)
        self.target.setDecimals(2)
        self.target.setValue(1.0)
        self.target.setSuffix(" s p90 TTFT")
        self.target.setToolTip("The users a plan serves are those whose time to first token stays within this for "
                               "nine requests in ten.")
        for box in (self.prompt, self.answer):
            box.valueChanged.connect(changed)
        self.target.valueChanged.connect(lambda *_: self._show())
        self.label = QLabel()
        self.label.setObjectName("costServing")
        self.label.setWordWrap(True)
        self.label.setTextFormat(Qt.RichText)
        self.label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.label.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        self._wanted = None  # (key, work) of the choice shown
        self._running = None  # the key being simulated
        self._done: tuple | None = None  # (key, cost, curve, batch) of the last simulation
        self._closed = False

    def add_rows(self, form) -> None:
        row = QHBoxLayout()
        row.addWidget(self.prompt)
        row.addWidget(self.answer)
        form.addRow("Serving", row)
        form.addRow("", self.target)

    def close(self) -> None:
        """The explorer closes: a simulation under way stops at its next step, nothing more starts."""
        self._closed = True
        self._wanted = None

    def stale(self) -> None:
        """The explorer shows no figures for its current choice (yet): nor does this section."""
        self._wanted = None
        self.label.setText("")

    def update(self, estimate, profile, gpus: int, prefix: int) -> None:
        """Simulate ``estimate``'s model on ``profile`` (``gpus`` of it) at its batch."""
        e = estimate
        prompt, answer = self.prompt.value(), self.answer.value()
        key = (e.model, e.precision, e.kv_dtype, e.batch, profile.id, gpus, prompt, answer, prefix)
        memory = e.device_memory_bytes * gpus * MEMORY_SHARE - e.weights_bytes - e.activation_bytes
        per_token = e.kv_bytes_per_token or 0
        if memory <= 0 or not per_token:
            self._wanted = None
            self.label.setText("<b>Serving</b>: the weights leave no room for a KV cache here.")
            return
        limits = EngineLimits(max_batch=e.batch, token_budget=8192, prefill_chunk=8192,
                              kv_blocks=int(memory // (16 * per_token)), prefix_caching=prefix > 0)
        try:
            cost = for_gpu(profile, e.weights_read_bytes, e.parameters, per_token, gpus)
        except EngineError as exc:
            self._wanted = None
            self.label.setText(f"<b>Serving</b>: {html.escape(str(exc))}")
            return
        shared = min(prefix, prompt - 1)
        users = tuple(n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= max(4 * e.batch, 4))

        def work():
            return cost, serving_curve(cost, limits, prompt, answer, shared, users,
                                       cancelled=lambda: self._closed), e.batch
        self._wanted = (key, work)
        if self._done is not None and self._done[0] == key:
            self._show()
        elif self._running is None:
            self._start()
        else:
            self.label.setText("<b>Serving</b>: <i>simulating…</i>")

    def _start(self) -> None:
        if self._closed or self._wanted is None:
            return
        key, work = self._wanted
        self._running = key
        self.label.setText("<b>Serving</b>: <i>simulating…</i>")
        self.background.submit(work, lambda result: self._finished(key, result), lambda exc: self._failed(key, exc))

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
        if self._wanted is None or self._done is None or self._done[0] != self._wanted[0]:
            return
        key, cost, curve, batch = self._done
        target = self.target.value()
        best = most_users(curve, target)
        loads = ", ".join(str(p.users) for p in curve)
        rows = "".join(f"<tr><td>{p.users}</td><td>{ms(p.summary.ttft, 'median')}</td>"
                       f"<td>{ms(p.summary.ttft, 'p90')}</td><td>{ms(p.summary.tpot, 'median')}</td>"
                       f"<td>{p.summary.output_throughput:,.0f}</td><td>{p.preemptions}</td></tr>" for p in curve)
        if best is None:
            verdict = f"not even one user gets p90 TTFT ≤ {target:g} s"
        elif best == curve[-1].users:
            verdict = f"all the loads simulated, up to <b>{best}</b> users, keep p90 TTFT ≤ {target:g} s"
        else:
            beyond = next(p.users for p in curve if p.users > best)
            verdict = f"<b>{best}</b> users keep p90 TTFT ≤ {target:g} s, {beyond} don't"
        self.label.setText(
            f"<b>Serving</b>, simulated: loads of {loads} users, each sending a {key[6]:,}-token prompt for a "
            f"{key[7]:,}-token answer and the next as soon as one ends, at most {batch} at once (the Batch "
            f"above): {verdict}."
            "<table cellspacing=3><tr><th>users</th><th>TTFT p50</th><th>p90</th><th>TPOT p50</th><th>tok/s</th>"
            f"<th>preempted</th></tr>{rows}</table><small>The engine's scheduler on a simulated clock; "
            f"{html.escape(cost.source)}. What a server measures: the load generator (View → Traffic).</small>")
