"""How to generate: system prompt, chat or raw, length, greedy or sampling parameters."""

from __future__ import annotations

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QLineEdit,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.widgets.model_panel import _compact
from engine.base.request import ChatMessage, GenerationRequest
from engine.base.sampling import SamplingParams

STOP_SEPARATOR = " | "


def _spin(low: float, high: float, step: float, decimals: int | None = None, name: str = ""):
    box = QDoubleSpinBox() if decimals is not None else QSpinBox()
    if decimals is not None:
        box.setDecimals(decimals)
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setObjectName(name)
    return box


class GenerationPanel(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setObjectName("systemPrompt")
        self.system_prompt.setPlaceholderText("System prompt (empty: the model's own default)")
        self.system_prompt.setFixedHeight(64)
        self.mode = QComboBox()
        self.mode.setObjectName("mode")
        self.mode.addItem("Chat (template + history)", "chat")
        self.mode.addItem("Raw completion", "raw")
        self.mode.setToolTip("Chat wraps your prompt and the earlier turns in the model's chat template; "
                             "raw completion continues your text as it is.")
        self.max_tokens = _spin(1, 1_000_000, 16, name="maxTokens")
        self.max_tokens.setValue(256)
        self.ignore_eos = QCheckBox("Ignore end of sequence")
        self.ignore_eos.setObjectName("ignoreEos")
        self.ignore_eos.setToolTip("Generate exactly 'max new tokens', past the model's end-of-turn token, "
                                   "as benchmarks do")
        self.reuse_prefix = QCheckBox("Reuse cached prompt KV")
        self.reuse_prefix.setObjectName("reusePrefix")
        self.reuse_prefix.setChecked(True)
        self.reuse_prefix.setToolTip(
            "Copy the keys and values of the prompt's start from the prefix cache (the earlier turns of a "
            "chat, a repeated system prompt) instead of computing them again, as vLLM and llama.cpp's server "
            "do. Off: the whole prompt is computed (a cold TTFT, to compare).")
        self.greedy = QCheckBox("Greedy")
        self.greedy.setToolTip("Always pick the most likely token (temperature 0)")
        self.greedy.setObjectName("greedy")
        self.greedy.setChecked(True)
        self.temperature = _spin(0.01, 5.0, 0.05, 2, "temperature")
        self.temperature.setValue(0.7)
        self.top_k = _spin(0, 100_000, 1, name="topK")
        self.top_k.setSpecialValueText("off")
        self.top_p = _spin(0.01, 1.0, 0.05, 2, "topP")
        self.top_p.setValue(1.0)
        self.min_p = _spin(0.0, 0.99, 0.01, 2, "minP")
        self.min_p.setSpecialValueText("off")
        self.repetition_penalty = _spin(0.5, 3.0, 0.05, 2, "repetitionPenalty")
        self.repetition_penalty.setValue(1.0)
        self.seed = _spin(-1, 2_147_483_647, 1, name="seed")
        self.seed.setValue(-1)
        self.seed.setSpecialValueText("random")
        self.stop = QLineEdit()
        self.stop.setObjectName("stopStrings")
        self.stop.setPlaceholderText(f"stop strings, separated by '{STOP_SEPARATOR.strip()}'")
        self.greedy.toggled.connect(self._update_enabled)

        _compact(self.mode)
        form = QFormLayout()
        form.addRow("Mode", self.mode)
        form.addRow("Max new tokens", self.max_tokens)
        form.addRow(self.ignore_eos)
        form.addRow(self.reuse_prefix)
        form.addRow(self.greedy)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-k", self.top_k)
        form.addRow("Top-p", self.top_p)
        form.addRow("Min-p", self.min_p)
        form.addRow("Repetition penalty", self.repetition_penalty)
        form.addRow("Seed", self.seed)
        form.addRow("Stop", self.stop)
        layout = QVBoxLayout(self)
        layout.addWidget(self.system_prompt)
        layout.addLayout(form)
        layout.addStretch(1)
        self._update_enabled()

    def _update_enabled(self) -> None:
        sampling = not self.greedy.isChecked()
        for widget in (self.temperature, self.top_k, self.top_p, self.min_p, self.seed):
            widget.setEnabled(sampling)

    def sampling(self) -> SamplingParams:
        if self.greedy.isChecked():
            return SamplingParams(repetition_penalty=self.repetition_penalty.value())
        seed = self.seed.value()
        return SamplingParams(temperature=self.temperature.value(), top_k=self.top_k.value(),
                              top_p=self.top_p.value(), min_p=self.min_p.value(),
                              repetition_penalty=self.repetition_penalty.value(), seed=None if seed < 0 else seed)

    def request_for(self, prompt: str, history: tuple[ChatMessage, ...]) -> GenerationRequest:
        mode = self.mode.currentData()
        system = self.system_prompt.toPlainText().strip() or None
        stops = tuple(s for s in self.stop.text().split(STOP_SEPARATOR.strip()) if s.strip())
        return GenerationRequest(
            prompt=prompt, mode=mode, system_prompt=system if mode == "chat" else None,
            history=history if mode == "chat" else (), sampling=self.sampling(),
            max_new_tokens=self.max_tokens.value(), stop=tuple(s.strip() for s in stops),
            ignore_eos=self.ignore_eos.isChecked(), reuse_prefix=self.reuse_prefix.isChecked(),
        )

    # -- settings --------------------------------------------------------------------
    def save(self, settings: QSettings) -> None:
        settings.setValue("generation/system_prompt", self.system_prompt.toPlainText())
        settings.setValue("generation/mode", self.mode.currentData())
        settings.setValue("generation/max_new_tokens", self.max_tokens.value())
        settings.setValue("generation/greedy", self.greedy.isChecked())
        settings.setValue("generation/ignore_eos", self.ignore_eos.isChecked())
        settings.setValue("generation/reuse_prefix", self.reuse_prefix.isChecked())
        for key, box in (("temperature", self.temperature), ("top_k", self.top_k), ("top_p", self.top_p),
                         ("min_p", self.min_p), ("repetition_penalty", self.repetition_penalty),
                         ("seed", self.seed)):
            settings.setValue(f"generation/{key}", box.value())
        settings.setValue("generation/stop", self.stop.text())

    def restore(self, settings: QSettings) -> None:
        self.system_prompt.setPlainText(settings.value("generation/system_prompt", "", type=str))
        index = self.mode.findData(settings.value("generation/mode", "chat", type=str))
        self.mode.setCurrentIndex(max(index, 0))
        self.max_tokens.setValue(settings.value("generation/max_new_tokens", 256, type=int))
        self.greedy.setChecked(settings.value("generation/greedy", True, type=bool))
        self.ignore_eos.setChecked(settings.value("generation/ignore_eos", False, type=bool))
        self.reuse_prefix.setChecked(settings.value("generation/reuse_prefix", True, type=bool))
        for key, box, kind in (("temperature", self.temperature, float), ("top_k", self.top_k, int),
                               ("top_p", self.top_p, float), ("min_p", self.min_p, float),
                               ("repetition_penalty", self.repetition_penalty, float), ("seed", self.seed, int)):
            value = settings.value(f"generation/{key}", None)
            if value is not None:
                box.setValue(kind(value))
        self.stop.setText(settings.value("generation/stop", "", type=str))
