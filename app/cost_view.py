"""Cost Explorer: predict memory, the decode speed ceiling and $ per 1M tokens for a model on a
piece of hardware, and put the measured runs on the same charts."""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDockWidget,
    QFormLayout,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QPushButton,
    QSlider,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.background import Background
from app.widgets.live_plots import PlotPanel
from app.screen import fit_screen
from engine.estimates import costs
from engine.estimates import hardware
from engine.estimates.costs import ALL_PRECISIONS, KV_DTYPES
from engine.errors import EngineError
from engine.estimates.estimate import config_for, count_parameters, shipped_models
from engine.storage.history import RunRecord, load_all
from engine.units import format_bytes, format_count

CONTEXTS = [2 ** k for k in range(7, 18)]  # 128 … 131072
BATCHES = [2 ** k for k in range(0, 12)]  # 1 … 2048
COLOURS = {"weights": "#2d7dd2", "kv": "#f39c12", "activations": "#8e44ad", "memory": "#2d7dd2",
           "compute": "#c0392b", "ceiling": "#27ae60", "measured": "#e74c3c", "device": "#7f8c8d"}


def _pen(colour: str, style=Qt.SolidLine, width: int = 1):
    return pg.mkPen(colour, width=width, style=style)


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
        self._config_ref = None
        self._configs: dict[str, tuple] = {}  # model ref -> (config or None, its parameter count)
        self._reading: set[str] = set()  # refs whose config is being read off the GUI thread
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
        self.training = QLineEdit()
        self.training.setPlaceholderText("training tokens, e.g. 15e12")
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
        form.addRow("Training tokens", self.training)
        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.addLayout(form)
        side_layout.addWidget(self.numbers, 1)
        dock = QDockWidget("Model and hardware", self)
        dock.setObjectName("cost_dock_controls")
        dock.setWidget(side)
        self.addDockWidget(Qt.LeftDockWidgetArea, dock)

        self.memory_plot = PlotPanel(
            "cost-memory", "Memory the model needs (stacked: weights, KV cache for batch × context, "
            "activations) against the device's memory (grey line); measured runs as red dots.", "memory", "")
        self.speed_plot = PlotPanel(
            "cost-speed", "Decode tokens/sec ceiling against batch: reading the weights (and KV) bounds small "
            "batches (blue region), compute bounds large ones (red region); the ceiling is the lower of the two. "
            "Dots: measured runs, labelled with their % of the ceiling.", "tokens / s (all requests)", "batch")
        self.money_plot = PlotPanel(
            "cost-money", "$ per 1M output tokens at the ceiling: batching shares the weight reads, so it falls "
            "until compute takes over.", "$ per 1M tokens", "batch")
        self.kv_plot = PlotPanel(
            "cost-kv", "KV-cache bytes of one sequence against context length; sliding-window layers stop "
            "growing at their window. Red dots: measured runs.", "KV cache", "context (tokens)")
        self.memory_plot.item.getAxis("bottom").setTicks([[(0, "weights + KV + activations")]])
        for name, colour in (("weights", COLOURS["weights"]), ("KV cache", COLOURS["kv"]),
                             ("activations", COLOURS["activations"])):
            self.memory_plot.add_legend(name, colour, "■")
        self.memory_plot.add_legend("device memory", COLOURS["device"], "╍╍")
        for name, colour, glyph in (("memory-bound", COLOURS["memory"], "╍╍"), ("compute-bound", COLOURS["compute"], "╍╍"),
                                    ("ceiling", COLOURS["ceiling"], "━━"), ("measured", COLOURS["measured"], "●")):
            self.speed_plot.add_legend(name, colour, glyph)
        self._regions = [pg.LinearRegionItem(movable=False, brush=pg.mkBrush(45, 125, 210, 28), pen=pg.mkPen(None)),
                         pg.LinearRegionItem(movable=False, brush=pg.mkBrush(192, 57, 43, 28), pen=pg.mkPen(None))]
        for region in self._regions:
            self.speed_plot.plot.addItem(region, ignoreBounds=True)
        grid = QWidget()
        layout = QGridLayout(grid)
        for i, panel in enumerate((self.memory_plot, self.speed_plot, self.money_plot, self.kv_plot)):
            layout.addWidget(panel, i // 2, i % 2)
        self.setCentralWidget(grid)
        self._curves: dict[str, object] = {}
        self._money_note = pg.TextItem("", color=COLOURS["device"], anchor=(0.5, 0.5))
        self._money_note.textItem.setTextWidth(240)  # wraps inside the plot however narrow
        self.money_plot.plot.addItem(self._money_note, ignoreBounds=True)
        for panel in (self.memory_plot, self.speed_plot, self.money_plot, self.kv_plot):
            panel.item.getAxis("left").enableAutoSIPrefix(False)  # our ticks carry their units; no "(x0.001)"

        for widget in (self.model, self.hardware, self.precision, self.kv_dtype):
            widget.currentIndexChanged.connect(self.schedule_update)
        self.model.lineEdit().editingFinished.connect(self.schedule_update)
        self.context.valueChanged.connect(self.schedule_update)
        self.batch.valueChanged.connect(self.schedule_update)
        self.training.editingFinished.connect(self.schedule_update)
        self._pending = QTimer(self)
        self._pending.setSingleShot(True)
        self._pending.setInterval(30)
        self._pending.timeout.connect(self.update_view)
        self.resize(fit_screen(1500, 950))
        self.reload_hardware()
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

    def set_model(self, ref: str, precision: str | None = None) -> None:
        index = self.model.findData(ref)
        if index < 0:
            self.model.addItem(ref, ref)
            index = self.model.count() - 1
        self.model.setCurrentIndex(index)
        if precision:
            self.precision.setCurrentIndex(self.precision.findData(precision))
        self.schedule_update()

    def model_ref(self) -> str:
        index, text = self.model.currentIndex(), self.model.currentText().strip()
        return (self.model.itemData(index) if index >= 0 and self.model.itemText(index) == text else text) or "default"

    def schedule_update(self) -> None:
        if not self._closing:  # closing moves focus, and the model box then says "edited"
            self._pending.start()

    # -- the model of costs ---------------------------------------------------------------
    def _config_for_current(self) -> bool:
        """Whether the current model's config is known (it may be None: not on this machine);
        if not, it is being read off the GUI thread and the view updates when it arrives."""
        ref = self.model_ref()
        if ref in self._configs:
            self._config_ref = ref
            self._config, self._count = self._configs[ref]
            return True
        if ref not in self._reading:
            self._reading.add(ref)
            self.background.submit(lambda: _read_config(ref), lambda found: self._config_read(ref, found),
                                   lambda exc: self._config_read(ref, (None, None)))
        return False

    def _config_read(self, ref: str, found: tuple) -> None:
        self._reading.discard(ref)
        self._configs[ref] = found
        self.schedule_update()

    @Slot()
    def update_view(self) -> None:
        context = CONTEXTS[self.context.value()]
        batch = BATCHES[self.batch.value()]
        self.context_label.setText(f"{context:,} tokens")
        self.batch_label.setText(f"{batch}")
        if not self.profiles or not self._config_for_current():
            waiting = [] if self.profiles else ["measuring this machine (a few seconds, the first time)"]
            if self.model_ref() in self._reading:
                waiting.append(f"reading the config of {self.model_ref()}")
            self.numbers.setText("<i>" + "; ".join(waiting).capitalize() + "…</i>")
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
        self._draw(config, profile)
        self._write_numbers(profile)
        self.updated.emit()

    def _points(self, config, profile) -> list[RunRecord]:
        """Measured runs of this model (same parameter count), precision and hardware; plain decoding
        only (a speculative run is not bound by this ceiling) and no run that ended in an error."""
        return [r for r in self.records if r.parameters == self._count.total and r.hardware == profile.id
                and r.precision == self.precision.currentData() and r.kind != "speculative"
                and not r.extra.get("error")]

    def _curve(self, key: str, panel: PlotPanel, **style):
        if key not in self._curves:
            self._curves[key] = panel.plot.plot([], [], **style)
        return self._curves[key]

    def _draw(self, config, profile) -> None:
        e = self.estimate
        runs = self._points(config, profile)
        # 1. stacked memory bar
        divisor, unit = _unit(max(e.total_bytes, profile.memory_bytes))
        plot = self.memory_plot.plot
        for name in ("bars",):
            if name in self._curves:
                plot.removeItem(self._curves.pop(name))
        heights = [e.weights_bytes / divisor, e.kv_bytes_total / divisor, e.activation_bytes / divisor]
        bottoms = [0, heights[0], heights[0] + heights[1]]
        bars = pg.BarGraphItem(x=[0, 0, 0], height=heights, y0=bottoms, width=0.6,
                               brushes=[COLOURS["weights"], COLOURS["kv"], COLOURS["activations"]])
        plot.addItem(bars)
        self._curves["bars"] = bars
        self.memory_bars = heights
        device = self._curve("device-line", self.memory_plot, pen=_pen(COLOURS["device"], Qt.DashLine, 2))
        device.setData([-0.5, 0.5], [profile.memory_bytes / divisor] * 2)
        measured = [(r.weights_bytes + r.kv_cache_bytes) / divisor for r in runs]
        self._curve("memory-runs", self.memory_plot, pen=None, symbol="o", symbolSize=7,
                    symbolBrush=COLOURS["measured"]).setData([0.35] * len(measured), measured)
        self.memory_plot.set_label("left", f"memory ({unit})")
        self.memory_plot.item.setXRange(-0.6, 0.6, padding=0)
        self.memory_plot.item.setYRange(0, max(e.total_bytes, profile.memory_bytes) / divisor * 1.1, padding=0)
        # 2. tok/s against batch (log2 x, log10 y)
        xs = np.array(BATCHES, dtype=float)
        sweep = [costs.estimate(config, profile, e.precision, e.kv_dtype, e.context, int(b), None, e.model, self._count)
                 for b in BATCHES]
        memory_rate = np.array([s.memory_bound_tokens_per_s for s in sweep])
        compute_rate = np.array([s.compute_bound_tokens_per_s for s in sweep])
        ceiling = np.minimum(memory_rate, compute_rate)
        lx = np.log2(xs)
        self._curve("memory-bound", self.speed_plot, pen=_pen(COLOURS["memory"], Qt.DashLine)).setData(lx, np.log10(memory_rate))
        self._curve("compute-bound", self.speed_plot, pen=_pen(COLOURS["compute"], Qt.DashLine)).setData(lx, np.log10(compute_rate))
        self._curve("ceiling", self.speed_plot, pen=_pen(COLOURS["ceiling"], width=2)).setData(lx, np.log10(ceiling))
        self.speed_ceiling = ceiling
        runs_x = [math.log2(r.batch) for r in runs if r.decode_tokens_per_s]
        runs_y = [math.log10(r.decode_tokens_per_s * r.batch) for r in runs if r.decode_tokens_per_s]
        self._curve("speed-runs", self.speed_plot, pen=None, symbol="o", symbolSize=7,
                    symbolBrush=COLOURS["measured"]).setData(runs_x, runs_y)
        self._label_runs(runs, profile, config)
        self.speed_plot.set_label("left", "tokens / s, all requests (log₁₀)")
        # the measured dots stay in view, however far below the ceiling they are
        _log_axes(self.speed_plot, lx, np.concatenate([np.log10(np.concatenate([ceiling, memory_rate, compute_rate])),
                                                       np.array(runs_y, dtype=float)]))
        low, high = float(lx.min()), float(lx.max())
        ridge = math.log2(e.ridge_batch) if e.ridge_batch else None
        split = high if ridge is None else min(max(ridge, low), high)
        self._regions[0].setRegion((low, split))  # memory-bound
        self._regions[1].setRegion((split, high))  # compute-bound
        self.ridge_log2 = ridge
        marker = self._curve("batch-marker", self.speed_plot, pen=None, symbol="t", symbolSize=10,
                             symbolBrush=COLOURS["ceiling"])
        marker.setData([math.log2(e.batch)], [math.log10(e.decode_tokens_per_s_ceiling)])
        # 3. $ per 1M tokens against batch (only for batches that fit, and hardware with a price)
        fits = np.array([s.fits for s in sweep])
        usd_curve = self._curve("usd", self.money_plot, pen=_pen(COLOURS["ceiling"], width=2))
        if profile.usd_per_hour and fits.any():
            usd = profile.usd_per_hour / (ceiling * 3600) * 1e6
            usd_curve.setData(lx[fits], np.log10(usd[fits]))
            _log_axes(self.money_plot, lx, np.log10(usd[fits]))
            self._money_note.setVisible(False)
        else:
            usd_curve.setData([], [])
            self._money_note.setText("No price for this hardware: set its $ / hour in Edit hardware…"
                                     if not profile.usd_per_hour else "Does not fit at any batch: no price.")
            self._money_note.setPos(float(lx.mean()), 0.5)
            _log_axes(self.money_plot, lx, np.array([0.0, 1.0]))
            self.money_plot.item.setYRange(0, 1, padding=0)
            self.money_plot.item.getAxis("left").setTicks([[]])
            self._money_note.setVisible(True)
        # 4. KV bytes against context
        contexts = np.array(CONTEXTS, dtype=float)
        kv = [costs.estimate(config, profile, e.precision, e.kv_dtype, int(c), 1, None, e.model, self._count).kv_bytes_total
              for c in CONTEXTS]
        divisor, unit = _unit(max(kv))
        self._curve("kv-line", self.kv_plot, pen=_pen(COLOURS["kv"], width=2)).setData(np.log2(contexts), np.array(kv) / divisor)
        measured_kv = [(math.log2(max(r.context - 1, 1)), r.kv_cache_bytes / divisor) for r in runs if r.kv_cache_bytes]
        self._curve("kv-runs", self.kv_plot, pen=None, symbol="o", symbolSize=7, symbolBrush=COLOURS["measured"]).setData(
            [p[0] for p in measured_kv], [p[1] for p in measured_kv])
        self.kv_plot.set_label("left", f"KV cache per sequence ({unit})")
        self.kv_plot.item.setXRange(math.log2(CONTEXTS[0]), math.log2(CONTEXTS[-1]), padding=0.02)
        self.kv_plot.item.getAxis("bottom").setTicks([[(math.log2(c), _pretty(c)) for c in CONTEXTS[::2]]])
        self.kv_plot.item.setYRange(0, max(kv) / divisor * 1.05, padding=0)

    def _label_runs(self, runs, profile, config) -> None:
        """One label per batch size (runs at the same batch would print over each other): the
        median share of the ceiling, with the range and count where there are several."""
        for item in getattr(self, "_run_labels", []):
            self.speed_plot.plot.removeItem(item)
        self._run_labels = []
        by_batch: dict[int, list[tuple[float, float]]] = {}
        ceilings: dict[tuple, float] = {}  # one estimate per (precision, context, batch), however many runs share it
        for r in runs:
            if not r.decode_tokens_per_s:
                continue
            key = (r.precision if r.precision in ALL_PRECISIONS else "bf16", max(r.context, 1), r.batch)
            if key not in ceilings:
                ceilings[key] = costs.estimate(config, profile, key[0], self.kv_dtype.currentData(), key[1], key[2],
                                               None, "", self._count).decode_tokens_per_s_ceiling
            rate = r.decode_tokens_per_s * r.batch
            by_batch.setdefault(r.batch, []).append((100 * rate / ceilings[key], rate))
        for i, (batch, shares) in enumerate(sorted(by_batch.items())):
            values = sorted(share for share, _ in shares)
            text = f"{float(np.median(values)):.0f}%"
            if len(values) > 1:
                text += f" ({values[0]:.0f}–{values[-1]:.0f}%, {len(values)} runs)"
            label = pg.TextItem(text + (" of ceiling" if i == 0 else ""), color=COLOURS["measured"],
                                anchor=(0, 1) if i % 2 == 0 else (0, 0))  # neighbours alternate above/below
            label.setPos(math.log2(batch), math.log10(float(np.median([rate for _, rate in shares]))))
            self.speed_plot.plot.addItem(label)
            self._run_labels.append(label)

    def _write_numbers(self, profile) -> None:
        e = self.estimate
        runs = self._points(self._config, profile)
        ridge = ("never at this context (each sequence's KV reads grow as fast as its compute)"
                 if e.ridge_batch is None else f"from batch {e.ridge_batch:,.0f}")
        rows = [
            ("Parameters", f"{format_count(e.parameters)} ({e.parameters:,})"),
            ("Weights", f"{format_bytes(e.weights_bytes)} in {e.precision}"),
            ("KV cache", f"{format_bytes(e.kv_bytes_per_token)} per token ({e.kv_dtype}); "
                         f"{format_bytes(e.kv_bytes_total)} for {e.batch} × {e.context:,} tokens"),
            ("Activations", format_bytes(e.activation_bytes)),
            ("Total", f"{format_bytes(e.total_bytes)} of {format_bytes(e.device_memory_bytes)}: "
                      + ("<b style='color:#27ae60'>fits</b>" if e.fits else "<b style='color:#c0392b'>does not fit</b>")),
            ("Decode ceiling", f"{e.decode_tokens_per_s_ceiling:,.1f} tok/s in all, {e.per_request_tokens_per_s:,.1f} "
                               f"per request ({e.bound}-bound)"),
            ("Compute-bound", ridge),
            ("Prefill", f"{e.context:,} tokens ≈ {e.prefill_s * 1000:,.1f} ms at peak FLOP/s"),
            ("$ per 1M tokens", _money(e.usd_per_million_tokens, e.fits, profile.usd_per_hour, "$ / hour")),
            ("Wh per 1M tokens", _money(e.wh_per_million_tokens, e.fits, profile.watts, "watts")),
        ]
        if e.training_breakeven_tokens:
            rows.append(("Training", f"{e.training_flops:.2e} FLOPs = serving {e.training_breakeven_tokens:.2e} tokens"))
        if runs:
            last = runs[-1]
            predicted = costs.estimate(self._config, profile, e.precision, e.kv_dtype, max(last.context - 1, 1), 1,
                                       None, "", self._count)
            predicted_bytes = predicted.weights_bytes + predicted.kv_bytes_total
            measured = last.weights_bytes + last.kv_cache_bytes
            rows.append(("Last run", f"weights + KV measured {format_bytes(measured)}, predicted "
                                     f"{format_bytes(predicted_bytes)} ({100 * (predicted_bytes - measured) / measured:+.2f}%)"))
        sources = profile.sources or {}
        self.numbers.setText(
            "<table cellspacing=3>" + "".join(f"<tr><td><b>{k}</b></td><td>{v}</td></tr>" for k, v in rows) + "</table>"
            + f"<p><b>{profile.name}</b>: {profile.bandwidth_bytes_per_s / 1e9:,.0f}&nbsp;GB/s "
              f"<small>({sources.get('bandwidth_bytes_per_s', '')})</small>, {profile.bf16_flops / 1e12:,.1f}&nbsp;TFLOP/s "
              f"<small>({sources.get('bf16_flops', '')})</small></p>")

    def closeEvent(self, event) -> None:
        self._closing = True
        self._pending.stop()
        super().closeEvent(event)

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


def _read_config(ref: str) -> tuple:
    """A model's config and parameter count (imports transformers, builds it on the meta device
    under the load lock: never on the GUI thread)."""
    config = config_for(ref)
    return config, (count_parameters(config) if config is not None else None)


class HardwareDialog(QDialog):
    FIELDS = (("name", "Name", str), ("memory_bytes", "Memory (GiB)", float), ("bandwidth_bytes_per_s", "Bandwidth (GB/s)", float),
              ("bf16_flops", "bf16 TFLOP/s", float), ("usd_per_hour", "$ / hour", float), ("watts", "Watts", float))
    SCALE = {"memory_bytes": 2 ** 30, "bandwidth_bytes_per_s": 1e9, "bf16_flops": 1e12}

    def __init__(self, profiles, parent=None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Hardware profiles")
        self.profiles = profiles
        self.table = QTableWidget(len(profiles), len(self.FIELDS))
        self.table.setHorizontalHeaderLabels([title for _, title, _ in self.FIELDS])
        self.table.setVerticalHeaderLabels([p.id for p in profiles])
        for row, profile in enumerate(profiles):
            for column, (key, _, _) in enumerate(self.FIELDS):
                value = getattr(profile, key)
                scale = self.SCALE.get(key, 1)
                text = "" if value is None else (value if isinstance(value, str) else f"{value / scale:g}")
                item = QTableWidgetItem(text)
                item.setToolTip((profile.sources or {}).get(key, ""))
                self.table.setItem(row, column, item)
        self.table.resizeColumnsToContents()
        buttons = QDialogButtonBox(QDialogButtonBox.Save | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("Hover a cell for its source. Your edits are kept in your config folder."))
        layout.addWidget(self.table)
        layout.addWidget(buttons)
        self.resize(fit_screen(1000, 420))

    def changes(self) -> dict[str, dict]:
        result = {}
        for row, profile in enumerate(self.profiles):
            for column, (key, _, kind) in enumerate(self.FIELDS):
                text = self.table.item(row, column).text().strip()
                try:
                    value = kind(text) * self.SCALE.get(key, 1) if kind is float and text else (text or None)
                except ValueError:
                    continue
                if value != getattr(profile, key) and value is not None:
                    result.setdefault(profile.id, {})[key] = int(value) if key == "memory_bytes" else value
        return result


def _money(value: float | None, fits: bool, rate: float | None, what: str) -> str:
    """A price (or energy) figure, or why there is none: never a "$0.000" that looks measured."""
    if not fits:
        return "n/a: this setup does not fit in the device's memory"
    if not rate:
        return f"n/a: no {what} for this hardware (Edit hardware… sets one)"
    if value is None:
        return "n/a"
    return f"${value:,.3f}" if what.startswith("$") else f"{value:,.0f} Wh"


def _unit(largest: float) -> tuple[float, str]:
    from engine.units import binary_unit

    return binary_unit(largest)


def _log_axes(panel: PlotPanel, xs: np.ndarray, ys: np.ndarray) -> None:
    finite = ys[np.isfinite(ys)]
    panel.item.setXRange(float(xs.min()), float(xs.max()), padding=0.02)
    if finite.size:
        panel.item.setYRange(float(finite.min()) - 0.2, float(finite.max()) + 0.2, padding=0)
    # every other power of two labelled (1, 4, 16 …: "512" and "1024" side by side collide), the rest as minor ticks
    major = [(float(x), str(int(round(2 ** x)))) for i, x in enumerate(xs) if i % 2 == 0]
    minor = [(float(x), "") for i, x in enumerate(xs) if i % 2 == 1]
    panel.item.getAxis("bottom").setTicks([major, minor])
    lo = float(finite.min()) - 0.2 if finite.size else 0.0
    hi = float(finite.max()) + 0.2 if finite.size else 1.0
    panel.item.getAxis("left").setTicks([_log_ticks(lo, hi)])


def _log_ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    """Ticks for a log10 axis from ``lo`` to ``hi``: each power of ten, and 2× and 5× when the
    range spans too few powers to show any (a narrow range must still have numbers)."""
    decades = range(math.floor(lo), math.ceil(hi) + 1)
    ticks = [(float(k), _pretty(10 ** k)) for k in decades if lo <= k <= hi]
    if len(ticks) < 3:
        ticks = [(math.log10(m * 10 ** k), _pretty(m * 10 ** k)) for k in decades for m in (1, 2, 5)
                 if lo <= math.log10(m * 10 ** k) <= hi]
    return ticks


def _pretty(value: float) -> str:
    for size, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"
