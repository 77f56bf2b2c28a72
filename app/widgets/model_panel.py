"""Pick a model, a precision, a KV-cache dtype and a device; load it with progress and Cancel; see
its facts."""

from __future__ import annotations

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.screen import compact
from engine.base.events import LoadProgress, Loaded
from engine.base.units import format_bytes, format_count, format_seconds, kv_dtype_label
from engine.endpoint.source import is_endpoint
from engine.models.loading import LoadRequest
from engine.models.precision import KV_DTYPES, PRECISIONS

_FACTS = ("Model", "Format", "Precision", "Device", "Hardware", "Weights", "Load time", "Architecture", "Parameters",
          "Context", "Layers · KV heads · head dim", "KV per token")


def _compact(combo: QComboBox) -> None:
    """Let a combo box be narrower than its longest entry (the popup still shows it whole)."""
    combo.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
    combo.setMinimumContentsLength(10)


class ModelPanel(QWidget):
    load_clicked = Signal(object)  # LoadRequest
    unload_clicked = Signal()
    cancel_clicked = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.source = QComboBox()
        self.source.setObjectName("modelSource")
        self.source.setEditable(True)
        self.source.setInsertPolicy(QComboBox.NoInsert)
        self.source.setToolTip("'default', a folder, a .gguf file or a hub id (org/name)")
        self.source.addItem("SmolLM2-135M-Instruct (default)", "default")
        browse_folder = QPushButton("Folder…")
        browse_folder.clicked.connect(self._browse_folder)
        browse_gguf = QPushButton("GGUF…")
        browse_gguf.clicked.connect(self._browse_gguf)
        browse_endpoint = QPushButton("Endpoint…")
        browse_endpoint.setObjectName("endpointButton")
        browse_endpoint.setToolTip("A model served by vLLM, SGLang, llama.cpp, Ollama… (an OpenAI-compatible API)")
        browse_endpoint.clicked.connect(self.open_endpoint_dialog)
        self._api_key: str | None = None  # an endpoint's key as typed: kept while the app runs, never saved
        self.endpoint_dialog = None
        self.remembered_endpoint = ""
        self.last_local = ""
        """The last local model loaded (what the next launch loads when an endpoint was chosen last)."""
        """The served model chosen last time (its URL and name; the dialog opens on it)."""
        self.precision = QComboBox()
        self.precision.setObjectName("precision")
        for name, precision in PRECISIONS.items():
            self.precision.addItem(precision.label, name)
        self.kv_dtype = QComboBox()
        self.kv_dtype.setObjectName("kvDtype")
        for name in KV_DTYPES:
            self.kv_dtype.addItem(KV_LABELS.get(name, name), name)
        self.kv_dtype.setToolTip(KV_TIP)
        self.device = QComboBox()
        self.device.setObjectName("device")
        self.device.addItem("auto (cuda > mps > cpu)", "auto")
        self.device.addItem("cpu", "cpu")
        self._loading = False
        self.load_button = QPushButton("Load")
        self.load_button.setObjectName("loadButton")
        self.load_button.clicked.connect(lambda: self.load_clicked.emit(self.request()))
        self.unload_button = QPushButton("Unload")
        self.unload_button.clicked.connect(self.unload_clicked)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("cancelLoadButton")
        self.cancel_button.clicked.connect(self.cancel_clicked)
        # code-running formats: off by default, a warning before each is turned on, never saved
        self.allow_pickle = QCheckBox("Allow pickle checkpoints (.bin)")
        self.allow_pickle.setObjectName("allowPickle")
        self.allow_pickle.setToolTip("Pickle files can run any code when read. Only for models you trust.")
        self.trust_remote_code = QCheckBox("Trust remote code")
        self.trust_remote_code.setObjectName("trustRemoteCode")
        self.trust_remote_code.setToolTip("Runs Python code shipped with the model. Only for models you trust.")
        for box, what in ((self.allow_pickle, "Reading a pickle checkpoint (.bin) can run any code hidden in it."),
                          (self.trust_remote_code, "Trusting remote code runs the Python files that come with "
                                                   "the model, with your permissions.")):
            box.toggled.connect(lambda on, box=box, what=what: self._confirm_unsafe(box, what) if on else None)
        self.progress = QProgressBar()
        self.progress.setObjectName("loadProgress")
        self.progress.setTextVisible(True)
        self.stage = QLabel("")
        self.stage.setWordWrap(True)
        self.pending_label = QLabel("")
        self.pending_label.setObjectName("pendingChoice")
        self.pending_label.setWordWrap(True)
        self.pending_label.hide()
        self.loaded_request: LoadRequest | None = None
        self.loaded_info: Loaded | None = None
        """What the loaded model was loaded with (``None`` when nothing is loaded)."""

        browse_row = QHBoxLayout()  # under the name, so a long name keeps the whole width
        browse_row.addWidget(browse_folder)
        browse_row.addWidget(browse_gguf)
        browse_row.addWidget(browse_endpoint)
        browse_row.addStretch(1)
        form = QFormLayout()
        form.addRow("Model", self.source)
        form.addRow("", browse_row)
        form.addRow("Precision", self.precision)
        form.addRow("KV cache", self.kv_dtype)
        form.addRow("Device", self.device)
        unsafe = QVBoxLayout()  # one above the other: side by side they set the panel's width
        unsafe.addWidget(self.allow_pickle)
        unsafe.addWidget(self.trust_remote_code)
        form.addRow(unsafe)
        compact(browse_folder, browse_gguf, browse_endpoint, self.load_button, self.unload_button, self.cancel_button)
        buttons = QHBoxLayout()
        buttons.addWidget(self.load_button)
        buttons.addWidget(self.unload_button)
        buttons.addWidget(self.cancel_button)
        facts_box = QGroupBox("Loaded model")
        facts = QGridLayout(facts_box)
        facts.setColumnStretch(1, 1)
        self.facts: dict[str, QLabel] = {}
        for row, name in enumerate(_FACTS):
            label = QLabel("—")
            label.setObjectName("factValue")
            label.setWordWrap(True)
            self.facts[name] = label
            facts.addWidget(QLabel(name), row, 0, Qt.AlignLeft | Qt.AlignTop)
            facts.addWidget(label, row, 1)
        for combo in (self.source, self.precision, self.kv_dtype, self.device):
            _compact(combo)
        self.source.currentIndexChanged.connect(lambda *_: self.source.setToolTip(
            f"{self.source.currentText()}\n\n'default', a folder, a .gguf file or a hub id (org/name)"))
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.pending_label)
        layout.addWidget(self.progress)
        layout.addWidget(self.stage)
        layout.addWidget(facts_box)
        layout.addStretch(1)
        self._facts_box = facts_box
        self.set_loading(False, loaded=False)
        self.source.currentIndexChanged.connect(self._update_pending)
        self.source.editTextChanged.connect(self._update_pending)
        self.precision.currentIndexChanged.connect(self._update_pending)
        self.kv_dtype.currentIndexChanged.connect(self._update_pending)
        self.device.currentIndexChanged.connect(self._update_pending)

    def controls_height(self) -> int:
        """Height that shows every control down to Load and Unload, and the note under them (the
        loaded model's facts below may scroll): what the window gives this panel first."""
        layout = self.layout()
        margins = layout.contentsMargins()
        height = margins.top() + margins.bottom()
        for i in range(layout.count()):
            item = layout.itemAt(i)
            if item.widget() is self._facts_box:
                break
            widget = item.widget()
            if widget is not None and widget.isHidden():
                continue
            height += item.sizeHint().height() + layout.spacing()
        return height

    # -- choices ---------------------------------------------------------------------
    def request(self) -> LoadRequest:
        index = self.source.currentIndex()
        text = self.source.currentText().strip()
        data = self.source.itemData(index) if index >= 0 and self.source.itemText(index) == text else None
        if is_endpoint(data or text):  # the server's precision and device: nothing to choose here
            return LoadRequest(model=data or text, precision="served", device="remote", api_key=self._api_key)
        return LoadRequest(model=data or text, precision=self.precision.currentData(),
                           device=self.device.currentData() or "auto", kv_dtype=self.kv_dtype.currentData() or "auto",
                           allow_pickle=self.allow_pickle.isChecked(),
                           trust_remote_code=self.trust_remote_code.isChecked())

    confirm = staticmethod(lambda parent, text: QMessageBox.warning(
        parent, "Run code from a model?", text, QMessageBox.Yes | QMessageBox.Cancel, QMessageBox.Cancel)
        == QMessageBox.Yes)
    """Asks the user (tests replace it)."""

    def _confirm_unsafe(self, box: QCheckBox, what: str) -> None:
        if not self.confirm(self, f"{what} Only turn this on for a model from a source you trust. Turn it on?"):
            box.setChecked(False)

    def set_source(self, ref: str) -> None:
        if is_endpoint(ref):
            self.remembered_endpoint = ref  # the dialog opens on it, even after the panel went back to a local model
        index = self.source.findData(ref)
        if index < 0:
            self.source.addItem(ref, ref)
            index = self.source.count() - 1
        self.source.setCurrentIndex(index)
        self.source.lineEdit().setCursorPosition(0)  # show the start of a long name

    def choose(self, request: LoadRequest) -> None:
        """Show ``request``'s model, precision, KV-cache dtype and device as the choice (what Load
        will load)."""
        self.set_source(request.model)
        self._select(self.precision, request.precision)
        self._select(self.kv_dtype, request.kv_dtype)
        if self.device.findData(request.device) < 0:
            self.device.addItem(request.device, request.device)
        self._select(self.device, request.device)

    def set_entries(self, entries) -> None:
        current = self.request().model
        for entry in entries:
            if self.source.findData(entry.ref) < 0:
                self.source.addItem(entry.name, entry.ref)
        self.set_source(current)

    def set_devices(self, devices: list[str]) -> None:
        current = self.device.currentData()
        for device in devices:
            if self.device.findData(device) < 0:
                self.device.addItem(device, device)
        self._select(self.device, current)

    @staticmethod
    def _select(combo: QComboBox, data) -> None:
        index = combo.findData(data)
        if index >= 0:
            combo.setCurrentIndex(index)

    def _browse_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Open a Hugging Face model folder")
        if folder:
            self.set_source(folder)

    def open_endpoint_dialog(self) -> None:
        """Ask for a served model's URL, name and key (window-modal, not blocking the app)."""
        from app.endpoint_dialog import ask_for_endpoint  # lazy: the dialog is a layer above the widgets

        current = self.request().model
        start = current if is_endpoint(current) else (self.remembered_endpoint or current)
        self.endpoint_dialog = ask_for_endpoint(self, start, self._api_key, self._use_endpoint)

    def _use_endpoint(self, spec: str, api_key: str | None) -> None:
        self._api_key = api_key
        self.set_source(spec)

    def _browse_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", filter="GGUF models (*.gguf)")
        if path:
            self.set_source(path)

    # -- what is loaded vs what is chosen ------------------------------------------------
    def set_loaded_request(self, request: LoadRequest | None) -> None:
        self.loaded_request = request
        if request is not None and not is_endpoint(request.model):
            self.last_local = request.model
        self._update_pending()

    def pending(self) -> bool:
        """Whether the choices differ from the loaded model (a Load would change what runs)."""
        return self.loaded_request is not None and _key(self.request()) != _key(self.loaded_request)

    def _update_pending(self, *_) -> None:
        loaded, chosen = self.loaded_request, self.request()
        served = is_endpoint(chosen.model)
        for combo in (self.precision, self.kv_dtype, self.device):
            combo.setEnabled(not served and not self._loading)  # not the button's state: the whole
            # panel is disabled while a sweep or the server runs, and isEnabled() reads that too
            combo.setToolTip("A served model runs at the server's precision, on the server's device." if served
                             else KV_TIP if combo is self.kv_dtype else "")
        show_served_choice(self.precision, self.device, served, self.kv_dtype)
        differs = {"model": False, "precision": False, "KV cache": False, "device": False}
        if loaded is not None:
            differs = {name: a != b for name, a, b in zip(differs, _key(chosen), _key(loaded))}
        for name, combo in (("model", self.source), ("precision", self.precision), ("KV cache", self.kv_dtype),
                            ("device", self.device)):
            if combo.property("pending") != differs[name]:
                combo.setProperty("pending", differs[name])
                combo.style().unpolish(combo)
                combo.style().polish(combo)
        if any(differs.values()):
            info = self.loaded_info
            now = (f"{info.name} · {info.precision} on {info.device}" if info is not None
                   else " · ".join(_key(loaded)))
            names = [name for name, value in differs.items() if value]
            changed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
            self.pending_label.setText(f"The {changed} above {'are' if ' and ' in changed else 'is'} not loaded "
                                       f"yet. Running now: {now}. Load (or Generate) switches.")
            self.pending_label.show()
        else:
            self.pending_label.hide()

    # -- state -----------------------------------------------------------------------
    def set_loading(self, loading: bool, loaded: bool, generating: bool = False) -> None:
        """``generating``: the loaded model is answering; the choices stay open (they are marked
        as not loaded yet), Load and Unload wait for it to end."""
        self._loading = loading
        self.load_button.setEnabled(not loading and not generating)
        self.unload_button.setEnabled(loaded and not loading and not generating)
        why = "The model is answering: Stop first, then load or unload." if generating else ""
        self.load_button.setToolTip(why)
        self.unload_button.setToolTip(why)
        self.cancel_button.setVisible(loading)
        self.progress.setVisible(loading)
        for widget in (self.source, self.precision, self.kv_dtype, self.device):
            widget.setEnabled(not loading)
        self._update_pending()  # a served model's precision and device stay the server's
        if loading:
            self.progress.setRange(0, 0)
            self.stage.setText("Starting…")

    def show_progress(self, event: LoadProgress) -> None:
        if event.total:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * event.done / event.total))
            if event.stage in ("download", "extract", "verify"):
                self.progress.setFormat(f"{format_bytes(event.done)} / {format_bytes(event.total)}")
            else:
                self.progress.setFormat(f"{event.done} / {event.total}")
        else:
            self.progress.setRange(0, 0)
        self.stage.setText(f"{event.stage}: {event.message}" if event.message else event.stage)

    def show_loaded(self, info: Loaded) -> None:
        self.loaded_info = info
        self.stage.setText("")
        if info.source == "endpoint":
            return self._show_facts(_served_facts(info))
        values = {
            "Model": info.name,
            "Format": info.original_format + (f"; chat template: {info.chat_template}"
                                              if info.chat_template and info.chat_template != "the model's own" else ""),
            "Precision": f"{info.precision} (compute {info.compute_dtype})",
            "Device": info.device,
            "Hardware": info.device_name,
            "Weights": format_bytes(info.weights_bytes),
            "Load time": format_seconds(info.load_s),
            "Architecture": f"{info.architecture} ({info.model_type})",
            "Parameters": f"{format_count(info.parameters)} ({info.parameters:,})",
            "Context": f"{info.context_length:,} tokens" if info.context_length else "unknown",
            "Layers · KV heads · head dim": f"{info.num_layers} · {info.num_kv_heads} · {info.head_dim}",
            "KV per token": format_bytes(info.kv_bytes_per_token)  # and what the cache keeps
                            + (f" ({kv_dtype_label(info.kv_dtype)})" if info.kv_bytes_per_token else "")
                            + {True: "; 16-token blocks, shared prefixes held once",
                               False: "; a cache per request, cached prefixes copied in"}.get(info.kv_shared, ""),
        }
        self._show_facts(values)

    def _show_facts(self, values: dict[str, str]) -> None:
        for name, value in values.items():
            self.facts[name].setText(_breakable(value))
            self.facts[name].setToolTip(value)

    def show_unloaded(self) -> None:
        self.loaded_info = None
        for label in self.facts.values():
            label.setText("—")

    # -- settings --------------------------------------------------------------------
    def save(self, settings: QSettings) -> None:
        """The choices, for the next launch. A model served elsewhere is kept apart (``model/endpoint``,
        never its key): the next launch loads the last local model, which needs no key to load."""
        model = self.request().model
        if is_endpoint(model):
            settings.setValue("model/endpoint", model)
            previous = self.last_local or settings.value("model/source", "default", type=str)
            model = "default" if is_endpoint(previous) else previous
        settings.setValue("model/source", model)
        for key, combo, served in (("model/precision", self.precision, "served"),
                                   ("model/device", self.device, "remote"),
                                   ("model/kv_dtype", self.kv_dtype, "served")):
            value = combo.currentData()
            settings.setValue(key, combo.property("localChoice") if value == served else value)

    def restore(self, settings: QSettings) -> None:
        """The saved choices: precision and device first, so a source that greys them out (a served
        model) keeps them as the local choice that comes back after it."""
        self._select(self.precision, settings.value("model/precision", "fp32", type=str))
        self._select(self.kv_dtype, settings.value("model/kv_dtype", "auto", type=str))
        device = settings.value("model/device", "auto", type=str)
        if self.device.findData(device) < 0:
            self.device.addItem(device, device)
        self._select(self.device, device)
        source = settings.value("model/source", "default", type=str)
        self.set_source("default" if is_endpoint(source) else source)  # an endpoint needs its key, never saved
        self.remembered_endpoint = settings.value("model/endpoint", "", type=str)


def show_served_choice(precision: QComboBox, device: QComboBox, served: bool,
                       kv_dtype: QComboBox | None = None) -> None:
    """While a served model is chosen, the precision, device (and KV-cache) boxes say the server's
    (disabled), never a local choice that isn't what runs; the entries go again when a local model
    is chosen."""
    boxes = [(precision, "served", "the server's"), (device, "remote", "the server's")]
    boxes += [(kv_dtype, "served", "the server's")] if kv_dtype is not None else []
    for combo, data, text in boxes:
        index = combo.findData(data)
        if served and index < 0:
            combo.blockSignals(True)
            combo.setProperty("localChoice", combo.currentData())
            combo.addItem(text, data)
            combo.setCurrentIndex(combo.count() - 1)
            combo.blockSignals(False)
        elif not served and index >= 0:
            combo.blockSignals(True)
            combo.removeItem(index)
            back = combo.findData(combo.property("localChoice"))
            if back >= 0:
                combo.setCurrentIndex(back)
            combo.blockSignals(False)
        if served:  # (not ``isEnabled() and …``: that reads the parent's state too, and a panel disabled
            combo.setEnabled(False)  # during a sweep left its boxes grey for good)


KV_LABELS = {"auto": "auto (the precision's own)", "int8": "int8 (q8_0 blocks, about half of 16-bit)",
             "fp8_e4m3": "fp8_e4m3 (GPUs with fp8)"}
KV_TIP = ("What the KV cache keeps every token's keys and values in. Fewer bits hold more tokens (a longer "
          "context, more requests at once) and read faster, at a price in quality measured in Compare's Quality "
          "tab. Other than auto, a fast precision's choice (the -fast ones).")


def _served_facts(info: Loaded) -> dict[str, str]:
    """A served model's facts: what its server says; the rest is the server's to know."""
    theirs = "n/a (the server's)"
    return {
        "Model": info.name, "Format": f"served by {info.original_format}", "Precision": "the server's",
        "Device": "remote", "Hardware": info.device_name,
        "Weights": theirs if info.weights_bytes is None else f"{format_bytes(info.weights_bytes)} (the server says)",
        "Load time": f"{format_seconds(info.load_s)} (connecting)", "Architecture": theirs,
        "Parameters": theirs if info.parameters is None else f"{format_count(info.parameters)} (the server says)",
        "Context": f"{info.context_length:,} tokens" if info.context_length else "not said by the server",
        "Layers · KV heads · head dim": theirs, "KV per token": theirs,
    }


def _key(request: LoadRequest) -> tuple[str, str, str, str]:
    return request.model, request.precision, request.kv_dtype, request.device


def _breakable(text: str) -> str:
    """``text`` with zero-width break chances after path and name separators, so a long path or
    architecture name wraps in a narrow panel instead of being cut off (the tooltip keeps it whole)."""
    for mark in ("/", "\\", "_", "-"):
        text = text.replace(mark, mark + "\u200b")
    return text
