"""Help → Tour: ten steps, one per question of the essay, each a measurement made there and then
on the loaded model, with the plot or window that answers it outlined and a few sentences on what
to look at. Offered once, on the first start; left at any time (what a step started finishes in
its own window; a server the tour started is stopped).

Every step runs through the windows' own controls (the prompt box, the Batching tool, Compare's
ladder, the Server panel, the load generator, the Cost explorer), set visibly to short runs, so
what the tour shows is what the app runs; its figures come from their results.
"""

from __future__ import annotations

import html
import logging
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QEvent, QObject, QPoint, QRect, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.glossary import linked, open_glossary
from engine.base.units import format_bytes, format_count, format_rate, format_seconds, kv_dtype_label
from engine.jobs import CeilingJob, TokenizeJob, WeightsJob
from engine.measure.compare import LaneSpec
from engine.models.sources import reference_weights

PROMPT = "In two sentences: what does a GPU do?"
ANSWER_TOKENS = 32
"""Each answer the tour asks for: long enough for a steady per-token figure, a few seconds on two cores."""
FOLLOW_UP = "Now say it to a ten-year-old."
BATCHES = "1,4"
SWEEP_TOKENS = 16
LADDER_TOKENS = 16
SPECULATIVE_TOKENS = 40
EDIT_PROMPT = ("Copy this exactly, but write \"ocean\" for \"sea\": The sea was calm that morning. The boats rowed "
               "out past the rocks, where the sea turned from green to deep blue.")
"""Step 8's prompt: an edit, whose answer repeats its input (where prompt lookup's guesses are right)."""
LOAD_CONCURRENCY = "1,4"
LOAD_REQUESTS = 8
LOAD_TOKENS = 16
DEFAULT_TRAINING_TOKENS = 2e12
"""SmolLM2-135M's training tokens (its model card: 2 trillion)."""
TOKENS_PER_PARAMETER = 20
"""For another model the tour assumes Chinchilla's 20 training tokens per parameter, and says so."""
HIGHLIGHT = "#e67e22"
MAX_CHIPS = 160

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    key: str
    title: str
    question: str
    """The essay's question this step answers."""
    look: str
    """What to look at, two or three sentences (its glossary words become links)."""


STEPS = (
    Step("tokens", "Tokens", "What does the model actually read?",
         "Your prompt, as the model reads it: the chat template wraps it with a system prompt and role markers, "
         "then the tokenizer cuts it into tokens (the chips below). An API bills these, and the context "
         "window counts them."),
    Step("decode", "One token at a time", "How does a model actually run?",
         "Generate answers the prompt in the main window (up to 32 tokens: the tour keeps answers short, whatever "
         "the Generation panel says). The Per-token latency plot (outlined) has one point per "
         "token: the first waited for the whole prompt (the TTFT); every later token is one decode step, "
         "a pass through the whole model."),
    Step("weights", "Why so much memory", "Why does it need so much memory?",
         "Weights take parameters × bits: counted from the config, predicted, and measured once loaded. The "
         "Memory plot draws them as the dashed line under the process's memory. The same sum for "
         "Llama-3.1-8B gives the essay's 16 GB."),
    Step("kv", "The KV cache", "Why does memory grow while it talks?",
         "A follow-up turn: the KV cache plot (outlined) adds the same bytes for every token, measured dots on "
         "the line predicted from the config. Each request holds its own, so context and users multiply it. "
         "Fewer bits a value hold more: the Model panel's KV cache box (int8 is about half of 16-bit)."),
    Step("bandwidth", "The bandwidth ceiling", "Why does generating a response take time?",
         "Each decode step reads every weight (and the KV cache) from memory. This machine's bandwidth, "
         "measured, divided by the bytes read per token, is the fastest one request can go: the dashed line "
         "now drawn on the Tokens / second plot."),
    Step("batching", "Batching", "How does a server answer many users?",
         "A short sweep in the Batching window: one request, then four at once. One pass reads the "
         "weights for all four, so throughput rises; each request waits a little longer per token (the "
         "trade-off plot, outlined)."),
    Step("quantization", "Quantization", "What do fewer bits buy, and cost?",
         "Compare's quantization ladder: the same model at fp32, bf16, int8 and nf4, the same prompt in "
         "each lane. The summary (outlined) gives bytes, speed, and how often each answer agrees with lane 1's."),
    Step("speculative", "Speculative decoding", "Can a model guess ahead?",
         "A draft guesses a few tokens; the model checks them all in one pass and keeps those it agrees with, so "
         "the answer is the model's own. Two drafts on one edit-this-text prompt: prompt lookup (no model: it "
         "guesses the answer goes on as the prompt did) and early exit (the model's own first layers). Each "
         "speed-up is shown beside the one predicted from how often a guess was kept and what a guess and a "
         "check cost: it pays when guesses are mostly kept and cost little."),
    Step("serving", "Many users", "What happens behind an API?",
         "The Server panel starts an OpenAI-compatible API on this model; the load generator sends it one "
         "request at a time, then four at once. The Traffic view draws each request as a bar (outlined): "
         "queued, reading its prompt, decoding. The tour stops the server it started when it moves on."),
    Step("training", "Training vs inference", "Which costs more, training or answering?",
         "Training costs about 6 × parameters FLOPs per training token; answering about 2 × parameters per "
         "token. The Cost explorer (outlined) turns the training bill into tokens served, and this "
         "machine's measured speed into how long that would take."),
)


class Highlight(QWidget):
    """An outline over a widget (drawn on top of it, clicks pass through), following its size."""

    def __init__(self, target: QWidget) -> None:
        # drawn on the target itself, or, where that is a splitter (which takes every child for
        # a pane of its own), on the nearest widget around it that is not one
        host = target
        while isinstance(host, QSplitter) and host.parentWidget() is not None:
            host = host.parentWidget()
        super().__init__(host)
        self.setObjectName("tourHighlight")
        self.setAttribute(Qt.WA_TransparentForMouseEvents)
        self.setAttribute(Qt.WA_NoSystemBackground)
        self.target = target
        target.installEventFilter(self)
        self._fit()
        self.show()

    def _fit(self) -> None:
        host = self.parentWidget()
        corner = QPoint(0, 0) if host is self.target else self.target.mapTo(host, QPoint(0, 0))
        self.setGeometry(QRect(corner, self.target.size()))
        self.raise_()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.target and event.type() in (QEvent.Resize, QEvent.Move, QEvent.Show):
            self._fit()
        return False

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setPen(QPen(QColor(HIGHLIGHT), 4))
        painter.drawRect(QRect(2, 2, self.width() - 4, self.height() - 4))

    def remove(self) -> None:
        try:
            self.target.removeEventFilter(self)
        except RuntimeError:  # the target's window was closed and deleted
            return
        self.hide()
        self.deleteLater()


WIDEST = 440
"""The tour panel's width where the screen has room; :data:`NARROWEST` where that fits it beside
what a step outlines."""
NARROWEST = 340
PANEL_MARGIN = 8


def _on_screen(target: QWidget | None) -> QRect | None:
    """Where ``target`` lies on the screen; ``None``: no target, hidden, or its window closed."""
    try:
        return QRect(target.mapToGlobal(target.rect().topLeft()), target.size()) if target.isVisible() else None
    except (AttributeError, RuntimeError):
        return None


class Tour(QDialog):
    """The tour's panel: the step, what to look at, the figure measured, and Back / Next / Leave."""

    step_measured = Signal(str, str)  # step key, the figure as shown (plain text)
    step_failed = Signal(str, str)  # step key, why

    def __init__(self, main) -> None:
        super().__init__(main, Qt.Tool | Qt.WindowStaysOnTopHint)
        self.setObjectName("tour")
        self.setWindowTitle("Tour: behind the API call")
        self.main = main
        self.index = -1
        self.figures: dict[str, str] = {}  # step key -> its figure, as measured on this run of the tour
        self._listening: list[tuple[object, Callable]] = []
        self._highlight: Highlight | None = None
        self._job: int | None = None
        self._server_started_here = False
        self._moved: list[tuple[QWidget, QRect]] = []  # windows narrowed for the panel, and their geometry
        self.speed: float | None = None  # the decode tok/s the tour measured last (steps 2 and 4)
        self._draft = main.prompt.editor.toPlainText()  # what the user had typed: back in the box when the tour ends
        # the user's conversation: back in the window when the tour ends (the tour's turns leave it)
        transcript = main.transcript
        self._conversation = (list(transcript.turns), transcript.mode, transcript.system_prompt)
        self.context_tokens = 0  # the conversation's tokens after the tour's last answer

        self.heading = QLabel()
        self.heading.setObjectName("tourHeading")
        self.heading.setWordWrap(True)
        self.heading.setTextFormat(Qt.RichText)
        self.look = QLabel()
        self.look.setWordWrap(True)
        self.look.setTextFormat(Qt.RichText)
        self.look.linkActivated.connect(lambda link: open_glossary(link.removeprefix("glossary:"), self))
        self.figure = QLabel()
        self.figure.setObjectName("tourFigure")
        self.figure.setWordWrap(True)
        self.figure.setTextFormat(Qt.RichText)
        self.figure.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.chips = QLabel()
        self.chips.setObjectName("tourChips")
        self.chips.setWordWrap(True)
        self.chips.setTextFormat(Qt.RichText)
        chips_area = QScrollArea()
        chips_area.setWidgetResizable(True)
        chips_area.setWidget(self.chips)
        chips_area.setMinimumHeight(90)
        self.chips_area = chips_area
        self.back_button = QPushButton("Back")
        self.again_button = QPushButton("Measure again")
        self.next_button = QPushButton("Next")
        self.leave_button = QPushButton("Leave the tour")
        self.back_button.clicked.connect(lambda: self.show_step(self.index - 1))
        self.next_button.clicked.connect(self.next)
        self.again_button.clicked.connect(lambda: self.show_step(self.index))
        self.leave_button.clicked.connect(self.close)
        buttons = QHBoxLayout()
        for button in (self.back_button, self.again_button, self.next_button, self.leave_button):
            buttons.addWidget(button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.heading)
        layout.addWidget(self.look)
        layout.addWidget(self.figure)
        layout.addWidget(chips_area, 1)
        layout.addLayout(buttons)
        self.setFixedWidth(WIDEST)

    # -- moving through it -----------------------------------------------------------------------
    def start(self) -> None:
        self.show()
        self.show_step(0)

    def _place(self, target: QWidget | None) -> None:
        """Fit the panel to its text and put it in a corner of the screen clear of ``target`` (the
        outlined widget), or where it covers least of it: narrower (down to :data:`NARROWEST`)
        where that fits it into the space beside the target."""
        self.setFixedWidth(WIDEST)
        self._corner(target)
        covered = _on_screen(target)  # (where it is now: placing may have narrowed its window)
        frame = self.frameGeometry()
        if covered is None or not frame.intersects(covered):
            return
        screen = self.main.screen().availableGeometry()
        gap = max(covered.left() - screen.left(), screen.right() - covered.right()) - 2 * PANEL_MARGIN
        if NARROWEST <= gap < WIDEST:
            self.setFixedWidth(gap - (frame.width() - self.width()))
            self._corner(target)

    def _corner(self, target: QWidget | None) -> None:
        self.adjustSize()
        screen = self.main.screen().availableGeometry()
        size = self.frameGeometry().size()
        margin = PANEL_MARGIN
        corners = [QRect(screen.left() + margin, screen.bottom() - size.height() - margin, size.width(), size.height()),
                   QRect(screen.right() - size.width() - margin, screen.bottom() - size.height() - margin,
                         size.width(), size.height()),
                   QRect(screen.right() - size.width() - margin, screen.top() + margin, size.width(), size.height()),
                   QRect(screen.left() + margin, screen.top() + margin, size.width(), size.height())]
        covered = _on_screen(target)
        if covered is None:
            self.move(corners[0].topLeft())
            return

        def overlap(rect: QRect) -> int:
            common = rect.intersected(covered)
            return common.width() * common.height() if not common.isEmpty() else 0

        def filled(rect: QRect) -> int:  # of the target's window, what holds widgets (not empty space)
            window = target.window()
            total = 0
            for child in window.findChildren(QWidget):
                if child.isVisible() and not child.children() and child is not target and child.window() is window:
                    common = rect.intersected(QRect(child.mapToGlobal(child.rect().topLeft()), child.size()))
                    total += common.width() * common.height() if not common.isEmpty() else 0
            return total

        # the least of the target covered, then the least of what else its window shows
        best = min(corners, key=lambda rect: (overlap(rect), filled(rect)))
        if overlap(best) and self._make_room(target.window(), screen, size.width() + 2 * margin):
            covered = _on_screen(target)
            top = min(max(covered.top(), screen.top() + margin), screen.bottom() - size.height() - margin)
            self.move(screen.right() - size.width() - margin, top)
            return
        self.move(best.topLeft())

    def _make_room(self, window: QWidget, screen: QRect, room: int) -> bool:
        """Narrow ``window`` (the one the outlined widget is in) to leave a strip of ``room`` pixels
        at the screen's right for this panel, where it stays usable that narrow; its size comes back
        when the tour ends. Whether it did."""
        if window is None or window is self or window.isMaximized() or window.isFullScreen():
            return False
        frame = window.frameGeometry()
        extra = frame.width() - window.width()
        width = min(frame.right(), screen.right() - room) - max(frame.left(), screen.left()) - extra
        if width < max(window.minimumSizeHint().width(), window.minimumWidth()) or width >= window.width():
            return False
        if not any(moved is window for moved, _ in self._moved):
            self._moved.append((window, window.geometry()))
        geometry = window.geometry()
        geometry.moveLeft(max(frame.left(), screen.left()) + (geometry.left() - frame.left()))
        geometry.setWidth(width)
        window.setGeometry(geometry)
        return True

    @Slot()
    def next(self) -> None:
        if self.index + 1 < len(STEPS):
            self.show_step(self.index + 1)
        else:
            self.close()

    @property
    def step(self) -> Step:
        return STEPS[self.index]

    def show_step(self, index: int) -> None:
        if not 0 <= index < len(STEPS):
            return
        self._leave_step()
        self.setFixedWidth(WIDEST)
        self.index = index
        step = self.step
        self.heading.setText(f"<small>Step {index + 1} of {len(STEPS)}</small><br>"
                             f"<b>{html.escape(step.title)}</b>: <i>{html.escape(step.question)}</i>")
        self.look.setText(linked(step.look))
        self.chips_area.setVisible(step.key == "tokens")
        self.back_button.setEnabled(index > 0)
        self.next_button.setText("Finish" if index == len(STEPS) - 1 else "Next")
        self.figures.pop(step.key, None)
        problem = self._cannot_measure()
        if problem:
            self._failed(step.key, problem)
            return
        self._say("<i>Measuring…</i>")
        getattr(self, f"_measure_{step.key}")()

    def _cannot_measure(self) -> str | None:
        main = self.main
        if main.loaded is None:
            return "Load a model first (the Model panel): every step measures it."
        if main.loaded.source == "endpoint":
            return ("This step measures a model loaded here, and the loaded one is served elsewhere: load the "
                    "default model (or another local one) for the tour.")
        if main.loading:
            return "A model is loading: press Measure again once it is loaded."
        if main.generating:
            return "The window is answering a prompt: press Measure again when it is done."
        return None

    def _leave_step(self) -> None:
        """Stop listening to what the step started (it finishes in its own window), take the outline
        away, and stop the server if this step started it."""
        for signal, slot in self._listening:
            try:
                signal.disconnect(slot)
            except (RuntimeError, TypeError):
                pass
        self._listening = []
        self._job = None
        if self._highlight is not None:
            self._highlight.remove()
            self._highlight = None
        if self._server_started_here:
            self._server_started_here = False
            self.main.server_panel.stop()

    def _end(self) -> None:
        self._leave_step()
        for window, geometry in self._moved:  # the windows narrowed to make room: as they were
            try:
                window.setGeometry(geometry)
            except RuntimeError:  # closed meanwhile
                pass
        self._moved = []
        editor = self.main.prompt.editor
        if editor.toPlainText() in ("", PROMPT, FOLLOW_UP):  # the tour's text, or sent: the user's draft again
            editor.setPlainText(self._draft)
        turns, mode, system = self._conversation
        if [id(t) for t in self.main.transcript.turns] != [id(t) for t in turns]:
            self.main.restore_conversation(turns, mode, system)

    def closeEvent(self, event) -> None:
        self._end()
        super().closeEvent(event)

    def reject(self) -> None:
        """Esc: leave the tour, as its button does (a dialog's Esc hides it without a close event)."""
        self._end()
        super().reject()

    # -- what steps share ----------------------------------------------------------------------
    def _listen(self, signal, slot: Callable) -> None:
        """Connect ``slot`` to ``signal`` for this step only; a slot that raises fails the step
        with what it raised (a figure the tour can't make is said, never left spinning)."""
        key = self.step.key

        def guarded(*args) -> None:
            try:
                slot(*args)
            except Exception as exc:  # noqa: BLE001 - shown in the panel
                log.exception("tour step %s", key)
                self._failed(key, f"This step could not read its figure: {type(exc).__name__}: {exc}")

        signal.connect(guarded)
        self._listening.append((signal, guarded))

    def _outline(self, widget: QWidget) -> None:
        """Bring ``widget``'s window (and its dock or tab) forward and draw the outline on it."""
        if self._highlight is not None:
            self._highlight.remove()
        dock = widget
        while dock is not None and dock.metaObject().className() != "QDockWidget":
            dock = dock.parentWidget()
        if dock is not None:
            dock.show()
            dock.raise_()
        self._highlight = Highlight(widget)
        self._place(widget)
        self.raise_()

    def _say(self, text: str) -> None:
        """The figure line; the panel grows with it, kept inside the screen where the user left it."""
        self.figure.setText(text)
        if not self.isVisible():
            return
        bottom = self.frameGeometry().bottom()
        self.adjustSize()
        screen = self.main.screen().availableGeometry()
        frame = self.frameGeometry()
        y = min(max(screen.top(), bottom - frame.height() + 1), screen.bottom() - frame.height() + 1)
        self.move(frame.left(), y)  # its bottom edge stays put (it sits in a bottom corner)

    def _done(self, key: str, figure: str) -> None:
        """A step's figure (rich text), shown and remembered if the step is still the one shown."""
        if self.index < 0 or self.step.key != key:
            return
        self._say(f"<b>Measured:</b> {figure}")
        self.figures[key] = _plain(figure)
        self.step_measured.emit(key, self.figures[key])

    def _failed(self, key: str, message: str) -> None:
        if self.index < 0 or self.step.key != key:
            return
        self._say(f"<span style='color:#c0392b'>{html.escape(message)}</span>")
        self.step_failed.emit(key, message)

    def _submit(self, job, on_result: Callable[[object], None]) -> None:
        """A job on the main window's model (its queue, in order); ``on_result`` with its result."""
        key = self.step.key
        session = self.main.session

        def finished(job_id: int, result) -> None:
            if job_id == self._job:
                self._job = None
                on_result(result)

        def failed(job_id: int, exc) -> None:
            if job_id == self._job:
                self._job = None
                self._failed(key, str(exc) or type(exc).__name__)

        self._listen(session.job_finished, finished)
        self._listen(session.job_failed, failed)
        self._job = session.submit(job)

    def _generate(self, text: str, on_finished: Callable[[object], None]) -> None:
        """The prompt box answers ``text`` (shown in it first), capped at :data:`ANSWER_TOKENS`."""
        key = self.step.key
        main = self.main
        self._listen(main.generation_finished, on_finished)
        self._listen(main.generation_failed, lambda exc: self._failed(key, str(exc) or type(exc).__name__))
        main.prompt.editor.setPlainText(text)
        main.generate(text, max_new_tokens=ANSWER_TOKENS)
        if not main.generating:
            self._failed(key, main.prompt.message.text() or "The window did not start the answer.")

    def _speedup_tool(self, name: str):
        """The Batching and speculative decoding window's tool ``name``, its tab in front."""
        window = self.main.open_speedups()
        tool = getattr(window, name)
        window.tabs.setCurrentWidget(tool)
        return tool

    def _run_tool(self, tool, on_finished: Callable[[object], None]) -> None:
        """Press the tool's Run; its result (or what stopped it) ends the step."""
        key = self.step.key
        self._listen(tool.finished, on_finished)
        self._listen(tool.failed, lambda message: self._failed(key, message))
        tool.start()
        if not tool.running:
            self._failed(key, tool.controls.status.text())

    def _remember_answer(self, event) -> None:
        if event.decode_tokens_per_s and math.isfinite(event.decode_tokens_per_s):
            self.speed = event.decode_tokens_per_s
        self.context_tokens = event.prompt_tokens + event.tokens

    # -- the steps -----------------------------------------------------------------------------
    def _measure_tokens(self) -> None:
        main = self.main
        main.prompt.editor.setPlainText(PROMPT)
        self._outline(main.prompt)
        request = main.generation_panel.request_for(PROMPT, main.transcript.history())  # what Generate will send

        def show(result) -> None:
            count = len(result.token_ids)
            self.chips.setText(chips_html(result.pieces))
            context = result.context_length
            share = (f", {count / context:.2%} of the model's {context:,}-token context window" if context else
                     " (the model doesn't say its context window)")
            words, own = len(PROMPT.split()), result.text_tokens
            if own is not None and own != count:  # the chat template and system prompt wrap the words
                said = (f"your {words} words are <b>{own} tokens</b>; with the chat template and system prompt "
                        f"around them the model reads <b>{count}</b>{share}.")
            else:
                said = f"your {words} words are <b>{count} tokens</b> as the model reads them{share}."
            self._done("tokens", said)

        self._submit(TokenizeJob(request), show)

    def _measure_decode(self) -> None:
        main = self.main
        self._outline(main.plots.latency)

        def finished(event) -> None:
            self._remember_answer(event)
            if event.tokens < 2 or not event.ttft_s:
                self._failed("decode", f"The answer stopped after {event.tokens} token(s): press Measure again.")
                return
            per_token = event.decode_s / (event.tokens - 1)
            self._done("decode", f"TTFT <b>{format_seconds(event.ttft_s)}</b> for the {event.prompt_tokens}-token "
                                 f"prompt, read in one go; then <b>{format_seconds(per_token)} per token</b> for "
                                 f"{event.tokens - 1} more, one pass each ({format_rate(event.decode_tokens_per_s)}).")

        self._generate(PROMPT, finished)

    def _measure_weights(self) -> None:
        main = self.main
        self._outline(main.plots.memory)
        main.plots.refresh(main.run)

        def show(f) -> None:
            measured = ("" if not f.measured_bytes else
                        f"; measured once loaded: <b>{format_bytes(f.measured_bytes)}</b> "
                        f"({100 * (f.measured_bytes - f.predicted_bytes) / f.predicted_bytes:+.1f}%)")
            self._done("weights", f"{format_count(f.parameters)} parameters × {f.bits_per_parameter:.1f} bits "
                                  f"({f.precision}) = <b>{format_bytes(f.predicted_bytes)}</b> predicted{measured}. "
                                  f"{f.reference.split('/')[-1]}: {format_count(f.reference_parameters)} × 16 bits = "
                                  f"<b>{f.reference_bytes / 1e9:.1f} GB</b> in bf16.")

        self._submit(WeightsJob(), show)

    def _measure_kv(self) -> None:
        main = self.main
        self._outline(main.plots.kv)
        info = main.loaded

        def finished(event) -> None:
            self._remember_answer(event)
            measured, predicted = event.kv_cache_bytes, event.kv_cache_bytes_predicted
            if not measured or not predicted:
                self._failed("kv", "This model's cache could not be measured (its layout is not a plain KV cache).")
                return
            tokens = self.context_tokens - 1  # the last token's keys are made by the next step
            per_token = info.kv_bytes_per_token or predicted / max(tokens, 1)
            full = (f" At its full {info.context_length:,}-token context one request would hold "
                    f"{format_bytes(per_token * info.context_length)}; eight users, "
                    f"{format_bytes(8 * per_token * info.context_length)}." if info.context_length else "")
            self._done("kv", f"<b>{format_bytes(measured)}</b> measured for {tokens:,} tokens, "
                             f"{format_bytes(predicted)} predicted ({100 * (measured - predicted) / predicted:+.1f}%): "
                             f"<b>{format_bytes(per_token)} per token</b> in {kv_dtype_label(info.kv_dtype)}."
                             f"{full}")

        self._generate(FOLLOW_UP, finished)

    def _measure_bandwidth(self) -> None:
        main = self.main
        self._outline(main.plots.speed)
        context = self.context_tokens or 64

        def show(c) -> None:
            if not c.tokens_per_s:
                self._failed("bandwidth", "No ceiling: the cost model doesn't know this model's layout.")
                return
            main.plots.set_ceiling(c.tokens_per_s)
            speed = self.speed or main.run.decode_tokens_per_s()
            if not speed:
                measured = "No answer measured yet (step 2 makes one)."
            elif speed <= c.tokens_per_s:
                measured = (f"The last answer: <b>{format_rate(speed)}</b>, {speed / c.tokens_per_s:.0%} of the "
                            "ceiling (the rest of each step goes to arithmetic and overheads, not to reading memory).")
            else:  # a ceiling that doesn't hold is said to be broken, with why, never drawn as 112%
                measured = (f"The last answer, <b>{format_rate(speed)}</b>, ran <b>above</b> this ceiling: it was "
                            "measured while the machine was quicker than now (the bandwidth was measured just "
                            "now; a shared machine's speed moves with its neighbours' load).")
            skipped = (f" (of the {format_bytes(c.weights_bytes)} of weights, {format_bytes(c.weights_read_bytes)}: "
                       "a token looks up only one row of the input embedding table; then the KV cache)"
                       if c.weights_read_bytes < c.weights_bytes else "")
            if c.level == "L3" and c.level_bandwidth_bytes_per_s:
                reads = (f"the weights fit in its {format_bytes(c.cache_bytes)} L3 cache, so a token reads them "
                         f"from there: <b>{c.level_bandwidth_bytes_per_s / 1e9:,.1f} GB/s</b> measured just now "
                         f"(memory: {c.bandwidth_bytes_per_s / 1e9:,.1f} GB/s; the ceiling is the L3's)")
            else:
                reads = (f"this machine reads <b>{c.bandwidth_bytes_per_s / 1e9:,.1f} GB/s</b> from memory "
                         f"({html.escape(c.source)})")
            self._done("bandwidth", f"{reads}; each token reads {format_bytes(c.bytes_per_token)}"
                                    f"{skipped}, so one request can make at most <b>{format_rate(c.tokens_per_s)}</b>. "
                                    f"{measured}")

        self._submit(CeilingJob(context), show)

    def _measure_batching(self) -> None:
        tool = self._speedup_tool("batching")
        tool.batches.setText(BATCHES)
        tool.sweep_tokens.setValue(SWEEP_TOKENS)
        self._outline(tool.tradeoff_plot)
        self.raise_()

        def finished(result) -> None:
            points = [p for p in result.points if p.aggregate_tokens_per_s and p.mean_per_token_latency_s]
            if len(points) < 2:
                self._failed("batching", "The sweep measured fewer than two batch sizes: "
                                         + (" ".join(s.reason for s in result.skipped) or "press Measure again."))
                return
            one, many = points[0], points[-1]
            self._done("batching", f"batch {one.batch}: {format_rate(one.aggregate_tokens_per_s)}, "
                                   f"{format_seconds(one.mean_per_token_latency_s)} per token; batch {many.batch}: "
                                   f"<b>{format_rate(many.aggregate_tokens_per_s)} in all</b> "
                                   f"({many.aggregate_tokens_per_s / one.aggregate_tokens_per_s:.1f}×), each request "
                                   f"<b>{format_seconds(many.mean_per_token_latency_s)} per token</b> "
                                   f"({_times(many.mean_per_token_latency_s / one.mean_per_token_latency_s)}).")

        self._run_tool(tool, finished)

    def _measure_quantization(self) -> None:
        window = self.main.open_compare()
        loaded = self.main.model_panel.loaded_request  # lane 1: the model the main window runs, as loaded
        if loaded is not None and not window.running:
            window.lanes[0].configure(LaneSpec(loaded.model, loaded.precision, loaded.device, kv_dtype=loaded.kv_dtype))
        window.max_tokens.setValue(LADDER_TOKENS)
        if not window.prompt.toPlainText().strip():
            window.prompt.setPlainText(PROMPT)
        window.ladder()
        self._outline(window.table)
        self.raise_()

        def finished() -> None:
            rows = window.summary
            if not rows:
                self._failed("quantization", "The ladder did not run: see the Compare window's message.")
                return
            rungs = []
            for lane, row in zip(window.lanes, rows):
                agree = "" if row.token_agreement is None or row.lane == 1 else f", {row.token_agreement:.0%} agree"
                size = format_bytes(row.weights_bytes) if row.weights_bytes else "? bytes"
                speed = format_rate(row.decode_tokens_per_s) if row.decode_tokens_per_s else "no speed"
                rungs.append(f"<b>{html.escape(lane.spec().precision)}</b> {size}, {speed}{agree}")
            info = window.lanes[0].loaded
            source = "" if info is None else " " + html.escape(
                reference_weights(info.original_format, info.precision, served=info.source == "endpoint"))
            self._done("quantization", "; ".join(rungs) + "." + source)

        self._listen(window.run_finished, finished)
        window.run()
        if not window.running and window._run_after_load is None:
            self._failed("quantization", window.message.text() or "Compare did not start the ladder.")

    def _measure_speculative(self) -> None:
        tool = self._speedup_tool("speculative")
        tool.compare_plain.setChecked(True)
        tool.spec_tokens.setValue(SPECULATIVE_TOKENS)
        tool.spec_prompt.setText(EDIT_PROMPT)
        tool.draft_kind.setCurrentIndex(tool.draft_kind.findData("ngram"))
        self._outline(tool.acceptance_plot.parentWidget().parentWidget())  # the answer, summary and plots
        self.raise_()
        reports = []

        def described(report) -> str:
            rate, speedup, predicted = report.acceptance_rate, report.speedup_vs_plain, report.break_even
            text = (f"<b>{html.escape(report.draft)}</b>: {report.accepted_tokens} of {report.drafted_tokens} "
                    f"guesses kept ({'n/a' if rate is None else f'{rate:.0%}'}), "
                    f"{format_rate(report.finished.decode_tokens_per_s)} against plain "
                    f"{format_rate(report.plain_decode_tokens_per_s)}: <b>"
                    + ("n/a" if speedup is None else f"{speedup:.2f}×") + "</b>")
            if not report.drafted_tokens:
                text += " (no guess: nothing in the answer repeated what came before)"
            elif predicted is not None:
                text += f", predicted {predicted.predicted:.2f}×"
                text += (" (it can't pay: a guess and the check cost too much)" if predicted.break_even_alpha is None
                         else f" (it pays where a guess is kept with α > {predicted.break_even_alpha:.2f})")
            return text

        def finished(report) -> None:
            reports.append(report)
            if len(reports) == 1:  # then the same prompt with the model's own first layers
                tool.draft_kind.setCurrentIndex(tool.draft_kind.findData("early-exit"))
                QTimer.singleShot(0, lambda: self._run_second(tool))
                return
            self._done("speculative", "; ".join(described(r) for r in reports) + ".")

        self._run_tool(tool, finished)

    def _run_second(self, tool) -> None:
        """Step 8's second run, once the first has let go of the tool."""
        if self.index < 0 or self.step.key != "speculative":
            return
        tool.start()
        if not tool.running:
            self._failed("speculative", tool.controls.status.text())

    def _measure_serving(self) -> None:
        main = self.main
        panel = main.server_panel
        traffic = main.open_traffic()
        box = traffic.load_box
        self._outline(traffic.plots.timeline)
        self.raise_()

        def run_load() -> None:
            if panel.started is None or box.runner is not None:
                return
            box.target.setCurrentIndex(0)  # this app's server
            box.mode.setCurrentIndex(box.mode.findData("concurrency"))
            box.values.setText(LOAD_CONCURRENCY)
            box.requests.setValue(LOAD_REQUESTS)
            box.max_tokens.setValue(LOAD_TOKENS)
            box.exact.setChecked(True)
            box.run()

        def ended(results, error) -> None:
            if error is not None or not results:
                self._failed("serving", f"The load failed: {error}" if error else "The load was stopped.")
                return
            parts = []
            for setting in results:
                s = setting.summary
                tpot = s.tpot.get("median") if isinstance(s.tpot, dict) else None
                parts.append(f"{html.escape(setting.label)}: <b>{s.output_throughput:,.1f} tok/s</b> in all, "
                             f"{s.completed}/{s.requests} done"
                             + (f", {format_seconds(tpot)} per token each" if tpot else ""))
            self._done("serving", "; ".join(parts) + ". Each request's bar is in the Traffic view.")

        def state_changed() -> None:
            if panel.started is not None:
                run_load()
            elif panel.job is None and box.runner is None and "serving" not in self.figures:
                self._failed("serving", panel.status.text() or "The server stopped.")

        self._listen(box.load_ended, ended)
        self._listen(panel.state_changed, state_changed)
        if panel.started is not None:
            run_load()
            return
        if panel.job is None:
            if not _port_free(panel.host.text().strip() or "127.0.0.1", panel.port.value()):
                panel.port.setValue(0)  # any free port: the one set is taken
            self._server_started_here = True
            panel.start()
            if panel.job is None:
                self._server_started_here = False
                self._failed("serving", "The server did not start: see the Server panel.")

    def _measure_training(self) -> None:
        main = self.main
        window = main.open_costs()
        info = main.loaded
        tokens = DEFAULT_TRAINING_TOKENS if info.source == "default" else TOKENS_PER_PARAMETER * (info.parameters or 0)
        window.training.setText(f"{tokens:.3g}")
        self._outline(window.numbers)
        self.raise_()
        assumed = ("SmolLM2-135M's 2 T training tokens (its model card)" if info.source == "default" else
                   f"{TOKENS_PER_PARAMETER} training tokens per parameter (Chinchilla's rule; set your own)")

        def updated() -> None:
            e = window.estimate
            if e is None or not e.training_breakeven_tokens:
                return  # still reading the config or measuring the machine
            speed = self.speed or main.run.decode_tokens_per_s()
            time = ("" if not speed else
                    f" At this machine's measured {format_rate(speed)}, one user would take "
                    f"<b>{_years(e.training_breakeven_tokens / speed)}</b> to ask for that many.")
            self._done("training", f"with {assumed}: training ≈ {e.training_flops:.2e} FLOPs, the compute of "
                                   f"serving <b>{e.training_breakeven_tokens:.2e} tokens</b>.{time}")

        self._listen(window.updated, updated)
        window.schedule_update()


def chips_html(pieces) -> str:
    """Tokens as chips, alternating two colours; spaces as ·, line breaks as ↵."""
    out = []
    for i, piece in enumerate(pieces[:MAX_CHIPS]):
        text = html.escape(piece).replace(" ", "·").replace("\n", "↵") or "∅"
        colour = "#d6eaf8" if i % 2 == 0 else "#fdebd0"
        out.append(f"<span style='background:{colour}; color:#1b2631'>&nbsp;{text}&nbsp;</span>")
    more = f" <i>… {len(pieces) - MAX_CHIPS} more</i>" if len(pieces) > MAX_CHIPS else ""
    return " ".join(out) + more


def _plain(text: str) -> str:
    from PySide6.QtGui import QTextDocumentFragment

    return QTextDocumentFragment.fromHtml(text).toPlainText()


def _years(seconds: float) -> str:
    years = seconds / (365.25 * 86400)
    return f"{years:,.0f} years" if years >= 2 else (f"{seconds / 86400:,.0f} days" if seconds >= 2 * 86400
                                                     else format_seconds(seconds))


def _port_free(host: str, port: int) -> bool:
    if port == 0:
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host if host not in ("", "localhost") else "127.0.0.1", port))
        return True
    except OSError:
        return False


def offer(main) -> None:
    """First start: the prompt box offers the tour once (never again after)."""
    if main.settings.value("tour/offered", False, type=bool):
        return
    main.settings.setValue("tour/offered", True)
    main.prompt.show_message("New here? <a href='tour'>Take the tour</a> (Help → Tour): ten steps, a few "
                             "minutes, each measured on this model, from tokens to serving many users.", "info")


def _times(ratio: float) -> str:
    """A per-token time against another, in words: "1.8× as long", "1.2× shorter", "about the same"."""
    if ratio >= 1.05:
        return f"{ratio:.1f}× as long"
    if ratio <= 1 / 1.05:
        return f"{1 / ratio:.1f}× shorter"
    return "about the same"


def open_tour(main) -> Tour:
    tour = main.findChild(Tour, "tour")
    if tour is None:
        tour = Tour(main)
        tour.setAttribute(Qt.WA_DeleteOnClose)
    if tour.index < 0:
        QTimer.singleShot(0, tour.start)
    else:
        tour.show()
        tour.raise_()
    return tour
