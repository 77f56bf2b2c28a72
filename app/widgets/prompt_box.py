"""The prompt editor with Generate (Ctrl+Enter) and Stop (Esc), and a message area."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from app.screen import compact


class _PromptEdit(QPlainTextEdit):
    submitted = Signal()

    def keyPressEvent(self, event) -> None:
        if event.key() in (Qt.Key_Return, Qt.Key_Enter) and event.modifiers() & Qt.ControlModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class PromptBox(QWidget):
    generate_clicked = Signal(str)
    stop_clicked = Signal()
    clear_clicked = Signal()
    copy_clicked = Signal()
    save_clicked = Signal()
    message_shown = Signal()  # the message area changed: the window makes room for all of it

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.editor = _PromptEdit()
        self.editor.setObjectName("promptEdit")
        self.editor.setPlaceholderText("Ask something… (Ctrl+Enter to generate, Esc to stop)")
        self.editor.setMaximumHeight(120)
        self.editor.submitted.connect(self._submit)
        self.generate_button = QPushButton("Generate")
        self.generate_button.setObjectName("generateButton")
        self.generate_button.setToolTip("Ctrl+Enter")
        self.generate_button.clicked.connect(self._submit)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("stopButton")
        self.stop_button.setToolTip("Esc")
        self.stop_button.clicked.connect(self.stop_clicked)
        self.clear_button = QPushButton("Clear")
        self.clear_button.setToolTip("Forget the conversation")
        self.clear_button.clicked.connect(self.clear_clicked)
        self.copy_button = QPushButton("Copy")
        self.copy_button.setToolTip("Copy the last answer")
        self.copy_button.clicked.connect(self.copy_clicked)
        self.save_button = QPushButton("Save…")
        self.save_button.setToolTip("Save the transcript as Markdown or JSON")
        self.save_button.clicked.connect(self.save_clicked)
        self.message = QLabel("")
        self.message.setObjectName("messageArea")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextSelectableByMouse | Qt.LinksAccessibleByMouse)
        self.message.hide()
        compact(self.generate_button, self.stop_button, self.clear_button, self.copy_button, self.save_button)
        buttons = QHBoxLayout()
        for button in (self.generate_button, self.stop_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        for button in (self.clear_button, self.copy_button, self.save_button):
            buttons.addWidget(button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.message)
        layout.addWidget(self.editor)
        layout.addLayout(buttons)
        self.set_state(can_generate=False, generating=False)

    def _submit(self) -> None:
        if self.generate_button.isEnabled():
            self.generate_clicked.emit(self.editor.toPlainText())

    def set_state(self, can_generate: bool, generating: bool) -> None:
        self.generate_button.setEnabled(can_generate and not generating)
        self.stop_button.setEnabled(generating)
        self.clear_button.setEnabled(not generating)

    def show_message(self, text: str, severity: str = "info") -> None:
        self.message.setProperty("severity", severity)
        self.message.style().unpolish(self.message)
        self.message.style().polish(self.message)
        self.message.setText(text)
        self.message.setVisible(bool(text))
        self.message_shown.emit()

    def needed_height(self) -> int:
        """Height that shows the message whole, the editor's minimum and the buttons at this width."""
        layout = self.layout()
        if layout.hasHeightForWidth():
            return layout.totalHeightForWidth(self.width())
        return layout.totalMinimumSize().height()
