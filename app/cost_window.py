"""Cost Explorer: predict memory, the decode speed ceiling and $ per 1M tokens for a model on a
piece of hardware, and put the measured runs on the same charts."""

from __future__ import annotations

import html

from PySide6.QtGui import QGuiApplication
from PySide6.QtCore import Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (QComboBox, QDialog, QDockWidget, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QMainWindow, QPushButton, QSlider, QSpinBox, QVBoxLayout, QWidget)

from app.background import Background
from app.hardware_dialog import HardwareDialog
from app.screen import fit_screen, scrolling
from app.widgets.cost_charts import BATCHES, CONTEXTS, CostCharts
from app.widgets.cost_serving import ServingSection
from app.worker import ModelSession
from engine.base.errors import EngineError
from engine.base.units import format_bytes, format_count, format_seconds
from engine.estimates import costs, hardware
from engine.estimates.costs import ALL_PRECISIONS, KV_DTYPES
from engine.estimates.estimate import DEFAULT_HUB_ID, config_for, count_parameters, shipped_models
from engine.estimates.parallel import plan_tensor_parallel
from engine.jobs import MeasureJob
from engine.models.loading import LoadRequest
from engine.models.precision import PRECISIONS, get_precision, kv_cache_dtype
from engine.storage.history import RunRecord, load_all

__all__ = ["BATCHES", "CONTEXTS", "CostWindow"]


MEASURED_KV = frozenset({"fp32", "bf16", "fp16", "int8"})
"""The cost model's KV dtypes this app runs (``--kv-dtype``'s names too); fp8 and int4 are predicted only."""


class CostWindow(QMainWindow):
    """View → Cost explorer…"""

    updated = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("costWindow")
        self.setWindowTitle("Inference Workbench — Cost explorer")
        self._closing = False
        self._config = None
        self._count = None
        self._configs: dict[str, tuple] = {}  # model ref -> (config or None, its parameter count)
        self._reading: set[str] = set()  # refs whose config is being read off the GUI thread
        self._read_errors: dict[str, BaseException] = {}  # a read that failed: said once, read again next time
        self.background = Background(self)
        self.estimate: costs.Estimate | None = None
        self.records: list[RunRecord] = []
        self.profiles: dict[str, hardware.Hardware] = {}

        self.model = QComboBox()
        self.model.setEditable(True)
        self.model.setObjectName("costModel")
        self.model.addItem("default (SmolLM2-135M-Instruct)", "default")
        for hub_id in shipped_models():
            self.model.addItem(hub_id, hub_id)
        self.model.setToolTip("A shipped config, the default model, a model folder, or a hub id in the HF cache")
        self.hardware = QComboBox()
        self.hardware.setObjectName("costHardware")
        self.precision = QComboBox()
        for name in ALL_PRECISIONS:
            self.precision.addItem(name, name)
        self.precision.setCurrentIndex(self.precision.findData("bf16"))
        # a measured precision's entry grows (its perplexity and KLD): the box keeps its width
        self.precision.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.precision.setMinimumContentsLength(10)
        self.kv_dtype = QComboBox()
        for name in KV_DTYPES:
            self.kv_dtype.addItem(name, name)
        self.kv_dtype.setCurrentIndex(self.kv_dtype.findData("bf16"))
        self.context = QSlider(Qt.Horizontal)
        self.context.setObjectName("contextSlider")
        self.context.setRange(0, len(CONTEXTS) - 1)
        self.context.setValue(CONTEXTS.index(4096))
        self.batch = QSlider(Qt.Horizontal)
        self.batch.setObjectName("batchSlider")
        self.batch.setRange(0, len(BATCHES) - 1)
        self.context_label, self.batch_label = QLabel(), QLabel()
        self.prefix = QSpinBox()
        self.prefix.setObjectName("sharedPrefix")
        self.prefix.setRange(0, 1_000_000)
        self.prefix.setSingleStep(128)
        self.prefix.setSuffix(" tokens")
        self.prefix.setSpecialValueText("none")
        self.prefix.setToolTip("Tokens every sequence of the batch begins with (a system prompt): a serving engine "
                               "that shares KV blocks (vLLM, SGLang) holds them once. The KV chart shows the batch "
                               "with and without sharing them.")
        self.training = QLineEdit()
        self.training.setPlaceholderText("training tokens, e.g. 15e12")
        self.serving = ServingSection(self.background, self.schedule_update)
        edit = QPushButton("Edit hardware…")
        edit.clicked.connect(self.edit_hardware)
        self.numbers = QLabel()
        self.numbers.setObjectName("costNumbers")
        self.numbers.setWordWrap(True)
        self.numbers.setTextFormat(Qt.RichText)
        self.numbers.setTextInteractionFlags(Qt.TextSelectableByMouse)

        form = QFormLayout()
        form.addRow("Model", self.model)
        hw_row = QHBoxLayout()
        hw_row.addWidget(self.hardware, 1)
        hw_row.addWidget(edit)
        form.addRow("Hardware", hw_row)
        form.addRow("Precision", self.precision)
        form.addRow("KV-cache dtype", self.kv_dtype)
        for label, slider, value in (("Context", self.context, self.context_label),
                                     ("Batch", self.batch, self.batch_label)):
            row = QHBoxLayout()
            row.addWidget(slider, 1)
            row.addWidget(value)
            form.addRow(label, row)
        form.addRow("Shared prefix", self.prefix)
        form.addRow("Training tokens", self.training)
        self.serving.add_rows(form)
        self.measure_button = QPushButton("Measure here")
        self.measure_button.setObjectName("measureButton")
        self.measure_button.clicked.connect(self.measure)
        self.measure_status = QLabel("")
        self.measure_status.setObjectName("measureStatus")
        self.measure_status.setWordWrap(True)
        measure_row = QHBoxLayout()
        measure_row.addWidget(self.measure_button)
        measure_row.addWidget(self.measure_status, 1)
        form.addRow(measure_row)
        self.session = None
        """The model a measured run loads (its own worker thread, made at the first *Measure here*)."""
        self._measuring: MeasureJob | None = None
        """The run *Measure here* asked for (its context fixed at the click), until it ends."""
        self._measure_job: int | None = None
        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.addLayout(form)
        self.numbers.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        figures = QWidget()
        figures_layout = QVBoxLayout(figures)
        figures_layout.setContentsMargins(0, 0, 0, 0)
        figures_layout.addWidget(self.numbers)
        figures_layout.addWidget(self.serving.label)
        figures_layout.addStretch(1)
        side_layout.addWidget(scrolling(figures), 1)  # the button below stays in view on a short screen
        self.plan = None
        self.copy_command = QPushButton("Copy the vLLM command")
        self.copy_command.setEnabled(False)
        self.copy_command.clicked.connect(self.copy_vllm_command)
        self.copy_sglang = QPushButton("Copy the SGLang command")
        self.copy_sglang.setEnabled(False)
        self.copy_sglang.clicked.connect(self.copy_sglang_command)
        copy_row = QHBoxLayout()
        copy_row.addWidget(self.copy_command)
        copy_row.addWidget(self.copy_sglang)
        side_layout.addLayout(copy_row)
        dock = QDockWidget("Model and hardware", self)
        dock.setObjectName("cost_dock_controls")
        dock.setWidget(side)
        self.addDockWidget(Qt.LeftDockWidgetArea, dock)

        self.charts = CostCharts()
        self.charts.ready.connect(self.schedule_update)
        self.charts.drawn.connect(self.updated)
        self.setCentralWidget(self.charts)
        self.serving.place, self.serving.request_for = self.charts.place, self.measure_request

        for widget in (self.model, self.hardware, self.precision, self.kv_dtype):
            widget.currentIndexChanged.connect(self.schedule_update)
        self.model.lineEdit().editingFinished.connect(self.schedule_update)
        self.context.valueChanged.connect(self.schedule_update)
        self.batch.valueChanged.connect(self.schedule_update)
        self.prefix.valueChanged.connect(self.schedule_update)
        self.training.editingFinished.connect(self.schedule_update)
        self._pending = QTimer(self)
        self._pending.setSingleShot(True)
        self._pending.setInterval(30)
        self._pending.timeout.connect(self.update_view)
        self.resize(fit_screen(1500, 950))
        # this machine's profile may need measuring (both cores, ~1 s, once): after the charts are
        # made, so the measurement doesn't compete with building the window
        self.charts.ready.connect(self.reload_hardware)
        self.reload_history()

    # -- inputs --------------------------------------------------------------------------
    def reload_hardware(self) -> None:
        """Read the profiles off the GUI thread: "this machine" is measured (a few seconds) the
        first time on a new computer."""
        self.background.submit(hardware.profiles, self._show_profiles, self._show_failure)

    def _show_profiles(self, profiles) -> None:
        current = self.hardware.currentData()
        self.hardware.blockSignals(True)
        self.hardware.clear()
        self.profiles = {p.id: p for p in profiles}
        for profile in self.profiles.values():
            self.hardware.addItem(profile.name, profile.id)
        index = self.hardware.findData(current or hardware.THIS_MACHINE)
        self.hardware.setCurrentIndex(max(index, 0))
        self.hardware.blockSignals(False)
        self.schedule_update()

    def reload_history(self) -> None:
        self.background.submit(load_all, self._show_history, self._show_failure)

    def _show_history(self, records: list[RunRecord]) -> None:
        self.records = records
        self.schedule_update()

    def _show_failure(self, exc: BaseException) -> None:
        self.numbers.setText(f"<span style='color:#c0392b'>{exc}</span>")

    def set_model(self, ref: str, precision: str | None = None, kv_dtype: str | None = None) -> None:
        """Show ``ref`` at ``precision``; ``kv_dtype`` (a torch dtype name, as a loaded model
        reports it): the KV cache's dtype it runs with, so the figures are the run's."""
        index = self.model.findData(ref)
        if index < 0:
            self.model.addItem(ref, ref)
            index = self.model.count() - 1
        self.model.setCurrentIndex(index)
        if precision:
            self.precision.setCurrentIndex(self.precision.findData(precision))
        kv = costs.kv_dtype_name(kv_dtype or "")
        if kv:
            self.kv_dtype.setCurrentIndex(self.kv_dtype.findData(kv))
        self.schedule_update()

    def model_ref(self) -> str:
        index, text = self.model.currentIndex(), self.model.currentText().strip()
        return (self.model.itemData(index) if index >= 0 and self.model.itemText(index) == text else text) or "default"

    def schedule_update(self) -> None:
        if not self._closing:  # closing moves focus, and the model box then says "edited"
            self.charts.cancel()
            self._pending.start()

    # -- the model of costs ---------------------------------------------------------------
    def _config_for_current(self) -> bool:
        """Whether the current model's config is known (it may be None: not on this machine);
        if not, it is being read off the GUI thread and the view updates when it arrives."""
        ref = self.model_ref()
        if ref in self._configs:
            self._config, self._count = self._configs[ref]
            return True
        if ref in self._read_errors:
            return True
        if ref not in self._reading:
            self._reading.add(ref)
            self.background.submit(lambda: _read_config(ref), lambda found: self._config_read(ref, found),
                                   lambda exc: self._config_failed(ref, exc))
        return False

    def _config_read(self, ref: str, found: tuple) -> None:
        self._reading.discard(ref)
        self._configs[ref] = found
        self.schedule_update()

    def _config_failed(self, ref: str, exc: BaseException) -> None:
        """Reading the config raised: not the same as a config this machine lacks, so it isn't
        kept as one; the next update reads it again."""
        self._reading.discard(ref)
        self._read_errors[ref] = exc
        self.schedule_update()

    @Slot()
    def update_view(self) -> None:
        context = CONTEXTS[self.context.value()]
        batch = BATCHES[self.batch.value()]
        self.context_label.setText(f"{context:,} tokens")
        self.batch_label.setText(f"{batch}")
        self.serving.stale()  # until this choice's figures are known
        if not self.charts.built:
            return  # the charts are being made; they ask for an update when they are ready
        if not self.profiles or not self._config_for_current():
            waiting = [] if self.profiles else ["measuring this machine (a few seconds, the first time)"]
            if self.model_ref() in self._reading:
                waiting.append(f"reading the config of {self.model_ref()}")
            self.numbers.setText("<i>" + "; ".join(waiting).capitalize() + "…</i>")
            return
        error = self._read_errors.pop(self.model_ref(), None)
        if error is not None:
            self.estimate = None
            self.numbers.setText(f"<span style='color:#c0392b'>Could not read the config of {self.model_ref()!r}: "
                                 f"{html.escape(str(error))}. Change any setting to read it again.</span>")
            self.updated.emit()
            return
        config = self._config
        if config is None:
            self.estimate = None
            self.numbers.setText(f"<span style='color:#c0392b'>No config for {self.model_ref()!r} on this machine: "
                                 "pick a shipped one, a model folder, or a hub id in the HF cache.</span>")
            self.updated.emit()
            return
        profile = self.profiles[self.hardware.currentData()]
        try:
            training = float(self.training.text()) if self.training.text().strip() else None
        except ValueError:
            training = None
        try:
            self.estimate = costs.estimate(config, profile, self.precision.currentData(), self.kv_dtype.currentData(),
                                           context, batch, training, self.model_ref(), self._count)
        except EngineError as exc:
            self.numbers.setText(f"<span style='color:#c0392b'>{exc}</span>")
            return
        self._write_numbers(profile)
        self.serving.update(self.estimate, profile, self._gpus(profile), self.prefix.value())
        self._show_quality()
        # one chart per event-loop turn; ``updated`` follows the last (charts.drawn)
        self.charts.draw(self.estimate, config, profile, self._points(config, profile), self.kv_dtype.currentData(),
                         self._count, loads=self._loads(), gpus=self._gpus(profile), prefix=self.prefix.value())

    def _show_quality(self) -> None:
        """Each precision in the list says its measured quality where the history has it (Compare's
        Quality run, or ``inference-workbench perplexity``, on this model): the latest of each."""
        measured = {}
        for r in self.records:
            if r.kind == "quality" and self._count is not None and r.parameters == self._count.total:
                measured[r.precision] = r.extra.get("quality") or {}
        for i in range(self.precision.count()):
            name = self.precision.itemData(i)
            q = measured.get(name)
            text = name
            if q and q.get("perplexity") is not None:
                d = q.get("divergence")
                text = (f"{name} · measured: perplexity {q['perplexity']:.2f}"
                        + (f", KLD {d['kld_mean']:.4f} vs {d['reference']}" if d else ""))
            if self.precision.itemText(i) != text:
                self.precision.setItemText(i, text)

    def _prefix_rows(self, e, profile) -> list[tuple[str, str]]:
        """What a shared prefix saves at this batch (the KV chart draws it at every context)."""
        prefix = self.prefix.value()
        if not prefix:
            return []
        config = self._config
        unshared, shared = costs.shared_prefix_kv(
            lambda n: costs.estimate(config, profile, e.precision, e.kv_dtype, n, 1, None, e.model,
                                     self._count).kv_bytes_total, e.context, e.batch, prefix)
        saved = unshared - shared
        return [("Shared prefix", f"{min(prefix, e.context):,} tokens held once instead of {e.batch}×: KV "
                                  f"{format_bytes(shared)} instead of {format_bytes(unshared)}, "
                                  f"{format_bytes(saved)} saved ({saved / unshared:.0%}) in a paged cache "
                                  "that shares blocks (vLLM, SGLang, and the workbench's *-fast precisions); "
                                  "its reference precisions copy a cached prefix (saving its compute, not its "
                                  "memory)")]

    def _points(self, config, profile) -> list[RunRecord]:
        """Measured runs of this model (same parameter count), precision, KV-cache bytes a token (the
        KV-cache dtype's, where the run kept it: an int8 cache's run is not drawn against a 16-bit
        prediction) and hardware;
        plain decoding only (a speculative run is not bound by this ceiling; a served request's batch
        changed under it, step by step) and no run that ended in an error."""
        per_token = costs.estimate(config, profile, self.precision.currentData(), self.kv_dtype.currentData(), 1, 1,
                                   None, "", self._count).kv_bytes_per_token
        return [r for r in self.records if r.parameters == self._count.total and r.hardware == profile.id
                and r.precision == self.precision.currentData() and r.kv_bytes_per_token in (None, per_token)
                and r.kind not in ("speculative", "served", "quality") and not r.extra.get("error")]

    def _loads(self) -> list[RunRecord]:
        """Load sweeps (``inference-workbench load``, the traffic view) against servers of this model,
        matched by name (a server says ``meta-llama/Llama-3.1-70B-Instruct`` or a short name)."""
        wanted = _short_name(DEFAULT_HUB_ID if self.model_ref() == "default" else self.model_ref())
        return [r for r in self.records if r.kind == "load" and r.extra.get("aggregate_tokens_per_s")
                and _short_name(r.model) == wanted]

    def _gpus(self, profile) -> int:
        """GPUs the load points are measured against: the plan's, past one GPU."""
        plan = self._plan(profile)
        return plan.chosen.gpus if plan is not None and plan.chosen is not None else 1

    def _write_numbers(self, profile) -> None:
        e = self.estimate
        runs = self._points(self._config, profile)
        ridge = ("never at this context (each sequence's KV reads grow as fast as its compute)"
                 if e.ridge_batch is None else f"from batch {e.ridge_batch:,.0f}")
        rows = [
            ("Parameters", f"{format_count(e.parameters)} ({e.parameters:,})"),
            ("Weights", f"{format_bytes(e.weights_bytes)} in {e.precision}"
                        + (f"; a decode step reads {format_bytes(e.weights_read_bytes)} of them ({costs.TABLE_LOOKUP})"
                           if e.weights_read_bytes < e.weights_bytes else "")),
            ("KV cache", f"{format_bytes(e.kv_bytes_per_token)} per token ({e.kv_dtype}); "
                         f"{format_bytes(e.kv_bytes_total)} for {e.batch} × {e.context:,} tokens"),
            *self._prefix_rows(e, profile),
            ("Activations", f"{format_bytes(e.activation_bytes)} in a decode step of the batch (reading a prompt's "
                            "chunk needs more while it lasts)"),
            ("Total", f"{format_bytes(e.total_bytes)} of {format_bytes(e.device_memory_bytes)}: "
                      + ("<b style='color:#27ae60'>fits</b>" if e.fits else "<b style='color:#c0392b'>does not fit</b>")),
            ("Decode ceiling", f"{e.decode_tokens_per_s_ceiling:,.1f} tok/s in all, {e.per_request_tokens_per_s:,.1f} "
                               f"per request ({e.bound}-bound)"),
            ("Compute-bound", ridge),
            ("Prefill", f"{e.context:,} tokens ≈ {format_seconds(e.prefill_s)} at peak FLOP/s"),
            ("$ per 1M tokens", _money(e.usd_per_million_tokens, e.fits, profile.usd_per_hour, "$ / hour")),
            ("Wh per 1M tokens", _money(e.wh_per_million_tokens, e.fits, profile.watts, "watts")),
        ]
        if e.training_breakeven_tokens:
            rows.append(("Training", f"{e.training_flops:.2e} FLOPs = serving {e.training_breakeven_tokens:.2e} tokens"))
        if runs:
            last = runs[-1]
            predicted = costs.estimate(self._config, profile, e.precision, e.kv_dtype, max(last.context - 1, 1),
                                       max(last.batch, 1), None, "", self._count)  # its batch: every sequence's KV
            predicted_bytes = predicted.weights_bytes + predicted.kv_bytes_total
            measured = last.weights_bytes + last.kv_cache_bytes
            rows.append(("Last run", f"weights + KV{f' of {last.batch} sequences' if last.batch > 1 else ''} "
                                     f"measured {format_bytes(measured)}, predicted "
                                     f"{format_bytes(predicted_bytes)} ({100 * (predicted_bytes - measured) / measured:+.2f}%)"))
        plan = self._plan(profile)
        if plan is not None:
            rows += _plan_rows(plan)
        self._offer_commands(profile, plan)
        self.plan = plan
        sources = profile.sources or {}
        self.numbers.setText(
            "<table cellspacing=3>" + "".join(f"<tr><td><b>{k}</b></td><td>{v}</td></tr>" for k, v in rows) + "</table>"
            + f"<p><b>{profile.name}</b>: {profile.bandwidth_bytes_per_s / 1e9:,.0f}&nbsp;GB/s "
              f"<small>({sources.get('bandwidth_bytes_per_s', '')})</small>, {profile.bf16_flops / 1e12:,.1f}&nbsp;TFLOP/s "
              f"<small>({sources.get('bf16_flops', '')})</small></p>")

    def _plan(self, profile):
        """The tensor-parallel plan on this GPU (engine/estimates/parallel.py), or ``None`` on a CPU or
        Apple profile."""
        if profile.kind != "gpu":
            return None

        e = self.estimate
        try:
            return plan_tensor_parallel(self._config, profile, e.precision, e.kv_dtype, e.context, e.batch,
                                        model=self.model_ref(), token_budget=self.serving.token_budget.value())
        except EngineError:
            return None

    def _offer_commands(self, profile, plan) -> None:
        """The copy buttons: usable where a GPU plan fits, else greyed with the reason in their tooltip."""
        if profile.kind != "gpu":
            why = (f"{profile.name} is not a GPU: vLLM and SGLang serve on GPUs. Pick a GPU profile to get "
                   "their commands (this machine serves with Serve in the main window).")
        elif plan is None or plan.chosen is None:
            why = "No tensor-parallel size up to 8 fits: a smaller precision, a shorter context or a smaller batch."
        else:
            why = ""
        for button, name in ((self.copy_command, "vLLM"), (self.copy_sglang, "SGLang")):
            button.setEnabled(not why)
            button.setToolTip(why or f"Serve this model, context and batch with {name} on as many of these GPUs as "
                                     "it needs (the plan above).")

    def copy_vllm_command(self) -> None:
        if self.plan is not None and self.plan.vllm_command:
            QGuiApplication.clipboard().setText(self.plan.vllm_command)

    def copy_sglang_command(self) -> None:
        if self.plan is not None and self.plan.sglang_command:
            QGuiApplication.clipboard().setText(self.plan.sglang_command)

    def closeEvent(self, event) -> None:
        self._closing = True
        self._pending.stop()
        self.serving.close()  # a serving simulation under way ends at its next step
        if self.session is not None:  # a measured run stops, its model goes
            self.session.shutdown()
            self.session = None
            self._measuring = self._measure_job = None
        super().closeEvent(event)

    # -- a measured run -------------------------------------------------------------------------
    def measure_request(self) -> tuple[LoadRequest | None, str]:
        """What *Measure here* would load (the model, precision and KV-cache dtype shown, on this
        machine's CPU), or ``None`` and why not."""
        precision, kv = self.precision.currentData(), self.kv_dtype.currentData()
        if self.hardware.currentData() != hardware.THIS_MACHINE:
            return None, "Measured runs are this machine's: choose it under Hardware."
        if precision not in PRECISIONS:
            return None, f"{precision} is a GGUF format this app predicts but doesn't run."
        own = costs.kv_dtype_name(get_precision(precision).kv_dtype("cpu"))
        choice = "auto" if kv == own else kv if kv in MEASURED_KV else None
        if choice is None:
            return None, f"A {kv} KV cache is predicted here, not run."
        try:  # another KV dtype than the precision's own is the fast path's choice
            kv_cache_dtype(get_precision(precision), "cpu", choice)
        except EngineError as exc:
            return None, str(exc)
        return LoadRequest(self.model_ref(), precision, "cpu", kv_dtype=choice), ""

    def measure(self) -> None:
        """Load what the explorer shows (in a worker of its own) and run it once at the chosen
        context; the run joins the history and its measured figures show beside the prediction."""
        request, why = self.measure_request()
        if request is None or self._measuring is not None:
            self.measure_status.setText(why)
            return
        if self.session is None:
            self.session = ModelSession("costs", self)
            self.session.loaded.connect(self._measure_loaded)
            self.session.load_failed.connect(self._measure_failed)
            self.session.job_finished.connect(self._measured)
            self.session.job_failed.connect(lambda _, exc: self._measure_failed(exc))
        self._measuring = MeasureJob(CONTEXTS[self.context.value()])
        self.measure_button.setEnabled(False)
        kv = "" if request.kv_dtype == "auto" else f", {request.kv_dtype} KV cache"
        self.measure_status.setText(f"Loading {request.model} ({request.precision}{kv})…")
        self.session.load(request)

    def _measure_loaded(self, info) -> None:
        job = self._measuring
        self.measure_status.setText(f"Reading {job.context - job.tokens:,} tokens, then {job.tokens} more…")
        self._measure_job = self.session.submit(job)

    def _measured(self, job_id: int, finished) -> None:
        if job_id != self._measure_job:
            return
        self._measuring = self._measure_job = None
        self.session.unload()  # its memory back: the run is in the history
        self.measure_button.setEnabled(True)
        self.measure_status.setText(f"Measured: {finished.prompt_tokens:,} + {finished.tokens} tokens, KV cache "
                                    f"{format_bytes(finished.kv_cache_bytes)} (see Last run below)")
        self.reload_history()

    def _measure_failed(self, exc) -> None:
        self._measuring = self._measure_job = None
        if self.session is not None:
            self.session.unload()
        self.measure_button.setEnabled(True)
        self.measure_status.setText(f"<span style='color:#c0392b'>{html.escape(str(exc))}</span>")

    def showEvent(self, event) -> None:
        self._closing = False
        super().showEvent(event)

    # -- editing hardware ---------------------------------------------------------------------
    def edit_hardware(self) -> None:
        dialog = HardwareDialog(list(self.profiles.values()), self)
        if dialog.exec() == QDialog.Accepted:
            for profile_id, values in dialog.changes().items():
                hardware.save_edit(profile_id, **values)
            self.reload_hardware()


def _short_name(model: str) -> str:
    """``org/Name-Instruct`` → ``name``: what a hub id and a served model's name share (an instruct
    tune has its base model's shape, so its load points belong on the same chart)."""
    name = model.rstrip("/").rsplit("/", 1)[-1].lower()
    return name.removesuffix("-instruct").removesuffix("-chat")


def _read_config(ref: str) -> tuple:
    """A model's config and parameter count (imports transformers, builds it on the meta device
    under the load lock: never on the GUI thread)."""
    config = config_for(ref)
    return config, (count_parameters(config) if config is not None else None)


def _money(value: float | None, fits: bool, rate: float | None, what: str) -> str:
    """A price (or energy) figure, or why there is none: never a "$0.000" that looks measured."""
    if not fits:
        return "n/a: this setup does not fit in the device's memory"
    if not rate:
        return f"n/a: no {what} for this hardware (Edit hardware… sets one)"
    if value is None:
        return "n/a"
    return f"${value:,.3f}" if what.startswith("$") else f"{value:,.0f} Wh"


def _plan_rows(plan) -> list[tuple[str, str]]:
    """The tensor-parallel plan as rows of the numbers table."""
    if plan.chosen is None:
        return [("Past one GPU", "<b style='color:#c0392b'>no tensor-parallel size up to 8 fits</b>: a smaller "
                                 "precision, a shorter context or a smaller batch")]
    o = plan.chosen
    if o.gpus == 1:
        link = "one GPU: no link traffic (nothing to all-reduce)"
    elif o.interconnect_time_s is None:
        link = "no link bandwidth in this profile"
    else:
        link = (f"{format_bytes(o.allreduce_bytes_per_token)} per token per GPU over the link "
                f"({o.interconnect_time_s * 1000:.2f} ms a step)")
    price = "" if plan.usd_per_million_tokens is None else f", ${plan.usd_per_million_tokens:,.2f} per 1M tokens"
    return [
        ("Past one GPU", f"<b>{o.gpus} GPU{'s' if o.gpus > 1 else ''}</b> with tensor parallelism: each holds weights "
                         f"{format_bytes(o.weights_per_gpu_bytes)}, KV {format_bytes(o.kv_per_gpu_bytes)}, "
                         f"activations {format_bytes(o.activation_per_gpu_bytes)} (a decode step's and a prompt "
                         f"chunk's), runtime "
                         f"{format_bytes(o.runtime_per_gpu_bytes)} = {format_bytes(o.total_per_gpu_bytes)} of "
                         f"{format_bytes(o.usable_per_gpu_bytes)} usable"),
        ("Across them", f"{link}; ceiling {o.decode_tokens_per_s_ceiling:,.1f} tok/s ({o.bound}-bound){price}"),
        ("vLLM", f"<code>{plan.vllm_command}</code>"),
        ("SGLang", f"<code>{plan.sglang_command}</code>"),
    ]
