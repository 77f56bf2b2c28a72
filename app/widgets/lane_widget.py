"""One lane of a comparison: a full configuration (model × precision × device × sampling),
its own worker thread, its live answer and metrics."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Signal, Slot
from PySide6.QtGui import QColor, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.widgets.model_panel import KV_TIP, _compact, show_served_choice
from app.worker import ModelSession
from engine.base.events import Finished, Loaded
from engine.base.request import GenerationRequest
from engine.base.sampling import SamplingParams
from engine.base.units import format_bytes, format_rate, format_seconds, kv_dtype_label
from engine.endpoint.source import is_endpoint
from engine.jobs import ScoreJob
from engine.measure.compare import LaneRun, LaneSpec
from engine.models.loading import LoadRequest
from engine.models.precision import KV_DTYPES, PRECISIONS

LANE_COLOURS = ("#2d7dd2", "#e67e22", "#27ae60", "#8e44ad")
DIFFERENT = QColor(231, 76, 60, 90)  # a token unlike lane 1's at the same position
AFTER = QColor(241, 196, 15, 45)  # after the first divergence the answers are on different paths


class LaneWidget(QFrame):
    finished = Signal(object)  # the lane, when its generation ended (well or not)
    load_ended = Signal(object)  # the lane, when a load (or its memory check) ended, loaded or not
    state_changed = Signal()
    scored = Signal(object, object, object)  # the lane, prompt ids, lane 1's answer scored by its model | None

    def __init__(self, index: int, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QFrame.StyledPanel)
        self.setObjectName(f"lane{index + 1}")
        self.index = index
        self.colour = LANE_COLOURS[index % len(LANE_COLOURS)]
        self.session = ModelSession(f"lane{index + 1}", self)
        self.run = LaneRun(LaneSpec())
        self.loaded: Loaded | None = None
        self.loaded_request: LoadRequest | None = None
        """What the loaded model was loaded with: a run uses it only while the controls still show it."""
        self._load_request: LoadRequest | None = None
        self.loading = self.generating = False
        self.job: int | None = None  # the session's id of this lane's generation
        self.score_job: int | None = None
        self.read_only = False
        self._rendered = 0  # tokens already in the output view

        title = QLabel(f"<b style='color:{self.colour}'>■ Lane {index + 1}</b>" + (" (reference)" if index == 0 else ""))
        self.source = QComboBox()
        self.source.setEditable(True)
        self.source.setObjectName("laneSource")
        self.source.addItem("default (SmolLM2-135M-Instruct)", "default")
        self.source.setToolTip("'default', a folder, a .gguf file, a hub id, or endpoint:http://HOST:PORT/v1#MODEL")
        self.endpoint_button = QPushButton("Endpoint…")
        self.endpoint_button.setObjectName("laneEndpoint")
        self.endpoint_button.setToolTip("A model served by vLLM, SGLang, llama.cpp, Ollama… in this lane")
        self.endpoint_button.clicked.connect(self.open_endpoint_dialog)
        self.endpoint_dialog = None
        self._api_key: str | None = None  # kept while the app runs, never saved
        self.precision = QComboBox()
        for name in PRECISIONS:
            self.precision.addItem(name, name)
        self.kv_dtype = QComboBox()
        self.kv_dtype.setObjectName("laneKvDtype")
        for name in KV_DTYPES:
            self.kv_dtype.addItem("KV auto" if name == "auto" else f"KV {name}", name)
        self.kv_dtype.setToolTip(KV_TIP)
        self.device = QComboBox()
        for device in ("auto", "cpu"):
            self.device.addItem(device, device)
        for combo in (self.source, self.precision, self.kv_dtype, self.device):
            _compact(combo)
        self.greedy = QCheckBox("greedy")
        self.greedy.setChecked(True)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.01, 5.0)
        self.temperature.setSingleStep(0.05)
        self.temperature.setValue(0.7)
        self.greedy.toggled.connect(lambda on: self.temperature.setEnabled(not on))
        self.temperature.setEnabled(False)
        self.load_button = QPushButton("Load")
        self.load_button.clicked.connect(lambda: self.load())
        self.unload_button = QPushButton("Unload")
        self.unload_button.clicked.connect(self.unload)
        self.status = QLabel("not loaded")
        self.status.setWordWrap(True)
        self.status.setObjectName("laneStatus")
        self.insist_button = QPushButton("Load anyway")
        self.insist_button.setObjectName("insistButton")
        self.insist_button.clicked.connect(lambda: self.load(insist=True))
        self.insist_button.hide()
        self.output = QPlainTextEdit()
        self.output.setReadOnly(True)
        self.output.setObjectName("laneOutput")
        self.output.setMinimumHeight(4 * self.output.fontMetrics().lineSpacing())
        self.metrics = QLabel("")
        self.metrics.setObjectName("laneMetrics")

        form = QFormLayout()
        source_row = QHBoxLayout()
        source_row.addWidget(self.source, 1)
        source_row.addWidget(self.endpoint_button)
        form.addRow("Model", source_row)
        # precision and device share a row, and Load/Unload sit by the title: on a laptop's short
        # screen the lane's controls left no room for its answer
        precision_row = QHBoxLayout()
        precision_row.addWidget(self.precision, 3)
        precision_row.addWidget(self.kv_dtype, 2)
        precision_row.addWidget(QLabel("on"))
        precision_row.addWidget(self.device, 2)
        form.addRow("Precision", precision_row)
        sampling = QHBoxLayout()
        sampling.addWidget(self.greedy)
        sampling.addWidget(QLabel("temperature"))
        sampling.addWidget(self.temperature)
        form.addRow("Sampling", sampling)
        heading = QHBoxLayout()
        heading.addWidget(title)
        heading.addStretch(1)
        heading.addWidget(self.load_button)
        heading.addWidget(self.unload_button)
        heading.addWidget(self.insist_button)
        layout = QVBoxLayout(self)
        layout.addLayout(heading)
        layout.addLayout(form)
        layout.addWidget(self.status)
        layout.addWidget(self.output, 1)
        layout.addWidget(self.metrics)

        s = self.session
        s.predicted.connect(self._on_predicted)
        s.load_progressed.connect(lambda e: self._set_status(f"{e.stage}: {e.message}"))
        s.loaded.connect(self._on_loaded)
        s.load_failed.connect(self._on_load_failed)
        s.unloaded.connect(self._on_unloaded)
        s.job_events.connect(self._on_job_events)
        s.job_finished.connect(self._on_job_finished)
        s.job_failed.connect(self._on_job_failed)
        for combo in (self.source, self.precision, self.kv_dtype, self.device):
            combo.currentIndexChanged.connect(self._show_idle_status)
        self.source.editTextChanged.connect(self._show_idle_status)
        self.source.currentIndexChanged.connect(lambda *_: self._update_state())
        self.source.editTextChanged.connect(lambda *_: self._update_state())
        self._update_state()

    # -- configuration ---------------------------------------------------------------
    def spec(self) -> LaneSpec:
        index, text = self.source.currentIndex(), self.source.currentText().strip()
        model = self.source.itemData(index) if index >= 0 and self.source.itemText(index) == text else text
        sampling = None if self.greedy.isChecked() else SamplingParams(temperature=self.temperature.value())
        if is_endpoint(model):  # the server's precision and device
            return LaneSpec(model=model, precision="served", device="remote", sampling=sampling)
        return LaneSpec(model=model or "default", precision=self.precision.currentData(),
                        device=self.device.currentData(), sampling=sampling,
                        kv_dtype=self.kv_dtype.currentData() or "auto")

    def open_endpoint_dialog(self) -> None:
        """A served model for this lane: URL, listed model, key (kept while the app runs, never saved)."""
        from app.endpoint_dialog import ask_for_endpoint  # lazy: the dialog is a layer above the widgets

        self.endpoint_dialog = ask_for_endpoint(self, self.spec().model, self._api_key, self._use_endpoint)

    def _use_endpoint(self, spec: str, api_key: str | None) -> None:
        self._api_key = api_key
        self.configure(LaneSpec(model=spec, precision="served", device="remote"))

    def configure(self, spec: LaneSpec) -> None:
        index = self.source.findData(spec.model)
        if index < 0:
            self.source.addItem(spec.model, spec.model)
            index = self.source.count() - 1
        self.source.setCurrentIndex(index)
        self.source.lineEdit().setCursorPosition(0)
        if is_endpoint(spec.model):
            self.greedy.setChecked(spec.sampling is None or spec.sampling.greedy)
            return
        self.precision.setCurrentIndex(self.precision.findData(spec.precision))
        self.kv_dtype.setCurrentIndex(max(0, self.kv_dtype.findData(spec.kv_dtype)))
        if self.device.findData(spec.device) < 0:
            self.device.addItem(spec.device, spec.device)
        self.device.setCurrentIndex(self.device.findData(spec.device))
        self.greedy.setChecked(spec.sampling is None or spec.sampling.greedy)
        if spec.sampling is not None and not spec.sampling.greedy:
            self.temperature.setValue(spec.sampling.temperature)

    def needs_load(self) -> bool:
        """Nothing is loaded, or the controls show another model, precision or device than the
        one loaded: a run must (re)load first so it runs what the lane shows."""
        return self.loaded is None or self.loaded_request != self._chosen_request()

    def _chosen_request(self) -> LoadRequest:
        spec = self.spec()
        return LoadRequest(spec.model, spec.precision, spec.device, api_key=self._api_key, kv_dtype=spec.kv_dtype)

    def _set_status(self, text: str, error: bool = False) -> None:
        self.status.setText(text)
        self.status.setStyleSheet("color: #c0392b;" if error else "")

    def _loaded_text(self) -> str:
        info = self.loaded
        if info.source == "endpoint":
            return f"{info.name} · served by {info.device_name} · connected in {format_seconds(info.load_s)}"
        return (f"{info.name} · {info.precision} on {info.device} · weights {format_bytes(info.weights_bytes)} · "
                f"KV cache {kv_dtype_label(info.kv_dtype)} · "
                f"loaded in {format_seconds(info.load_s)}")

    def _show_idle_status(self, *_) -> None:
        """The status line for a lane at rest: what is loaded, and whether the controls differ."""
        if self.loading or self.generating or self.read_only:
            return
        if self.loaded is None:
            self._set_status("not loaded (Run loads it)")
        elif self.needs_load():
            chosen = self._chosen_request()
            self._set_status(f"Loaded: {self.loaded.name} · {self.loaded.precision} · KV {self.loaded.kv_dtype}. "
                             f"Chosen: {chosen.model} · {chosen.precision} · KV {chosen.kv_dtype} — Run (or Load) "
                             "reloads it first.")
        else:
            self._set_status(self._loaded_text())

    # -- loading, with the memory guard ------------------------------------------------
    def load(self, insist: bool = False) -> None:
        if self.loading or self.generating or self.read_only:
            return
        request = self._chosen_request()
        self.loading = True
        self.insist_button.hide()
        self._update_state()
        if insist:
            self._start_load(request)
        else:
            self.status.setText("Predicting memory…")
            self.session.predict_requested.emit(request)

    def _start_load(self, request: LoadRequest) -> None:
        self._set_status("Loading…")
        self._load_request = request
        self.session.load(request)

    @Slot(object, object)
    def _on_predicted(self, request, prediction) -> None:
        if prediction is not None and prediction.fits is False:
            self.loading = False
            self._set_status(
                f"Needs about {format_bytes(prediction.total_bytes)} (weights {format_bytes(prediction.weights_bytes)}"
                f" + KV for {prediction.context_tokens} tokens) but {format_bytes(prediction.available_bytes)} "
                "is free: loading could swap or fail.", error=True)
            self.insist_button.show()
            self._update_state()
            self.load_ended.emit(self)
            return
        self._start_load(request)

    @Slot(object)
    def _on_loaded(self, info: Loaded) -> None:
        self.loading = False
        self.loaded = info
        self.loaded_request = self._load_request
        self._update_state()
        self._show_idle_status()
        self.load_ended.emit(self)

    @Slot(object)
    def _on_load_failed(self, exc) -> None:
        self.loading = False  # the model loaded before, if any, is still loaded (the worker keeps it)
        kept = f" Still loaded: {self.loaded.name} · {self.loaded.precision}." if self.loaded else ""
        what = "Loading was cancelled." if type(exc).__name__ == "CancelledError" else f"Could not load: {exc}"
        self._set_status(what + kept, error=True)
        self._update_state()
        self.load_ended.emit(self)

    def unload(self) -> None:
        if not self.loading and not self.generating and self.loaded is not None:
            self.session.unload()

    @Slot()
    def _on_unloaded(self) -> None:
        self.loaded = None
        self.loaded_request = None
        self._set_status("unloaded")
        self._update_state()

    # -- generating --------------------------------------------------------------------
    def start(self, request: GenerationRequest) -> None:
        spec = self.spec()
        if spec.sampling is not None:
            request = replace(request, sampling=replace(spec.sampling, seed=request.sampling.seed))
        self.run = LaneRun(spec, loaded=_asdict(self.loaded))
        self._set_status(self._loaded_text())  # not a failure of an earlier run
        self.output.clear()
        self.metrics.setText("")
        self._rendered = 0
        self.generating = True
        self._update_state()
        self.job = self.session.ask(request)

    def stop(self) -> None:
        self.session.cancel(self.job)

    def score(self, request: GenerationRequest, token_ids) -> None:
        """Score ``token_ids`` (lane 1's answer) after ``request``'s prompt with this lane's model;
        ``scored`` follows."""
        self.score_job = self.session.submit(ScoreJob(request, tuple(token_ids)))

    @Slot(int, object)
    def _on_job_events(self, job_id: int, events) -> None:
        if job_id != self.job:
            return
        self.run.extend(events)

    @Slot(int, object)
    def _on_job_finished(self, job_id: int, result) -> None:
        if job_id == self.score_job:
            self.score_job = None
            self.scored.emit(self, None if result.prompt_ids is None else list(result.prompt_ids),
                             None if result.logprobs is None else list(result.logprobs))
        elif job_id == self.job:
            self.job = None
            self._on_finished(result)

    @Slot(int, object)
    def _on_job_failed(self, job_id: int, exc) -> None:
        if job_id == self.score_job:
            self.score_job = None
            self.scored.emit(self, [], None)
        elif job_id == self.job:
            self.job = None
            self._on_failed(exc)

    def _on_finished(self, event: Finished) -> None:
        self.run.finish(event)
        self._end()

    def _on_failed(self, exc) -> None:
        # NaN scores: the answer so far is kept, marked failed
        self.run.fail(str(exc) or type(exc).__name__, getattr(exc, "finished", None))
        self._set_status(f"Failed: {self.run.error}", error=True)
        self._end()

    def _end(self) -> None:
        self.generating = False
        self.sync()
        self._update_state()
        self.finished.emit(self)

    def sync(self) -> None:
        """Append the text that arrived since the last call, and refresh the metrics line."""
        tokens = self.run.tokens
        rendered = self._rendered
        if len(tokens) > rendered:
            cursor = QTextCursor(self.output.document())
            cursor.movePosition(QTextCursor.End)
            cursor.insertText("".join(t.text for t in tokens[rendered:] if not t.special))
            self._rendered = len(tokens)
            self.output.verticalScrollBar().setValue(self.output.verticalScrollBar().maximum())
        run, done = self.run, self.run.finished
        self.metrics.setText(f"TTFT {format_seconds(run.ttft_s())} · {format_rate(run.decode_tokens_per_s())} · "
                             f"{len(tokens)} tokens"
                             + (f" · stopped: {done.reason}" if done else ""))

    def show_divergence(self, reference: list[int] | None) -> None:
        """Re-render the answer, tinting tokens unlike lane 1's and everything after the first difference."""
        self.output.clear()
        cursor = QTextCursor(self.output.document())
        first = None
        for i, token in enumerate(self.run.tokens):
            if token.special:
                continue
            fmt = QTextCharFormat()
            if reference is not None:
                differs = i >= len(reference) or reference[i] != token.token_id
                if differs and first is None:
                    first = i
                if differs:
                    fmt.setBackground(DIFFERENT)
                elif first is not None:
                    fmt.setBackground(AFTER)
            cursor.insertText(token.text, fmt)
        self._rendered = len(self.run.tokens)

    def _update_state(self) -> None:
        busy = self.loading or self.generating or self.read_only
        for widget in (self.source, self.precision, self.kv_dtype, self.device, self.greedy, self.load_button,
                       self.endpoint_button):
            widget.setEnabled(not busy)
        show_served_choice(self.precision, self.device, is_endpoint(self.spec().model), self.kv_dtype)
        self.temperature.setEnabled(not busy and not self.greedy.isChecked())
        self.unload_button.setEnabled(not busy and self.loaded is not None)
        self.state_changed.emit()

    # -- a saved run -------------------------------------------------------------------
    def show_saved(self, run: LaneRun) -> None:
        """Show a lane of a saved comparison, read-only, with no model behind it."""
        self.read_only = True
        self.configure(run.spec)
        self.run = run
        info = run.loaded or {}
        self.loaded = None
        self.status.setText(f"saved run · {info.get('name', run.spec.model)} · {run.spec.precision} on "
                            f"{info.get('device', run.spec.device)}" + (f" · error: {run.error}" if run.error else ""))
        self.output.clear()
        self._rendered = 0
        self.sync()
        self._update_state()

    def shutdown(self) -> bool:
        return self.session.shutdown()


def _asdict(info: Loaded | None) -> dict | None:
    from dataclasses import asdict

    return None if info is None else asdict(info)
