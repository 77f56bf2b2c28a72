"""The tour's ten steps (Help → Tour): the essay's question each answers, what to look at, and the
measurement each makes on the loaded model through the windows' own controls
(:class:`StepMeasurements`, a part of :class:`~app.tour.Tour`).
"""

from __future__ import annotations

import html
import socket
from dataclasses import dataclass

from PySide6.QtCore import QTimer

from engine.base.units import format_bytes, format_count, format_rate, format_seconds, kv_dtype_label
from engine.jobs import CeilingJob, TokenizeJob, WeightsJob
from engine.measure.compare import LaneSpec
from engine.models.sources import reference_weights

PROMPT = "In two sentences: what does a GPU do?"
ANSWER_TOKENS = 32
"""Each answer the tour asks for: long enough for a steady per-token figure, a few seconds on two cores."""
FOLLOW_UP = "Now say it to a ten-year-old."
BATCHES = "1,4"
SWEEP_TOKENS = 16
LADDER_TOKENS = 16
SPECULATIVE_TOKENS = 40
EDIT_PROMPT = ("Copy this exactly, but write \"ocean\" for \"sea\": The sea was calm that morning. The boats rowed "
               "out past the rocks, where the sea turned from green to deep blue.")
"""Step 8's prompt: an edit, whose answer repeats its input (where prompt lookup's guesses are right)."""
LOAD_CONCURRENCY = "1,4"
LOAD_REQUESTS = 8
LOAD_TOKENS = 16
DEFAULT_TRAINING_TOKENS = 2e12
"""SmolLM2-135M's training tokens (its model card: 2 trillion)."""
TOKENS_PER_PARAMETER = 20
"""For another model the tour assumes Chinchilla's 20 training tokens per parameter, and says so."""
HIGHLIGHT = "#e67e22"
MAX_CHIPS = 160



@dataclass(frozen=True)
class Step:
    key: str
    title: str
    question: str
    """The essay's question this step answers."""
    look: str
    """What to look at, two or three sentences (its glossary words become links)."""


STEPS = (
    Step("tokens", "Tokens", "What does the model actually read?",
         "Your prompt, as the model reads it: the chat template wraps it with a system prompt and role markers, "
         "then the tokenizer cuts it into tokens (the chips below). An API bills these, and the context "
         "window counts them."),
    Step("decode", "One token at a time", "How does a model actually run?",
         "Generate answers the prompt in the main window (up to 32 tokens: the tour keeps answers short, whatever "
         "the Generation panel says). The Per-token latency plot (outlined) has one point per "
         "token: the first waited for the whole prompt (the TTFT); every later token is one decode step, "
         "a pass through the whole model."),
    Step("weights", "Why so much memory", "Why does it need so much memory?",
         "Weights take parameters × bits: counted from the config, predicted, and measured once loaded. The "
         "Memory plot draws them as the dashed line under the process's memory. The same sum for "
         "Llama-3.1-8B gives the essay's 16 GB."),
    Step("kv", "The KV cache", "Why does memory grow while it talks?",
         "A follow-up turn: the KV cache plot (outlined) adds the same bytes for every token, measured dots on "
         "the line predicted from the config. Each request holds its own, so context and users multiply it. "
         "Fewer bits a value hold more: the Model panel's KV cache box (int8 is about half of 16-bit)."),
    Step("bandwidth", "The bandwidth ceiling", "Why does generating a response take time?",
         "Each decode step reads every weight (and the KV cache) from memory. This machine's bandwidth, "
         "measured, divided by the bytes read per token, is the fastest one request can go: the dashed line "
         "now drawn on the Tokens / second plot."),
    Step("batching", "Batching", "How does a server answer many users?",
         "A short sweep in the Batching window: one request, then four at once. One pass reads the "
         "weights for all four, so throughput rises; each request waits a little longer per token (the "
         "trade-off plot, outlined)."),
    Step("quantization", "Quantization", "What do fewer bits buy, and cost?",
         "Compare's quantization ladder: the same model at fp32, bf16, int8 and nf4, the same prompt in "
         "each lane. The summary (outlined) gives bytes, speed, and how often each answer agrees with lane 1's."),
    Step("speculative", "Speculative decoding", "Can a model guess ahead?",
         "A draft guesses a few tokens; the model checks them all in one pass and keeps those it agrees with, so "
         "the answer is the model's own. Two drafts on one edit-this-text prompt: prompt lookup (no model: it "
         "guesses the answer goes on as the prompt did) and early exit (the model's own first layers). Each "
         "speed-up is shown beside the one predicted from how often a guess was kept and what a guess and a "
         "check cost: it pays when guesses are mostly kept and cost little."),
    Step("serving", "Many users", "What happens behind an API?",
         "The Server panel starts an OpenAI-compatible API on this model. First a prediction: the serving "
         "simulator runs the engine's scheduler on a simulated clock, each step timed from this machine's "
         "own (about a minute the first time). Then the measurement: the load generator sends one request "
         "at a time, then four at once. The Traffic view draws each request as a bar (outlined): queued, "
         "reading its prompt, decoding. The tour stops the server it started when it moves on."),
    Step("training", "Training vs inference", "Which costs more, training or answering?",
         "Training costs about 6 × parameters FLOPs per training token; answering about 2 × parameters per "
         "token. The Cost explorer (outlined) turns the training bill into tokens served, and this "
         "machine's measured speed into how long that would take."),
)



class StepMeasurements:
    """What each step of the tour measures, and how it says it: a part of :class:`~app.tour.Tour`
    (its ``main`` window, ``_listen``, ``_submit``, ``_done`` and the rest are the tour's)."""

    def _measure_tokens(self) -> None:
        main = self.main
        main.prompt.editor.setPlainText(PROMPT)
        self._outline(main.prompt)
        request = main.generation_panel.request_for(PROMPT, main.transcript.history())  # what Generate will send

        def show(result) -> None:
            count = len(result.token_ids)
            self.chips.setText(chips_html(result.pieces))
            context = result.context_length
            share = (f", {count / context:.2%} of the model's {context:,}-token context window" if context else
                     " (the model doesn't say its context window)")
            words, own = len(PROMPT.split()), result.text_tokens
            if own is not None and own != count:  # the chat template and system prompt wrap the words
                said = (f"your {words} words are <b>{own} tokens</b>; with the chat template and system prompt "
                        f"around them the model reads <b>{count}</b>{share}.")
            else:
                said = f"your {words} words are <b>{count} tokens</b> as the model reads them{share}."
            self._done("tokens", said)

        self._submit(TokenizeJob(request), show)

    def _measure_decode(self) -> None:
        main = self.main
        self._outline(main.plots.latency)

        def finished(event) -> None:
            self._remember_answer(event)
            if event.tokens < 2 or not event.ttft_s:
                self._failed("decode", f"The answer stopped after {event.tokens} token(s): press Measure again.")
                return
            per_token = event.decode_s / (event.tokens - 1)
            self._done("decode", f"TTFT <b>{format_seconds(event.ttft_s)}</b> for the {event.prompt_tokens}-token "
                                 f"prompt, read in one go; then <b>{format_seconds(per_token)} per token</b> for "
                                 f"{event.tokens - 1} more, one pass each ({format_rate(event.decode_tokens_per_s)}).")

        self._generate(PROMPT, finished)

    def _measure_weights(self) -> None:
        main = self.main
        self._outline(main.plots.memory)
        main.plots.refresh(main.run)

        def show(f) -> None:
            measured = ("" if not f.measured_bytes else
                        f"; measured once loaded: <b>{format_bytes(f.measured_bytes)}</b> "
                        f"({100 * (f.measured_bytes - f.predicted_bytes) / f.predicted_bytes:+.1f}%)")
            self._done("weights", f"{format_count(f.parameters)} parameters × {f.bits_per_parameter:.1f} bits "
                                  f"({f.precision}) = <b>{format_bytes(f.predicted_bytes)}</b> predicted{measured}. "
                                  f"{f.reference.split('/')[-1]}: {format_count(f.reference_parameters)} × 16 bits = "
                                  f"<b>{f.reference_bytes / 1e9:.1f} GB</b> in bf16.")

        self._submit(WeightsJob(), show)

    def _measure_kv(self) -> None:
        main = self.main
        self._outline(main.plots.kv)
        info = main.loaded

        def finished(event) -> None:
            self._remember_answer(event)
            measured, predicted = event.kv_cache_bytes, event.kv_cache_bytes_predicted
            if not measured or not predicted:
                self._failed("kv", "This model's cache could not be measured (its layout is not a plain KV cache).")
                return
            tokens = self.context_tokens - 1  # the last token's keys are made by the next step
            per_token = info.kv_bytes_per_token or predicted / max(tokens, 1)
            full = (f" At its full {info.context_length:,}-token context one request would hold "
                    f"{format_bytes(per_token * info.context_length)}; eight users, "
                    f"{format_bytes(8 * per_token * info.context_length)}." if info.context_length else "")
            self._done("kv", f"<b>{format_bytes(measured)}</b> measured for {tokens:,} tokens, "
                             f"{format_bytes(predicted)} predicted ({100 * (measured - predicted) / predicted:+.1f}%): "
                             f"<b>{format_bytes(per_token)} per token</b> in {kv_dtype_label(info.kv_dtype)}."
                             f"{full}")

        self._generate(FOLLOW_UP, finished)

    def _measure_bandwidth(self) -> None:
        main = self.main
        self._outline(main.plots.speed)
        context = self.context_tokens or 64

        def show(c) -> None:
            if not c.tokens_per_s:
                self._failed("bandwidth", "No ceiling: the cost model doesn't know this model's layout.")
                return
            main.plots.set_ceiling(c.tokens_per_s)
            speed = self.speed or main.run.decode_tokens_per_s()
            if not speed:
                measured = "No answer measured yet (step 2 makes one)."
            elif speed <= c.tokens_per_s:
                measured = (f"The last answer: <b>{format_rate(speed)}</b>, {speed / c.tokens_per_s:.0%} of the "
                            "ceiling (the rest of each step goes to arithmetic and overheads, not to reading memory).")
            else:  # a ceiling that doesn't hold is said to be broken, with why, never drawn as 112%
                measured = (f"The last answer, <b>{format_rate(speed)}</b>, ran <b>above</b> this ceiling: it was "
                            "measured while the machine was quicker than now (the bandwidth was measured just "
                            "now; a shared machine's speed moves with its neighbours' load).")
            skipped = (f" (of the {format_bytes(c.weights_bytes)} of weights, {format_bytes(c.weights_read_bytes)}: "
                       "a token looks up only one row of the input embedding table; then the KV cache)"
                       if c.weights_read_bytes < c.weights_bytes else "")
            if c.level == "L3" and c.level_bandwidth_bytes_per_s:
                reads = (f"the weights fit in its {format_bytes(c.cache_bytes)} L3 cache, so a token reads them "
                         f"from there: <b>{c.level_bandwidth_bytes_per_s / 1e9:,.1f} GB/s</b> measured just now "
                         f"(memory: {c.bandwidth_bytes_per_s / 1e9:,.1f} GB/s; the ceiling is the L3's)")
            else:
                reads = (f"this machine reads <b>{c.bandwidth_bytes_per_s / 1e9:,.1f} GB/s</b> from memory "
                         f"({html.escape(c.source)})")
            self._done("bandwidth", f"{reads}; each token reads {format_bytes(c.bytes_per_token)}"
                                    f"{skipped}, so one request can make at most <b>{format_rate(c.tokens_per_s)}</b>. "
                                    f"{measured}")

        self._submit(CeilingJob(context), show)

    def _measure_batching(self) -> None:
        tool = self._speedup_tool("batching")
        tool.batches.setText(BATCHES)
        tool.sweep_tokens.setValue(SWEEP_TOKENS)
        self._outline(tool.tradeoff_plot)
        self.raise_()

        def finished(result) -> None:
            points = [p for p in result.points if p.aggregate_tokens_per_s and p.mean_per_token_latency_s]
            if len(points) < 2:
                self._failed("batching", "The sweep measured fewer than two batch sizes: "
                                         + (" ".join(s.reason for s in result.skipped) or "press Measure again."))
                return
            one, many = points[0], points[-1]
            self._done("batching", f"batch {one.batch}: {format_rate(one.aggregate_tokens_per_s)}, "
                                   f"{format_seconds(one.mean_per_token_latency_s)} per token; batch {many.batch}: "
                                   f"<b>{format_rate(many.aggregate_tokens_per_s)} in all</b> "
                                   f"({many.aggregate_tokens_per_s / one.aggregate_tokens_per_s:.1f}×), each request "
                                   f"<b>{format_seconds(many.mean_per_token_latency_s)} per token</b> "
                                   f"({_times(many.mean_per_token_latency_s / one.mean_per_token_latency_s)}).")

        self._run_tool(tool, finished)

    def _measure_quantization(self) -> None:
        window = self.main.open_compare()
        loaded = self.main.model_panel.loaded_request  # lane 1: the model the main window runs, as loaded
        if loaded is not None and not window.running:
            window.lanes[0].configure(LaneSpec(loaded.model, loaded.precision, loaded.device, kv_dtype=loaded.kv_dtype))
        window.max_tokens.setValue(LADDER_TOKENS)
        if not window.prompt.toPlainText().strip():
            window.prompt.setPlainText(PROMPT)
        window.ladder()
        self._outline(window.table)
        self.raise_()

        def finished() -> None:
            rows = window.summary
            if not rows:
                self._failed("quantization", "The ladder did not run: see the Compare window's message.")
                return
            rungs = []
            for lane, row in zip(window.lanes, rows):
                agree = "" if row.token_agreement is None or row.lane == 1 else f", {row.token_agreement:.0%} agree"
                size = format_bytes(row.weights_bytes) if row.weights_bytes else "? bytes"
                speed = format_rate(row.decode_tokens_per_s) if row.decode_tokens_per_s else "no speed"
                rungs.append(f"<b>{html.escape(lane.spec().precision)}</b> {size}, {speed}{agree}")
            info = window.lanes[0].loaded
            source = "" if info is None else " " + html.escape(
                reference_weights(info.original_format, info.precision, served=info.source == "endpoint"))
            self._done("quantization", "; ".join(rungs) + "." + source)

        self._listen(window.run_finished, finished)
        window.run()
        if not window.running and window._run_after_load is None:
            self._failed("quantization", window.message.text() or "Compare did not start the ladder.")

    def _measure_speculative(self) -> None:
        tool = self._speedup_tool("speculative")
        tool.compare_plain.setChecked(True)
        tool.spec_tokens.setValue(SPECULATIVE_TOKENS)
        tool.spec_prompt.setText(EDIT_PROMPT)
        tool.draft_kind.setCurrentIndex(tool.draft_kind.findData("ngram"))
        self._outline(tool.acceptance_plot.parentWidget().parentWidget())  # the answer, summary and plots
        self.raise_()
        reports = []

        def described(report) -> str:
            rate, speedup, predicted = report.acceptance_rate, report.speedup_vs_plain, report.break_even
            text = (f"<b>{html.escape(report.draft)}</b>: {report.accepted_tokens} of {report.drafted_tokens} "
                    f"guesses kept ({'n/a' if rate is None else f'{rate:.0%}'}), "
                    f"{format_rate(report.finished.decode_tokens_per_s)} against plain "
                    f"{format_rate(report.plain_decode_tokens_per_s)}: <b>"
                    + ("n/a" if speedup is None else f"{speedup:.2f}×") + "</b>")
            if not report.drafted_tokens:
                text += " (no guess: nothing in the answer repeated what came before)"
            elif predicted is not None:
                text += f", predicted {predicted.predicted:.2f}×"
                text += (" (it can't pay: a guess and the check cost too much)" if predicted.break_even_alpha is None
                         else f" (it pays where a guess is kept with α > {predicted.break_even_alpha:.2f})")
            return text

        def finished(report) -> None:
            reports.append(report)
            if len(reports) == 1:  # then the same prompt with the model's own first layers
                tool.draft_kind.setCurrentIndex(tool.draft_kind.findData("early-exit"))
                QTimer.singleShot(0, lambda: self._run_second(tool))
                return
            self._done("speculative", "; ".join(described(r) for r in reports) + ".")

        self._run_tool(tool, finished)

    def _run_second(self, tool) -> None:
        """Step 8's second run, once the first has let go of the tool."""
        if self.index < 0 or self.step.key != "speculative":
            return
        tool.start()
        if not tool.running:
            self._failed("speculative", tool.controls.status.text())

    def _measure_serving(self) -> None:
        main = self.main
        panel = main.server_panel
        traffic = main.open_traffic()
        box = traffic.load_box
        self._outline(traffic.plots.timeline)
        self.raise_()

        def run_load() -> None:
            if panel.started is None or box.runner is not None:
                return
            box.target.setCurrentIndex(0)  # this app's server
            box.mode.setCurrentIndex(box.mode.findData("concurrency"))
            box.values.setText(LOAD_CONCURRENCY)
            box.requests.setValue(LOAD_REQUESTS)
            box.max_tokens.setValue(LOAD_TOKENS)
            box.exact.setChecked(True)
            box.predict.setChecked(True)  # the prediction first, then the measurement
            box.run()

        def ended(results, error) -> None:
            if error is not None or not results:
                self._failed("serving", f"The load failed: {error}" if error else "The load was stopped.")
                return
            parts = []
            for setting in results:
                s, p = setting.summary, box.predictions.get(setting.label)
                tpot = s.tpot.get("median") if isinstance(s.tpot, dict) else None
                guess = (f"predicted {p.output_throughput:,.1f}, " if p is not None and p.output_throughput else "")
                parts.append(f"{html.escape(setting.label)}: {guess}measured <b>{s.output_throughput:,.1f} tok/s</b> "
                             f"in all, {s.completed}/{s.requests} done"
                             + (f", {format_seconds(tpot)} per token each" if tpot else ""))
            why = "" if box.predictions else f" No prediction: {html.escape(box.prediction_error or 'stopped')}"
            self._done("serving", "; ".join(parts) + f".{why} Each request's bar is in the Traffic view, the "
                                  "predictions hollow beside the measured points.")

        def state_changed() -> None:
            if panel.started is not None:
                run_load()
            elif panel.job is None and box.runner is None and "serving" not in self.figures:
                self._failed("serving", panel.status.text() or "The server stopped.")

        self._listen(box.load_ended, ended)
        self._listen(panel.state_changed, state_changed)
        if panel.started is not None:
            run_load()
            return
        if panel.job is None:
            if not _port_free(panel.host.text().strip() or "127.0.0.1", panel.port.value()):
                panel.port.setValue(0)  # any free port: the one set is taken
            self._server_started_here = True
            panel.start()
            if panel.job is None:
                self._server_started_here = False
                self._failed("serving", "The server did not start: see the Server panel.")

    def _measure_training(self) -> None:
        main = self.main
        window = main.open_costs()
        info = main.loaded
        tokens = DEFAULT_TRAINING_TOKENS if info.source == "default" else TOKENS_PER_PARAMETER * (info.parameters or 0)
        window.training.setText(f"{tokens:.3g}")
        self._outline(window.numbers)
        self.raise_()
        assumed = ("SmolLM2-135M's 2 T training tokens (its model card)" if info.source == "default" else
                   f"{TOKENS_PER_PARAMETER} training tokens per parameter (Chinchilla's rule; set your own)")

        def updated() -> None:
            e = window.estimate
            if e is None or not e.training_breakeven_tokens:
                return  # still reading the config or measuring the machine
            speed = self.speed or main.run.decode_tokens_per_s()
            time = ("" if not speed else
                    f" At this machine's measured {format_rate(speed)}, one user would take "
                    f"<b>{_years(e.training_breakeven_tokens / speed)}</b> to ask for that many.")
            self._done("training", f"with {assumed}: training ≈ {e.training_flops:.2e} FLOPs, the compute of "
                                   f"serving <b>{e.training_breakeven_tokens:.2e} tokens</b>.{time}")

        self._listen(window.updated, updated)
        window.schedule_update()


def chips_html(pieces) -> str:
    """Tokens as chips, alternating two colours; spaces as ·, line breaks as ↵."""
    out = []
    for i, piece in enumerate(pieces[:MAX_CHIPS]):
        text = html.escape(piece).replace(" ", "·").replace("\n", "↵") or "∅"
        colour = "#d6eaf8" if i % 2 == 0 else "#fdebd0"
        out.append(f"<span style='background:{colour}; color:#1b2631'>&nbsp;{text}&nbsp;</span>")
    more = f" <i>… {len(pieces) - MAX_CHIPS} more</i>" if len(pieces) > MAX_CHIPS else ""
    return " ".join(out) + more


def plain_text(text: str) -> str:
    """Rich text as the words it shows."""
    from PySide6.QtGui import QTextDocumentFragment

    return QTextDocumentFragment.fromHtml(text).toPlainText()


def _years(seconds: float) -> str:
    years = seconds / (365.25 * 86400)
    return f"{years:,.0f} years" if years >= 2 else (f"{seconds / 86400:,.0f} days" if seconds >= 2 * 86400
                                                     else format_seconds(seconds))


def _port_free(host: str, port: int) -> bool:
    if port == 0:
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host if host not in ("", "localhost") else "127.0.0.1", port))
        return True
    except OSError:
        return False


def _times(ratio: float) -> str:
    """A per-token time against another, in words: "1.8× as long", "1.2× shorter", "about the same"."""
    if ratio >= 1.05:
        return f"{ratio:.1f}× as long"
    if ratio <= 1 / 1.05:
        return f"{1 / ratio:.1f}× shorter"
    return "about the same"


