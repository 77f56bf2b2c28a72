"""The Server panel: the loaded model behind an OpenAI-compatible API (engine/serve), started and
stopped here, with its URL and ready-to-paste examples (curl, Python openai, JavaScript fetch).

Off until started: no port is open before Start. The server is a job of the model's session
(engine/jobs.ServeJob): it starts when the jobs before it end, and other jobs wait while it
serves. Its traffic (every request and step) goes into a :class:`TrafficLog` here, which the
traffic view draws; Stop finishes the requests in flight, Stop now cancels them (each stream
still ends with its last chunk and ``[DONE]``).
"""

from __future__ import annotations

from PySide6.QtCore import Signal, Slot
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.screen import compact
from engine.base.errors import EngineError
from engine.base.units import parse_size
from engine.jobs import ServeJob, Served, ServerStarted, Tagged
from engine.serve.traffic import TrafficLog


EXAMPLE_MAX_TOKENS = 128


def examples(url: str, model: str, key: bool) -> dict[str, str]:
    """Requests a client would send to this server, ready to paste: each with a ``max_tokens``
    (an answer in seconds) and no sampling values, so the model's own defaults apply."""
    limit = EXAMPLE_MAX_TOKENS
    auth_header = ' \\\n  -H "Authorization: Bearer $WORKBENCH_API_KEY"' if key else ""
    key_arg = 'os.environ["WORKBENCH_API_KEY"]' if key else '"not-needed"'
    js_auth = ', Authorization: `Bearer ${process.env.WORKBENCH_API_KEY}`' if key else ""
    return {
        "curl": (f"curl -N {url}/chat/completions{auth_header} \\\n  -H 'Content-Type: application/json' \\\n"
                 f"  -d '{{\"model\": \"{model}\", \"stream\": true, \"max_tokens\": {limit},\n"
                 f"       \"messages\": [{{\"role\": \"user\", \"content\": \"What is a KV cache?\"}}]}}'"),
        "Python (openai)": (
            "import os\nfrom openai import OpenAI\n\n"
            f"client = OpenAI(base_url=\"{url}\", api_key={key_arg})\n"
            f"stream = client.chat.completions.create(\n    model=\"{model}\",\n"
            "    messages=[{\"role\": \"user\", \"content\": \"What is a KV cache?\"}],\n"
            f"    max_tokens={limit},\n    stream=True,\n)\n"
            "for chunk in stream:\n    print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)\n"),
        "JavaScript (fetch)": (
            f"const response = await fetch(\"{url}/chat/completions\", {{\n  method: \"POST\",\n"
            f"  headers: {{ \"Content-Type\": \"application/json\"{js_auth} }},\n"
            f"  body: JSON.stringify({{\n    model: \"{model}\",\n    max_tokens: {limit},\n"
            "    messages: [{ role: \"user\", content: \"What is a KV cache?\" }],\n  }),\n});\n"
            "const answer = await response.json();\nconsole.log(answer.choices[0].message.content);\n"),
    }


class ServerPanel(QWidget):
    state_changed = Signal()
    """Started, stopped, failed or waiting: the window's other controls follow."""
    traffic_open_clicked = Signal()

    model_request = None
    """The loaded model's LoadRequest (a prediction of a load loads the same model to time it)."""

    def __init__(self, session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.log = TrafficLog()
        self.started: ServerStarted | None = None
        self.job: int | None = None
        self._job: ServeJob | None = None
        self._model_name: str | None = None
        self._stopping = False
        """The window's requests in the serving core: tag → cancel flag."""

        self.host = QLineEdit("127.0.0.1")
        self.host.setToolTip("Address to listen on. Anything but 127.0.0.1 lets other machines in, and needs a key.")
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setValue(8000)
        self.port.setSpecialValueText("any free port")
        self.api_key = QLineEdit()
        self.api_key.setEchoMode(QLineEdit.Password)
        self.api_key.setPlaceholderText("none (loopback only)")
        self.api_key.setToolTip("Clients send it as 'Authorization: Bearer …'. Never saved.")
        self.max_batch = QSpinBox()
        self.max_batch.setRange(1, 256)
        self.max_batch.setValue(16)
        self.max_batch.setToolTip("Requests decoded together; more wait in the queue.")
        self.kv_budget = QLineEdit("auto")
        self.kv_budget.setToolTip("KV-cache bytes the running requests and the prefix cache may hold together, "
                                  "e.g. 2GiB (auto: a quarter of the free memory, at most 4 GiB; 90% of a GPU's). One "
                                  "pool of 16-token blocks that grows to it only as requests need; when they run "
                                  "out the newest request is preempted.")
        self.prefix_caching = QCheckBox("Prefix caching")
        self.prefix_caching.setChecked(True)
        self.prefix_caching.setToolTip("Keep the KV of computed prompt blocks for later requests that begin the same "
                                       "way (a shared system prompt, a chat's history), as vLLM does by default "
                                       "(serve --no-prefix-caching turns it off).")
        self.batch_invariant = QCheckBox("Batch-invariant")
        self.batch_invariant.setToolTip(
            "Every answer the one it gets alone, whatever else runs beside it (serve --batch-invariant, as vLLM's): "
            "products in fixed tiles, no compiled steps, prompts in aligned chunks; slower. fp32, fp32-fast, "
            "int8-fast and int4-fast answer the same alone and in a batch without it; bf16, fp16 and the "
            "bitsandbytes precisions may not.")
        self.default_max_tokens = QSpinBox()
        self.default_max_tokens.setRange(0, 1_000_000)
        self.default_max_tokens.setValue(0)
        self.default_max_tokens.setSpecialValueText("auto")  # short: its text sets the panel's least width
        self.default_max_tokens.setToolTip("Where a request gives no max_tokens, its answer stops here (serve "
                                           "--default-max-tokens): a forgotten limit never holds the server for "
                                           "minutes. auto: the model's own default, else 512.")
        form = QFormLayout()
        form.addRow("Host", self.host)
        form.addRow("Port", self.port)
        form.addRow("API key", self.api_key)
        form.addRow("Max batch", self.max_batch)
        form.addRow("KV budget", self.kv_budget)
        form.addRow("Default max tokens", self.default_max_tokens)
        switches = QHBoxLayout()
        switches.addWidget(self.prefix_caching)
        switches.addWidget(self.batch_invariant)
        switches.addStretch(1)
        form.addRow(switches)
        self._fields = (self.host, self.port, self.api_key, self.max_batch, self.kv_budget, self.default_max_tokens,
                        self.prefix_caching, self.batch_invariant)

        self.start_button = QPushButton("Start server")
        self.start_button.clicked.connect(self.start)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Take no new requests, finish those in flight, then close the port.")
        self.stop_button.clicked.connect(lambda: self.stop(now=False))
        self.stop_now_button = QPushButton("Stop now")
        self.stop_now_button.setToolTip("Cancel the requests in flight (each stream ends cleanly) and close the port.")
        self.stop_now_button.clicked.connect(lambda: self.stop(now=True))
        buttons = QHBoxLayout()
        for b in (self.start_button, self.stop_button, self.stop_now_button):
            buttons.addWidget(b)

        self.status = QLabel("Off: no port is open.")
        self.status.setWordWrap(True)
        self.status.setObjectName("messageArea")
        self.url = QLineEdit()
        self.url.setReadOnly(True)
        self.url.setPlaceholderText("the URL shows here once serving")
        copy_url = QPushButton("Copy")
        copy_url.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.url.text()))
        url_row = QHBoxLayout()
        url_row.addWidget(self.url, 1)
        url_row.addWidget(copy_url)
        self.examples = QTabWidget()
        self._example_views: dict[str, QPlainTextEdit] = {}
        for name in examples("http://127.0.0.1:8000/v1", "model", False):
            view = QPlainTextEdit()
            view.setReadOnly(True)
            view.setLineWrapMode(QPlainTextEdit.NoWrap)
            self._example_views[name] = view
            self.examples.addTab(view, name)
        copy_example = QPushButton("Copy example")
        copy_example.clicked.connect(self.copy_example)
        self.traffic_button = QPushButton("Open traffic view")
        self.traffic_button.clicked.connect(self.traffic_open_clicked)
        compact(self.start_button, self.stop_button, self.stop_now_button, copy_url, copy_example, self.traffic_button)
        bottom = QHBoxLayout()
        bottom.addWidget(copy_example)
        bottom.addStretch(1)
        bottom.addWidget(self.traffic_button)

        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.status)
        layout.addLayout(url_row)
        self.defaults = QLabel()
        self.defaults.setWordWrap(True)
        self.defaults.setToolTip("What a request that leaves these out gets (the model's generation_config, "
                                 "else OpenAI's defaults).")
        layout.addWidget(self.defaults)
        layout.addWidget(self.examples, 1)
        layout.addLayout(bottom)

        session.job_started.connect(self._on_started)
        session.job_events.connect(self._on_events)
        session.job_finished.connect(self._on_finished)
        session.job_failed.connect(self._on_failed)
        session.queue_changed.connect(self._on_queue_changed)
        self.set_model(None)

    # -- state ------------------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        """A server job exists (waiting, starting, serving or stopping)."""
        return self.job is not None

    def set_model(self, name: str | None) -> None:
        """The loaded model's name (``None``: none loaded, nothing to serve)."""
        self._model_name = name
        self._update()

    def _update(self) -> None:
        idle = self.job is None
        self.start_button.setEnabled(idle and self._model_name is not None)
        self.start_button.setToolTip("" if self._model_name else "Load a model first.")
        for field in self._fields:
            field.setEnabled(idle)
        self.stop_button.setEnabled(self.started is not None)
        self.stop_now_button.setEnabled(not idle)
        self.examples.setEnabled(self.started is not None)

    def _settings(self):
        from engine.serve.server import ServeSettings  # lazy: uvicorn loads when a server starts

        budget = self.kv_budget.text().strip()
        return ServeSettings(host=self.host.text().strip(), port=self.port.value(),
                             api_key=self.api_key.text() or None, max_batch=self.max_batch.value(),
                             kv_budget_bytes=None if budget.lower() in ("", "auto") else parse_size(budget),
                             default_max_tokens=self.default_max_tokens.value() or None,
                             prefix_caching=self.prefix_caching.isChecked(),
                             batch_invariant=self.batch_invariant.isChecked()).validated()

    @Slot()
    def start(self) -> None:
        if self.job is not None or self._model_name is None:
            return
        try:
            settings = self._settings()
        except EngineError as exc:
            self._say(str(exc), error=True)
            return
        self.log.clear()
        self._job = ServeJob(settings)
        self.job = self.session.submit(self._job)
        self._say("Starting…")
        self._update()
        self.state_changed.emit()

    def stop(self, now: bool = False) -> None:
        if self.job is None:
            return
        if now:
            self._job.stop_now.cancel()
        self._stopping = True
        self.session.cancel(self.job)
        running, waiting = self.log.in_core()
        self._say("Stopping: cancelling the requests in flight…" if now else
                  f"Stopping: finishing {running + waiting} requests in flight, taking no new ones…")

    def copy_example(self) -> None:
        view = self.examples.currentWidget()
        QGuiApplication.clipboard().setText(view.toPlainText())

    def _say(self, text: str, error: bool = False) -> None:
        self.status.setText(text)
        self.status.setProperty("severity", "error" if error else "info")
        self.status.style().unpolish(self.status)
        self.status.style().polish(self.status)

    # -- the job's signals ----------------------------------------------------------------------
    @Slot()
    def _on_queue_changed(self) -> None:
        if self.job is not None and self.job in self.session.waiting():
            running = self.session.describe(self.session.running)
            self._say(f"Waiting for the {running or 'job before it'} to finish…")

    @Slot(int)
    def _on_started(self, job_id: int) -> None:
        if job_id == self.job:
            self._say("Starting…")

    @Slot(int, object)
    def _on_events(self, job_id: int, events: tuple) -> None:
        if job_id != self.job:
            return
        for event in events:
            if isinstance(event, Tagged):  # the window's own requests: the session hands them to it
                continue
            if isinstance(event, ServerStarted):
                self.started = event
                self.url.setText(event.url)
                for name, text in examples(event.url, event.model_name, event.api_key).items():
                    self._example_views[name].setPlainText(text)
                self.defaults.setText((event.defaults.describe() if event.defaults is not None else "")
                                      + (f"\n{event.kv}" if event.kv else ""))
                self._update()
                self.state_changed.emit()
            else:
                self.log.add(event)
        if self.started is not None and not self._stopping:
            self._say(self.summary())

    def summary(self) -> str:
        running, waiting = self.log.in_core()
        return (f"Serving {self.started.model_name} at {self.started.url} · {running} running · {waiting} waiting · "
                f"{self.log.finished} served")

    @Slot(int, object)
    def _on_finished(self, job_id: int, result: Served) -> None:
        if job_id == self.job:
            self._ended(f"Stopped after {result.requests} requests: no port is open.")

    @Slot(int, object)
    def _on_failed(self, job_id: int, exc: Exception) -> None:
        if job_id == self.job:
            self._ended(f"The server could not run: {exc}", error=True)

    def _ended(self, message: str, error: bool = False) -> None:
        self.job, self._job, self.started, self._stopping = None, None, None, False
        self.url.clear()
        self.defaults.clear()
        for view in self._example_views.values():
            view.clear()
        self._say(message, error)
        self._update()
        self.state_changed.emit()
