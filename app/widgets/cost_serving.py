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

KV_SHARE = 0.9
"""Of the memory the weights and activations leave, what the simulated KV cache may take (vLLM's
``--gpu-memory-utilization`` default)."""


class ServingSection:
    """Its inputs (rows for the explorer's form) and its result (a label under the figures)."""

    def __init__(self, background: Background, changed: Callable[[], None]) -> None:
        self.background = background
        self.prompt, self.answer = QSpinBox(), QSpinBox()
        for box, value, what in ((self.prompt, 1024, "prompt"), (self.answer, 256, "answer")):
            box.setObjectName(f"serve{what.capitalize()}")
            box.setRange(1, 1_000_000)
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
        for box in (self.prompt, self.answer, self.target):
            box.valueChanged.connect(changed)
        self.label = QLabel()
        self.label.setObjectName("costServing")
        self.label.setWordWrap(True)
        self.label.setTextFormat(Qt.RichText)
        self.label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.label.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        self._key = None

    def add_rows(self, form) -> None:
        row = QHBoxLayout()
        row.addWidget(self.prompt)
        row.addWidget(self.answer)
        form.addRow("Serving", row)
        form.addRow("", self.target)

    def stale(self) -> None:
        """The explorer shows no figures for its current choice (yet): nor does this section."""
        self._key = None
        self.label.setText("")

    def update(self, estimate, profile, gpus: int, prefix: int) -> None:
        """Simulate ``estimate``'s model on ``profile`` (``gpus`` of it) at its batch, unless the
        same was simulated last."""
        e = estimate
        prompt, answer, target = self.prompt.value(), self.answer.value(), self.target.value()
        key = (e.model, e.precision, e.kv_dtype, e.batch, profile.id, gpus, prompt, answer, prefix, target)
        if key == self._key:
            return
        self._key = key
        memory = (e.device_memory_bytes * gpus - e.weights_bytes - e.activation_bytes) * KV_SHARE
        per_token = e.kv_bytes_per_token or 0
        if memory <= 0 or not per_token:
            self.label.setText("<b>Serving</b>: the weights leave no room for a KV cache here.")
            return
        self.label.setText("<b>Serving</b>: <i>simulating…</i>")
        limits = EngineLimits(max_batch=e.batch, token_budget=8192, prefill_chunk=8192,
                              kv_blocks=int(memory // (16 * per_token)), prefix_caching=prefix > 0)
        try:
            cost = for_gpu(profile, e.weights_read_bytes, e.parameters, per_token, gpus)
        except EngineError as exc:
            self.label.setText(f"<b>Serving</b>: {html.escape(str(exc))}")
            return
        shared = min(prefix, prompt - 1)
        self.background.submit(lambda: serving_curve(cost, limits, prompt, answer, shared),
                               lambda curve: self._show(key, cost, curve, e.batch), lambda exc: self._failed(key, exc))

    def _failed(self, key, exc: BaseException) -> None:
        if key == self._key:
            self.label.setText(f"<b>Serving</b>: <span style='color:#c0392b'>{html.escape(str(exc))}</span>")

    def _show(self, key, cost, curve, batch: int) -> None:
        if key != self._key:  # a later setting's simulation is on its way
            return
        target = key[-1]
        best = most_users(curve, target)
        rows = "".join(f"<tr><td>{p.users}</td><td>{ms(p.summary.ttft, 'median')}</td>"
                       f"<td>{ms(p.summary.ttft, 'p90')}</td><td>{ms(p.summary.tpot, 'median')}</td>"
                       f"<td>{p.summary.output_throughput:,.0f}</td><td>{p.preemptions}</td></tr>" for p in curve)
        verdict = (f"at most <b>{best}</b> {'user keeps' if best == 1 else 'users keep'} p90 TTFT ≤ {target:g} s"
                   if best is not None else f"not even one user gets p90 TTFT ≤ {target:g} s")
        self.label.setText(
            f"<b>Serving</b>, simulated: users each sending a {key[6]:,}-token prompt for a {key[7]:,}-token answer, "
            f"the next as soon as one ends, at most {batch} at once: {verdict}."
            "<table cellspacing=3><tr><th>users</th><th>TTFT p50</th><th>p90</th><th>TPOT p50</th><th>tok/s</th>"
            f"<th>preempted</th></tr>{rows}</table><small>The engine's scheduler on a simulated clock; "
            f"{html.escape(cost.source)}. What a server measures: the load generator (View → Traffic).</small>")
