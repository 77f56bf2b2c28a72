"""The conversation as text, appended token by token from a timer, optionally as token chips.

Hovering a token shows its id, text, log-probability, the five most likely tokens at that
step and its latency.
"""

from __future__ import annotations

import html
import math

from PySide6.QtCore import QEvent, QPoint
from PySide6.QtGui import QColor, QFont, QPalette, QTextCharFormat, QTextCursor, QTextFormat
from PySide6.QtWidgets import QPlainTextEdit, QToolTip, QWidget

from app.transcript import Transcript, Turn
from engine.base.units import format_seconds

_TURN = QTextFormat.UserProperty + 1
_TOKEN = QTextFormat.UserProperty + 2
_LABELS = {"user": "You", "assistant": "Model"}


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    return QColor(round(a.red() + (b.red() - a.red()) * t), round(a.green() + (b.green() - a.green()) * t),
                  round(a.blue() + (b.blue() - a.blue()) * t))


STOPPED_MARK = "[stopped]"
"""Where an answer you stopped ends."""


class OutputView(QPlainTextEdit):
    def __init__(self, transcript: Transcript, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("outputView")
        self.setReadOnly(True)
        self.setUndoRedoEnabled(False)
        self.setMouseTracking(True)
        self.transcript = transcript
        self.show_tokens = False
        self._turns_rendered = 0
        self._tokens_rendered = 0  # of the last rendered assistant turn
        self._clears_seen = transcript.clears
        self._errors_rendered: set[int] = set()
        self._chips = 0
        self.setPlaceholderText("The answer appears here, token by token.")

    # -- rendering -------------------------------------------------------------------
    def set_show_tokens(self, show: bool) -> None:
        if show != self.show_tokens:
            self.show_tokens = show
            self.rerender()

    def rerender(self) -> None:
        self.clear()
        self._clears_seen = self.transcript.clears
        self._turns_rendered = 0
        self._tokens_rendered = 0
        self._errors_rendered.clear()
        self._chips = 0
        self.sync()

    def sync(self) -> int:
        """Append whatever the transcript gained since the last call; returns tokens added."""
        turns = self.transcript.turns
        if self._clears_seen != self.transcript.clears or self._turns_rendered > len(turns):  # cleared
            self.rerender()
            return 0
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.End)
        cursor.beginEditBlock()
        added = 0
        # finish the turn that was streaming, then any new turns
        if self._turns_rendered:
            index = self._turns_rendered - 1
            added += self._append_tokens(cursor, index, turns[index])
        for index in range(self._turns_rendered, len(turns)):
            turn = turns[index]
            self._append_header(cursor, turn, first=index == 0)
            self._tokens_rendered = 0
            if turn.role == "assistant":
                added += self._append_tokens(cursor, index, turn)
            else:
                cursor.insertText(turn.text, QTextCharFormat())
            self._turns_rendered = index + 1
        cursor.endEditBlock()
        if at_bottom:
            bar.setValue(bar.maximum())
        return added

    def _append_header(self, cursor: QTextCursor, turn: Turn, first: bool) -> None:
        if not first:
            cursor.insertBlock()
            cursor.insertBlock()
        label = QTextCharFormat()
        label.setFontWeight(QFont.Bold)
        label.setForeground(self.palette().color(QPalette.Highlight))
        cursor.insertText(_LABELS.get(turn.role, turn.role), label)
        cursor.insertBlock()

    def _append_tokens(self, cursor: QTextCursor, turn_index: int, turn: Turn) -> int:
        if turn.role != "assistant":
            return 0
        start = self._tokens_rendered
        for i in range(start, len(turn.tokens)):
            token = turn.tokens[i]
            if token.special and not self.show_tokens:
                continue
            text = token.text
            if not text:
                continue  # part of a character still arriving: it shows with a later token
            if self.show_tokens and "\n" in text:
                text = text.replace("\n", "↵\n")
            self._chips += 1
            cursor.insertText(text, self._token_format(turn_index, i, token.special))
        self._tokens_rendered = len(turn.tokens)
        if turn.error and turn_index not in self._errors_rendered:
            self._errors_rendered.add(turn_index)
            note = QTextCharFormat()
            note.setForeground(QColor("#d63031"))
            cursor.insertText(f"\n[{turn.error}]", note)
        elif turn.finished is not None and turn.finished.reason == "cancelled" \
                and turn_index not in self._errors_rendered:  # the answer is cut: say so where it ends
            self._errors_rendered.add(turn_index)
            note = QTextCharFormat()
            note.setForeground(self.palette().color(QPalette.PlaceholderText))
            cursor.insertText(f" {STOPPED_MARK}", note)
        return len(turn.tokens) - start

    def _token_format(self, turn_index: int, token_index: int, special: bool) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setProperty(_TURN, turn_index)
        fmt.setProperty(_TOKEN, token_index)
        if self.show_tokens:
            palette = self.palette()
            base, accent = palette.color(QPalette.Base), palette.color(QPalette.Highlight)
            fmt.setBackground(_mix(base, accent, 0.18 if self._chips % 2 else 0.36))  # neighbours differ
            if special:
                fmt.setForeground(palette.color(QPalette.PlaceholderText))
                fmt.setFontItalic(True)
        return fmt

    # -- hover -----------------------------------------------------------------------
    def token_at(self, pos: QPoint) -> tuple[int, int] | None:
        """(turn, token) under a viewport position, or None."""
        cursor = self.cursorForPosition(pos)
        probe = QTextCursor(self.document())
        probe.setPosition(min(cursor.position() + 1, self.document().characterCount() - 1))
        fmt = probe.charFormat()
        if not fmt.hasProperty(_TOKEN):
            return None
        return int(fmt.property(_TURN)), int(fmt.property(_TOKEN))

    def viewportEvent(self, event) -> bool:
        if event.type() == QEvent.ToolTip:
            found = self.token_at(event.pos())
            if found is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), self.tooltip_for(*found), self.viewport())
            return True
        return super().viewportEvent(event)

    def tooltip_for(self, turn_index: int, token_index: int) -> str:
        token = self.transcript.turns[turn_index].tokens[token_index]
        rows = "".join(
            f"<tr><td>{'▶' if a.token_id == token.token_id else ''}</td><td><code>{html.escape(repr(a.text))}</code></td>"
            f"<td align='right'>{math.exp(a.logprob) * 100:.1f}%</td><td align='right'>{a.token_id}</td></tr>"
            for a in token.top_alternatives
        )
        served = token.memory.device == "remote"
        ident = "id not sent by the server" if token.token_id < 0 else f"id {token.token_id}"
        score = ("logprob not sent by the server" if token.logprob is None
                 else f"logprob {token.logprob:.3f} (p = {math.exp(token.logprob) * 100:.1f}%)")
        return (
            f"<b>token #{token_index}</b> · {ident}<br>"
            f"text <code>{html.escape(repr(token.text))}</code><br>"
            f"{score}<br>"
            f"latency {format_seconds(token.latency_s)}{' (time to first token)' if token_index == 0 else ''}"
            + (" (measured here, as its chunk arrived)" if served else "")
            + (f"<br><br><b>top {len(token.top_alternatives)} at this step</b>"
               f"<table cellspacing=4><tr><td></td><td>token</td><td>p</td><td>id</td></tr>{rows}</table>"
               if token.top_alternatives else "")
        )
