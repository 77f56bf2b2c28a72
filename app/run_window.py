"""A run from the history, reopened read-only: its figures, the four plots redrawn from the
per-token (or per-step) series it kept, and its transcript."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGridLayout, QSplitter, QTextBrowser, QVBoxLayout, QWidget

from app.screen import fit_screen
from app.widgets.live_plots import LivePlots
from engine.base.units import format_bytes, format_rate, format_seconds
from engine.load.metrics import not_completed
from engine.runs import Run
from engine.storage.history import RunRecord


def describe(r: RunRecord) -> str:
    """The record's figures as Markdown, as the window that ran it showed them."""
    extra = r.extra
    lines = [f"### {r.model} · {r.precision} · {r.device_name or r.device}",
             f"{r.kind} run, {r.when.replace('T', ' ')}" + (f"; batch {r.batch}" if r.batch > 1 else ""), ""]
    if extra.get("client"):
        lines += [f"Served over HTTP to {extra['client']} ({extra.get('endpoint', '')})", ""]
    if extra.get("error"):
        lines += [f"**Failed:** {extra['error']}", ""]
    lines += [f"- prompt {r.prompt_tokens} tokens, answer {r.tokens} tokens" + (" each" if r.batch > 1 else ""),
              f"- TTFT {format_seconds(r.ttft_s)}" + (" (mean)" if r.batch > 1 else "")
              + f", decode {format_rate(r.decode_tokens_per_s)}" + (" per request" if r.batch > 1 else "")]
    if extra.get("aggregate_tokens_per_s") is not None:
        lines.append(f"- aggregate {format_rate(extra['aggregate_tokens_per_s'])} (all {r.batch} requests together)")
    summary = extra.get("summary") if r.kind == "load" else None
    if summary and "not_sent" in summary:  # a load's setting (older ones counted unsent requests as failed)
        rest = not_completed(summary["not_sent"], summary["errored"], summary["cut"], summary["cut_by"])
        lines.append(f"- {summary['completed']} of {summary['requests']} requests completed" + (f" ({rest})" if rest
                                                                                                else ""))
    point = extra.get("point") or {}
    if point.get("mean_per_token_latency_s") is not None:
        lines.append(f"- per-token latency of each request {format_seconds(point['mean_per_token_latency_s'])}")
    if extra.get("draft"):
        rate = extra.get("acceptance_rate")
        lines.append(f"- draft {extra['draft']}, {extra.get('draft_tokens_per_step')} tokens per step: "
                     f"{extra.get('accepted_tokens')} of {extra.get('drafted_tokens')} accepted"
                     + (f" ({100 * rate:.0f}%)" if rate is not None else ""))
        if extra.get("speedup_vs_plain") is not None:
            lines.append(f"- {extra['speedup_vs_plain']:.2f}× plain decoding "
                         f"({format_rate(extra.get('plain_decode_tokens_per_s'))})")
    lines += [f"- weights {format_bytes(r.weights_bytes)}, KV cache {format_bytes(r.kv_cache_bytes)}, "
              f"peak memory {format_bytes(r.peak_memory_bytes)}", ""]
    if not extra.get("series"):
        lines += ["_This run was saved without per-token figures (by an older version): no plots._", ""]
    transcript = extra.get("transcript_markdown")
    if transcript:
        lines += ["---", "", transcript]
    return "\n".join(lines)


class RunWindow(QWidget):
    """One saved run: its figures and transcript on the left, the four plots on the right."""

    def __init__(self, record: RunRecord, parent: QWidget | None = None) -> None:
        super().__init__(parent, Qt.Window)
        self.setObjectName("runWindow")
        self.setAttribute(Qt.WA_DeleteOnClose)
        self.record = record
        self.setWindowTitle(f"Inference Workbench — {record.kind} run of {record.when.replace('T', ' ')} (saved, "
                            "read-only)")
        self.details = QTextBrowser()
        self.details.setObjectName("runDetails")
        self.details.setMarkdown(describe(record))
        self.run = Run.from_series(record.extra.get("series") or {}, record.weights_bytes)
        self.plots = LivePlots()
        if record.batch > 1:
            for panel in self.plots.panels.values():
                panel.item.setLabel("bottom", f"step (each makes up to {record.batch} tokens)")
        grid_host = QWidget()
        grid = QGridLayout(grid_host)
        for (row, column), panel in zip(((0, 0), (0, 1), (1, 0), (1, 1)), self.plots.panels.values()):
            grid.addWidget(panel, row, column)
        split = QSplitter(Qt.Horizontal)
        split.addWidget(self.details)
        split.addWidget(grid_host)
        split.setStretchFactor(1, 2)
        split.setSizes([460, 940])
        QVBoxLayout(self).addWidget(split)
        self.plots.refresh(self.run)
        self.resize(fit_screen(1400, 800))
