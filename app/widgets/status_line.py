"""The main window's status bar figures: device, TTFT, decode speed, tokens, KV cache, peak memory,
read from the run being shown."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QStatusBar

from engine.base.events import Loaded
from engine.base.units import format_bytes, format_rate, format_seconds
from engine.runs import Run

WIDEST = {"device": "device: cuda:0", "ttft": "TTFT 1000.0 ms", "prompt": "prompt 10000 (10000 cached)",
          "speed": "decode 1000.0 tok/s",
          "tokens": "100000 tokens (by chunks)", "kv": "KV 1000.0 MiB", "peak": "peak 1000.0 MiB"}


class StatusLine:
    """Permanent labels in ``bar``, one per figure (``labels[key]``)."""

    def __init__(self, bar: QStatusBar) -> None:
        self.labels: dict[str, QLabel] = {}
        for key, widest in WIDEST.items():
            label = QLabel("")
            label.setObjectName(f"status_{key}")
            # a fixed width: a label that changes size re-lays-out (and repaints) the window
            label.setMinimumWidth(label.fontMetrics().horizontalAdvance(widest) + 12)
            bar.addPermanentWidget(label)
            self.labels[key] = label
        self.labels["peak"].setToolTip("The process's peak resident memory: Python, Qt, PyTorch and every model "
                                       "loaded (Compare's lanes too), not this model alone. The Memory plot draws "
                                       "the model's own: its weights and its KV cache, measured.")

    def __getitem__(self, key: str) -> QLabel:
        return self.labels[key]

    def show(self, info: Loaded | None, run: Run) -> None:
        served = run.served or (info is not None and info.source == "endpoint")
        samples = run.server_samples
        kv_usage = samples[-1].kv_usage if samples else None
        tokens = f"{run.count} tokens"
        if run.answered is not None and run.answered.counted_by != "logprobs":
            tokens += f" (by {run.answered.counted_by.split()[0]})"  # "usage" or "chunks": the server said no more
        values = {
            "device": ("device: server" if served else f"device: {info.device}") if info else "no model",
            "ttft": f"TTFT {format_seconds(run.ttft_s())}",
            "prompt": _prompt(run),
            "speed": f"decode {format_rate(run.decode_tokens_per_s())}",
            "tokens": tokens,
            "kv": (f"server KV {kv_usage:.0%}" if kv_usage is not None else "KV: server's") if served
            else f"KV {format_bytes(run.kv_bytes())}",
            "peak": "peak: server's" if served else f"peak {format_bytes(run.peak_memory_bytes())}",
        }
        for key, text in values.items():
            if self.labels[key].text() != text:
                self.labels[key].setText(text)
        tip = _prompt_tip(run)
        if self.labels["prompt"].toolTip() != tip:
            self.labels["prompt"].setToolTip(tip)


def _prompt(run: Run) -> str:
    """The prompt's tokens, and how many came from the prefix cache (copied, not computed)."""
    p = run.prefilled
    if p is None:
        return ""
    return f"prompt {p.prompt_tokens}" + (f" ({p.cached_tokens} cached)" if p.cached_tokens else "")


def _prompt_tip(run: Run) -> str:
    """What the prompt's figure means, with what the prefix cache keeps once the answer ended."""
    p, f = run.prefilled, run.finished
    if p is None:
        return ""
    tip = (f"{p.prompt_tokens} prompt tokens; {p.cached_tokens} of them found in the prefix cache (the KV of "
           "earlier turns), the rest computed" if p.cached_tokens else f"{p.prompt_tokens} prompt tokens, all computed")
    if f is not None and f.prefix_cache_bytes:
        tip += f". The prefix cache keeps {format_bytes(f.prefix_cache_bytes)} for later prompts."
    return tip
