"""Help → Tour: ten steps, one per question of the essay, each a measurement made there and then
on the loaded model, with the plot or window that answers it outlined and a few sentences on what
to look at. Offered once, on the first start; left at any time (what a step started finishes in
its own window; a server the tour started is stopped).

Every step runs through the windows' own controls (the prompt box, the Batching tool, Compare's
ladder, the Server panel, the load generator, the Cost explorer), set visibly to short runs, so
what the tour shows is what the app runs; its figures come from their results. The steps and what
each measures are in app/tour_steps.py; this module is the panel that walks through them.
"""

from __future__ import annotations

import html
import logging
import math
from collections.abc import Callable

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
from app.tour_steps import ANSWER_TOKENS, FOLLOW_UP, HIGHLIGHT, PROMPT, STEPS, Step, StepMeasurements, plain_text

log = logging.getLogger(__name__)


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


class Tour(StepMeasurements, QDialog):
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
        self.figures[key] = plain_text(figure)
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

def offer(main) -> None:
    """First start: the prompt box offers the tour once (never again after)."""
    if main.settings.value("tour/offered", False, type=bool):
        return
    main.settings.setValue("tour/offered", True)
    main.prompt.show_message("New here? <a href='tour'>Take the tour</a> (Help → Tour): ten steps, a few "
                             "minutes, each measured on this model, from tokens to serving many users.", "info")


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
