"""Point the workbench at a served model: the API's URL, a model it lists, and a key.

The key is kept in memory while the app runs, for its loads only: never written to the settings or the
history. Listing the models runs off the GUI thread (an unreachable host takes seconds to say so).
"""

from __future__ import annotations

import os

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.background import Background
from engine.base.errors import EngineError
from engine.endpoint import EndpointSpec, is_endpoint, list_models, parse_endpoint
from engine.endpoint.source import KEY_ENV

EXPLANATION = ("Any OpenAI-compatible server: vLLM, SGLang, llama.cpp's llama-server, Ollama, transformers serve, "
               "or this app's own Server tab. Its answers are timed here as each chunk arrives; what only the "
               "server knows (weights, KV bytes, memory) is shown as its /metrics say, or greyed out.")


class EndpointDialog(QDialog):
    def __init__(self, url: str = "http://127.0.0.1:8000/v1", model: str | None = None,
                 api_key: str | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("endpointDialog")
        self.setWindowTitle("Use a served model")
        self.background = Background(self)
        explanation = QLabel(EXPLANATION)
        explanation.setWordWrap(True)
        self.url = QLineEdit(url)
        self.url.setObjectName("endpointUrl")
        self.url.setPlaceholderText("http://HOST:PORT/v1")
        self.model = QComboBox()
        self.model.setObjectName("endpointModel")
        self.model.setEditable(True)
        self.model.setInsertPolicy(QComboBox.NoInsert)
        self.model.lineEdit().setPlaceholderText("the first model it lists")
        if model:
            self.model.setEditText(model)
        self.list_button = QPushButton("List models")
        self.list_button.setObjectName("listModels")
        self.list_button.clicked.connect(self.list_models)
        self.key = QLineEdit(api_key or "")
        self.key.setObjectName("endpointKey")
        self.key.setEchoMode(QLineEdit.Password)
        found = next((name for name in KEY_ENV if os.environ.get(name)), None)
        self.key.setPlaceholderText(f"from ${found}" if found else "none")
        self.key.setToolTip(f"Sent as 'Authorization: Bearer …'. Left empty: ${KEY_ENV[0]}, else ${KEY_ENV[1]}. "
                            "Kept while the app runs, never saved.")
        self.status = QLabel("")
        self.status.setObjectName("endpointStatus")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextSelectableByMouse)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model, 1)
        model_row.addWidget(self.list_button)
        form = QFormLayout()
        form.addRow("API URL", self.url)
        form.addRow("Model", model_row)
        form.addRow("API key", self.key)
        self.buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        self.buttons.button(QDialogButtonBox.Ok).setText("Use it")
        self.buttons.accepted.connect(self._accept)
        self.buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(explanation)
        layout.addLayout(form)
        layout.addWidget(self.status)
        layout.addWidget(self.buttons)
        self.setMinimumWidth(520)
        self._listing = None

    def spec_text(self) -> str:
        """``endpoint:URL#MODEL`` as chosen (raises ``InvalidRequestError`` for a malformed URL)."""
        spec = parse_endpoint(self.url.text())
        return EndpointSpec(spec.url, self.model.currentText().strip() or None).text

    def api_key(self) -> str | None:
        return self.key.text() or None

    def list_models(self) -> None:
        try:
            self.spec_text()
        except EngineError as exc:
            self.status.setText(str(exc))
            return
        url, key = self.url.text(), self.api_key()
        self.list_button.setEnabled(False)
        self.status.setText(f"Asking {url} for its models…")
        self._listing = self.background.submit(lambda: list_models(url, key), self._listed, self._failed)

    def _listed(self, names: list[str]) -> None:
        self.list_button.setEnabled(True)
        current = self.model.currentText()
        self.model.clear()
        self.model.addItems(names)
        self.model.setEditText(current if current in names else names[0])
        self.status.setText(f"It serves {len(names)} model{'s' if len(names) > 1 else ''}: {', '.join(names)}.")

    def _failed(self, exc: BaseException) -> None:
        self.list_button.setEnabled(True)
        self.status.setText(str(exc))

    def _accept(self) -> None:
        try:
            self.spec_text()
        except EngineError as exc:
            self.status.setText(str(exc))
            return
        self.accept()

    def done(self, result: int) -> None:
        self.background.close()
        super().done(result)


def ask_for_endpoint(parent: QWidget, chosen: str, api_key: str | None, on_chosen) -> EndpointDialog:
    """Open the dialog window-modal (never blocking the app), filled from ``chosen`` when it is an
    endpoint; ``on_chosen(spec_text, api_key)`` runs if the user confirms."""
    spec = parse_endpoint(chosen) if is_endpoint(chosen) else None
    dialog = EndpointDialog(spec.url if spec else "http://127.0.0.1:8000/v1", spec.model if spec else None,
                            api_key, parent)
    dialog.setWindowModality(Qt.WindowModal)
    dialog.accepted.connect(lambda: on_chosen(dialog.spec_text(), dialog.api_key()))
    dialog.finished.connect(dialog.deleteLater)
    dialog.open()
    return dialog
