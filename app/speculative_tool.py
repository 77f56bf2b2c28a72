"""View → Batching and speculative decoding, second tab: speculative decoding on the loaded model.

A draft (prompt lookup, which needs no model; the model's own first K layers; the model at
another precision; or another model with the same tokenizer) guesses N tokens; the target checks
them in one pass. The text shows each token as accepted, rejected (struck through) or the
target's own; the plots the share accepted and, with "decode plainly first", each step's
speed-up over a plain step beside the one predicted from the acceptance rate and what a guess
and a check cost (engine/measure/speculative_run.py).
"""

from __future__ import annotations

import html
from dataclasses import replace
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, Slot
from PySide6.QtGui import QColor, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QSpinBox,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.widgets.live_plots import PlotPanel
from app.widgets.session_tool import DEFAULT_PROMPT, REJECTED, SessionTool
from engine.base.events import DraftVerified, Finished, Loaded, Prefilled, TokenGenerated
from engine.base.units import format_bytes, format_rate, format_seconds
from engine.jobs import SpeculateJob
from engine.measure.speculative_run import emit_seconds, explain, step_cost_s, step_predictions

if TYPE_CHECKING:
    from engine.measure.speculative_run import SpeculativeReport

ACCEPTED = "#27ae60"
OWN = "#2d7dd2"


class SpeculativeTool(SessionTool):
    """The draft's controls, the marked-up text, the acceptance plot and the summary."""
    needs = ("Speculative decoding runs a draft beside a model loaded here; a model served elsewhere decodes "
             "on its server (measure it with View → Traffic's load generator).")

    def __init__(self, session, request_for) -> None:
        super().__init__(session, request_for)
        self._plain_tokens = 0
        self.result: SpeculativeReport | None = None
        c = self.controls
        self.draft_kind = QComboBox()
        self.draft_kind.setObjectName("draftKind")
        self.draft_kind.addItem("Prompt lookup (no model)", "ngram")
        self.draft_kind.addItem("Early exit: the model's own first K layers", "early-exit")
        self.draft_kind.addItem("The same model at another precision", "precision")
        self.draft_kind.addItem("Another model with the same tokenizer", "model")
        self.draft_kind.setItemData(0, "Guesses that the answer goes on as it did after the last N tokens' latest "
                                       "earlier occurrence in the prompt and answer: free, and right where an answer "
                                       "repeats its input (edits, quotes, extraction).", Qt.ToolTipRole)
        self.draft_layers = QSpinBox()
        self.draft_layers.setObjectName("draftLayers")
        self.draft_layers.setRange(1, 1)
        self.draft_ngram = QSpinBox()
        self.draft_ngram.setObjectName("draftNgram")
        self.draft_ngram.setRange(1, 8)
        self.draft_ngram.setValue(3)
        self.draft_ngram.setToolTip("Prompt lookup matches the last N tokens of the prompt and answer with an earlier "
                                    "place they occurred, and guesses the tokens that followed it there.")
        self.draft_precision = QComboBox()
        for name in ("bf16", "fp16", "int8", "nf4", "fp4", "fp32"):
            self.draft_precision.addItem(name, name)
        self.draft_model = QLineEdit()
        self.draft_model.setPlaceholderText("folder, .gguf file or hub id")
        self.draft_tokens = QSpinBox()
        self.draft_tokens.setObjectName("draftTokens")
        self.draft_tokens.setRange(1, 16)
        self.draft_tokens.setValue(4)
        self.compare_plain = QCheckBox("Also decode plainly first, to measure the speed-up")
        self.compare_plain.setChecked(True)
        self.spec_tokens = QSpinBox()
        self.spec_tokens.setRange(1, 4096)
        self.spec_tokens.setValue(64)
        self.spec_prompt = QLineEdit(DEFAULT_PROMPT)
        self.spec_prompt.setCursorPosition(0)
        c.form.addRow("Draft", self.draft_kind)
        c.form.addRow("N-gram tokens", self.draft_ngram)
        c.form.addRow("Layers K", self.draft_layers)
        c.form.addRow("Draft precision", self.draft_precision)
        c.form.addRow("Draft model", self.draft_model)
        c.form.addRow("Drafted per step N", self.draft_tokens)
        c.form.addRow(self.compare_plain)
        c.form.addRow("Max new tokens", self.spec_tokens)
        c.form.addRow("Prompt", self.spec_prompt)
        c.run.setText("Run")
        self.draft_kind.currentIndexChanged.connect(self.update_state)

        self.spec_output = QPlainTextEdit()
        self.spec_output.setObjectName("speculativeOutput")
        self.spec_output.setReadOnly(True)
        legend = QLabel(f"<span style='background:{ACCEPTED}33'>&nbsp;drafted, accepted&nbsp;</span> "
                        f"<span style='color:{REJECTED}'><s>&nbsp;drafted, rejected&nbsp;</s></span> "
                        f"<span style='color:{OWN}'>&nbsp;the target's own token&nbsp;</span>")
        self.acceptance_plot = PlotPanel(
            "spec-acceptance", "Share of drafted tokens the target accepted, per verification step (dots) and "
            "overall so far (line). Each step costs N draft passes plus one target pass over N+1 tokens.",
            "accepted (%)", "step")
        self.step_curve = self.acceptance_plot.curve("this step (dots)", "second", symbol="o", symbolSize=5,
                                                  symbolBrush="#f39c12")
        self.step_curve.setPen(None)
        self.running_curve = self.acceptance_plot.curve("so far", "main")
        self.speedup_plot = PlotPanel(
            "spec-speedup", "Each step's speed-up over a plain decode step (dots: its tokens over its time, its "
            "clock and its tokens' events, in plain steps) beside the one predicted (line) from the acceptance rate "
            "α so far, the guesses k and what a guess (c) and the check (v) cost: (1 − α^(k+1)) / ((1 − α)(k·c + v)). "
            "Above 1×, the step paid. Needs the plain run first.", "speed-up (×)", "step")
        self.measured_curve = self.speedup_plot.curve("this step (dots)", "second", symbol="o", symbolSize=5,
                                                      symbolBrush="#f39c12")
        self.measured_curve.setPen(None)
        self.predicted_curve = self.speedup_plot.curve("predicted", "main")
        self.even_curve = self.speedup_plot.curve("1× (plain)", "muted", Qt.DashLine)
        self._plain_step_s: float | None = None
        self._plain_clocks: list[float] = []
        self._speedup_drawn: tuple = (0, None)
        self.spec_summary = QLabel()
        self.spec_summary.setObjectName("speculativeSummary")
        self.spec_summary.setWordWrap(True)
        self.spec_summary.setTextFormat(Qt.RichText)
        self.spec_summary.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self._steps: list[DraftVerified] = []
        self._pending: list = []
        self._awaiting_rejects: tuple[str, ...] = ()

        text_side = QWidget()
        text_layout = QVBoxLayout(text_side)
        text_layout.setContentsMargins(0, 0, 0, 0)
        text_layout.addWidget(legend)
        text_layout.addWidget(self.spec_output, 1)
        text_layout.addWidget(self.spec_summary)
        plots = QSplitter(Qt.Vertical)
        plots.addWidget(self.acceptance_plot)
        plots.addWidget(self.speedup_plot)
        right = QSplitter(Qt.Horizontal)
        right.addWidget(text_side)
        right.addWidget(plots)
        right.setSizes([450, 450])  # the plots as wide as the text (scaled to the page)
        self.set_page(right, 300)

    def draft_text(self) -> str:
        kind = self.draft_kind.currentData()
        if kind == "ngram":
            return f"ngram:{self.draft_ngram.value()}"
        if kind == "early-exit":
            return f"early-exit:{self.draft_layers.value()}"
        if kind == "precision":
            ref = "default" if self.info is not None and self.info.source == "default" else (
                self.info.path if self.info is not None else "default")
            return f"{ref}:{self.draft_precision.currentData()}"
        return f"{self.draft_model.text().strip()}:{self.draft_precision.currentData()}"

    @Slot()
    def start(self) -> None:
        if not self.can_start():
            return
        if self.draft_kind.currentData() == "model" and not self.draft_model.text().strip():
            self.controls.status.setText("Name the draft model: a folder, a .gguf file or a hub id.")
            return
        prompt = self.spec_prompt.text().strip() or DEFAULT_PROMPT
        request = replace(self.request_for(prompt), max_new_tokens=self.spec_tokens.value())
        self.spec_output.clear()
        self.spec_summary.setText("")
        self._steps = []
        self._pending = []
        self._awaiting_rejects = ()
        self._plain_tokens = 0
        self._plain_step_s = None
        self._plain_clocks = []
        self._speedup_drawn = (-1, None)
        self.acceptance_plot.reset_view()
        self.speedup_plot.reset_view()
        compare = self.compare_plain.isChecked()
        self.submit(SpeculateJob(request, self.draft_text(), self.draft_tokens.value(), compare),
                    "Decoding plainly first …" if compare else "Loading the draft …")

    def _on_speculation_events(self, run: str, events) -> None:
        if run == "draft":
            self.controls.status.setText("Building the draft's compiled step (once on this machine) …")
            return
        if run == "plain":
            self._plain_tokens += sum(isinstance(e, TokenGenerated) for e in events)
            self.controls.status.setText(f"Decoding plainly first … {self._plain_tokens} tokens")
            for event in events:  # a plain step's time: what each speculative step is measured against
                if isinstance(event, TokenGenerated) and event.index:
                    self._plain_clocks.append(event.latency_s)  # (its own clock, its events after it aside)
                if isinstance(event, Finished) and event.decode_tokens_per_s:
                    self._plain_step_s = 1.0 / event.decode_tokens_per_s
            return
        self._pending.extend(events)
        self._steps.extend(e for e in events if isinstance(e, DraftVerified))
        self.mark_dirty()

    def _flush_output(self) -> None:
        """Write the pending events into the text: rejected guesses struck through in place."""
        if not self._pending:
            return
        cursor = self.spec_output.textCursor()
        cursor.movePosition(QTextCursor.End)
        plain, accepted, own, rejected = (QTextCharFormat() for _ in range(4))
        accepted.setBackground(QColor(ACCEPTED + "33"))
        own.setForeground(QColor(OWN))
        rejected.setForeground(QColor(REJECTED))
        rejected.setFontStrikeOut(True)
        for event in self._pending:
            # a verification's rejected guesses go before the target's own token that follows it,
            # which may arrive in a later batch of events
            if isinstance(event, DraftVerified):
                self._awaiting_rejects = event.drafted_text[event.accepted:]
            elif isinstance(event, TokenGenerated):
                if event.drafted is False and self._awaiting_rejects:
                    # a rejected line break shows as ↵, so a wrong guess can't reflow the answer
                    cursor.insertText("".join(self._awaiting_rejects).replace("\n", "↵"), rejected)
                self._awaiting_rejects = () if event.drafted is False else self._awaiting_rejects
                cursor.insertText(event.text, accepted if event.drafted else own if event.index else plain)
            elif isinstance(event, Prefilled):
                self.controls.status.setText("Speculating …")
        self._pending = []
        self.spec_output.setTextCursor(cursor)
        self.spec_output.ensureCursorVisible()

    def _draw_acceptance(self) -> None:
        steps = [s for s in self._steps if s.drafted_ids]
        if not steps:
            self.step_curve.setData([], [])
            self.running_curve.setData([], [])
            return
        x = list(range(1, len(steps) + 1))
        per_step = [100 * s.accepted / len(s.drafted_ids) for s in steps]
        so_far, drafted, accepted = [], 0, 0
        for s in steps:
            drafted += len(s.drafted_ids)
            accepted += s.accepted
            so_far.append(100 * accepted / drafted)
        self.step_curve.setData(x, per_step)
        self.running_curve.setData(x, so_far)
        self.acceptance_plot.fit(len(steps), 0, "%")
        self.acceptance_plot.item.setYRange(0, 105, padding=0)

    def _draw_speedup(self) -> None:
        """Each step's tokens over its time in plain steps, and the prediction from the steps so far
        (drawn again only when steps arrived)."""
        steps = [s for s in self._steps if s.drafted_ids and s.step_s > 0]
        plain = self._plain_step_s
        if (len(steps), plain) == self._speedup_drawn:
            return
        self._speedup_drawn = (len(steps), plain)
        if not steps or plain is None:
            for curve in (self.measured_curve, self.predicted_curve, self.even_curve):
                curve.setData([], [])
            return
        x = list(range(1, len(steps) + 1))
        emit = emit_seconds(plain, self._plain_clocks)
        measured = [(s.accepted + 1) * plain / step_cost_s(s, emit) for s in steps]
        predicted = step_predictions(steps, plain, emit)
        self.measured_curve.setData(x, measured)
        self.predicted_curve.setData(x, predicted)
        self.even_curve.setData([0, 1e6], [1.0, 1.0])  # across whatever the view shows
        self.speedup_plot.fit(len(steps), max(max(measured), max(predicted), 1.0), "×")

    def on_events(self, events: tuple) -> None:
        run, batch = None, []
        for event in events:  # runs of the same part ("plain", "speculative") together
            if event.tag != run and batch:
                self._on_speculation_events(run, batch)
                batch = []
            run = event.tag
            batch.append(event.event)
        if batch:
            self._on_speculation_events(run, batch)

    def draw(self) -> None:
        self._flush_output()
        self._draw_acceptance()
        self._draw_speedup()

    def on_finished(self, result: SpeculativeReport) -> None:
        self.draw()
        self.result = result
        rate = result.acceptance_rate
        steps = [s for s in self._steps if s.drafted_ids]
        draft_s = sum(s.draft_s for s in steps)
        verify_s = sum(s.verify_s for s in steps)
        lines = [f"<b>{result.draft}</b>, N = {result.draft_tokens_per_step}: "
                 f"{result.accepted_tokens} of {result.drafted_tokens} drafted tokens accepted "
                 f"({'n/a' if rate is None else f'{100 * rate:.0f}%'}), "
                 f"{(len(result.finished.token_ids) - 1) / len(steps) if steps else 0:.2f} tokens per target pass."]
        if steps:
            lines.append(f"Time per step: draft {format_seconds(draft_s / len(steps))}, "
                         f"target check {format_seconds(verify_s / len(steps))}.")
        speed = result.finished.decode_tokens_per_s
        if result.plain is not None:
            speedup = result.speedup_vs_plain
            lines.append(f"Speculative {format_rate(speed)} against plain {format_rate(result.plain_decode_tokens_per_s)}"
                         f" → <b>{'n/a' if speedup is None else f'{speedup:.2f}×'}</b>"
                         + (" (same tokens as plain decoding)" if result.same_tokens_as_plain else
                            " (sampled, so the tokens differ from the plain run)"))
            predicted = result.break_even
            if predicted is not None:
                lines.append(f"The cost model: {html.escape(explain(predicted))}.")
        else:
            lines.append(f"Speculative decoding: {format_rate(speed)}. Decode plainly first for the speed-up and "
                         "its prediction.")
        if result.draft_weights_bytes:
            lines.append(f"The draft's weights take {format_bytes(result.draft_weights_bytes)} more memory.")
        self.spec_summary.setText("<br>".join(lines))
        self.controls.status.setText(f"Finished ({result.finished.reason}).")

    def set_model(self, info: Loaded | None) -> None:
        if info is not None and info.num_layers:  # a model served elsewhere doesn't say
            self.draft_layers.setRange(1, max(1, info.num_layers - 1))
            if self.draft_layers.value() == 1:
                self.draft_layers.setValue(max(1, (2 * info.num_layers) // 3))
        super().set_model(info)

    def update_state(self) -> None:
        super().update_state()
        kind = self.draft_kind.currentData()
        self.draft_ngram.setEnabled(kind == "ngram")
        self.draft_layers.setEnabled(kind == "early-exit")
        self.draft_precision.setEnabled(kind in ("precision", "model"))
        self.draft_model.setEnabled(kind == "model")
