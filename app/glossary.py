"""Help → Glossary: the words the workbench's figures use, each in a few plain sentences with
where in the app to see it measured. Plot captions link their terms here (a click opens the
glossary at that word)."""

from __future__ import annotations

import html
import re

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QHBoxLayout, QListWidget, QListWidgetItem, QTextBrowser, QWidget

from app.screen import fit_screen

TERMS: dict[str, tuple[str, str, str]] = {
    # key: (the word, what it means, where to see it here)
    "token": ("Token",
              "The unit a model reads and writes: a word, a piece of a word, a space or a punctuation mark. "
              "An API bills by tokens, and a model makes them one at a time.",
              "View → Show tokens (Ctrl+T) draws the answer as token chips; the status bar counts the prompt's."),
    "context": ("Context window",
                "How many tokens, prompt and answer together, the model can attend to at once. A longer "
                "context costs KV-cache memory in proportion.",
                "The Model panel's Context fact; the Cost explorer's Context slider."),
    "prefill": ("Prefill",
                "Reading the prompt: every prompt token goes through the model in large batches, which keeps "
                "the processor busy (compute-bound). It ends with the first answer token.",
                "The status bar's TTFT; the Traffic view's orange 'prompt' bars."),
    "decode": ("Decode",
               "Writing the answer, one token per step: each step reads every weight once to make one token "
               "per request, so it is bound by memory bandwidth, not arithmetic.",
               "The Tokens / second plot; the Traffic view's blue 'decode' bars."),
    "ttft": ("TTFT (time to first token)",
             "From sending the request to the first answer token: waiting in a queue, plus reading the "
             "prompt (prefill). What a chat user feels as 'thinking'.",
             "The title of the Tokens / second and Per-token latency plots; the status bar."),
    "tpot": ("TPOT / ITL (time per output token, inter-token latency)",
             "The time between one answer token and the next, once answering has begun: one decode step. "
             "Its inverse is the tokens/second a single user sees.",
             "The Per-token latency plot; the Traffic view's per-token latency histogram."),
    "throughput": ("Throughput",
                   "Tokens per second of all requests together. Batching raises it while each request's own "
                   "speed falls a little: the server's view, not one user's.",
                   "View → Batching: aggregate tok/s against batch size; the Traffic view's throughput plot."),
    "kv-cache": ("KV cache",
                 "The keys and values every layer computed for the tokens so far, kept so each new token "
                 "attends to them without recomputing. Bytes = 2 × layers × KV heads × head dim × bytes per "
                 "number, per token, per request. Servers keep it in a pool of fixed blocks (16 tokens "
                 "here, as vLLM): a request holds the blocks its tokens fill, so its last one is partly "
                 "empty, and nothing is reserved for the longest answer it might give.",
                 "The KV cache plot: measured blocks held against the predicted line; the Traffic view's "
                 "KV plot and block counts; /metrics' vllm:kv_cache_usage_perc."),
    "kv-dtype": ("KV-cache dtype",
                 "The number format the KV cache keeps keys and values in. 16 bits (bf16, fp16) is the usual; "
                 "int8 keeps each 32 values as 32 one-byte codes and one scale, as llama.cpp's q8_0 cache (and "
                 "Ollama's OLLAMA_KV_CACHE_TYPE, vLLM's --kv-cache-dtype fp8): about half the bytes, so twice "
                 "the tokens fit and each step reads half as much, at a small price in quality. Keys and values "
                 "are first turned by a Walsh-Hadamard rotation, which spreads a head's few large numbers over "
                 "the block so one scale fits them all; attention comes out the same.",
                 "The Model panel's KV cache box (the -fast precisions), then the KV per token fact and the KV "
                 "plot; the Cost explorer's KV-cache dtype; inference-workbench perplexity --kv-dtype int8 "
                 "--reference fp32-fast for its price."),
    "prefix-cache": ("Prefix cache",
                     "Full KV blocks already computed, remembered by a hash of their tokens and of every "
                     "token before them, reused by a later prompt that begins with the same tokens (a system "
                     "prompt, a chat's history): its TTFT drops to the new part's. On the *-fast precisions "
                     "the blocks are shared in place (sixteen requests behind one system prompt hold it "
                     "once); the reference precisions copy them in.",
                     "The status bar's 'prompt N (M cached)'; the KV plot's green shading; the Traffic view's ◆."),
    "weights": ("Weights",
                "The model's learned numbers. Their memory is parameters × bytes per parameter: 8 billion at "
                "16 bits is 16 GB, at 4 bits 4 GB.",
                "The Model panel's Weights fact; the Memory plot's dashed line; the Cost explorer's bar."),
    "quantization": ("Quantization",
                     "Storing weights in fewer bits (int8, 4-bit) to save memory and the bandwidth each decode "
                     "step spends reading them, at some cost in agreement with the full-precision answer.",
                     "View → Compare → Quantization ladder: bytes, speed and agreement side by side."),
    "perplexity": ("Perplexity",
                   "How surprised a model is by a text: exp of the mean −log p of each next token. Lower is "
                   "better; a quantized model's perplexity against its full-precision one's is the field's "
                   "first check of what the bits cost.",
                   "View → Compare → Quality; inference-workbench perplexity on the command line."),
    "kl-divergence": ("KL divergence",
                      "How far a model's whole next-token distribution moved from a reference's, per token, in "
                      "nats: 0 when identical. llama.cpp's quantizers judge their work by its mean and its 99th "
                      "percentile, and by how often the top token stays the same.",
                      "View → Compare → Quality: the table, the bytes-vs-KLD chart, the text coloured by it."),
    "bandwidth": ("Memory-bandwidth ceiling",
                  "A decode step must read all the weights (and the KV cache) once, so tokens/second can't "
                  "exceed bandwidth ÷ bytes read. Most single-user speed is this limit, not arithmetic. (An "
                  "input embedding table that no head reads whole is the exception: a token looks up one row.)",
                  "The Cost explorer's decode ceiling; the Batching sweep's dashed ceiling."),
    "roofline": ("Roofline",
                 "Speed is the lower of two roofs: memory bandwidth (small batches) and arithmetic (large "
                 "batches). Where they cross is the batch size past which more requests stop being free.",
                 "The Cost explorer's speed chart: blue (memory-bound) and red (compute-bound) regions."),
    "batch": ("Batching",
              "Several requests decoded in the same step: one read of the weights makes a token for each, "
              "so throughput grows almost with the batch until compute runs out. Continuous batching lets "
              "requests join and leave between steps.",
              "View → Batching (a sweep); the Traffic view's batch plot while serving."),
    "preemption": ("Preemption",
                   "When KV blocks run out, the engine takes a running request's blocks back and queues it to "
                   "compute them again later (vLLM's default), instead of refusing new requests.",
                   "The Traffic view's ✕ marks; /metrics vllm:num_preemptions_total."),
    "speculative": ("Speculative decoding",
                    "A cheap draft guesses a few tokens; the big model checks them all in one step and keeps "
                    "the ones it agrees with. Same answer, fewer big steps, when guesses are often right and "
                    "cheap: prompt lookup (no model, guessing the answer repeats the prompt) pays on edits and "
                    "quotes; a small model's guesses cost a pass each.",
                    "View → Batching and speculative decoding, second tab: accepted and rejected guesses, and each "
                    "step's speed-up beside the one predicted from the acceptance rate and the costs."),
    "latency": ("Latency",
                "How long something takes for one request: the first token (TTFT), each next token (TPOT), "
                "or the whole answer (end to end).",
                "The Per-token latency plot; the Traffic view's three histograms."),
}

_LINKED = {"TTFT": "ttft", "KV-cache dtype": "kv-dtype", "KV cache": "kv-cache", "KV-cache": "kv-cache",
           "prefix cache": "prefix-cache",
           "decode": "decode", "prefill": "prefill", "latency": "latency", "batch": "batch",
           "weights": "weights", "tokens": "token", "token": "token", "throughput": "throughput",
           "ceiling": "bandwidth", "compute": "roofline", "preempted": "preemption", "TPOT": "tpot"}
"""Words in a plot's sentence that link to the glossary (the first of each)."""


def linked(sentence: str) -> str:
    """``sentence`` (rich text) with the first mention of each glossary word made a link to it."""
    done: set[str] = set()
    out = sentence
    for word in sorted(_LINKED, key=len, reverse=True):
        key = _LINKED[word]
        if key in done:
            continue
        pattern = re.compile(rf"(?<![\w>/-]){re.escape(word)}(?![\w<-])")
        match = pattern.search(out)
        if match is None or _inside_tag_or_link(out, match.start()):
            continue
        out = out[:match.start()] + f"<a href='glossary:{key}'>{match.group(0)}</a>" + out[match.end():]
        done.add(key)
    return out


def _inside_tag_or_link(text: str, at: int) -> bool:
    before = text[:at]
    return before.rfind("<") > before.rfind(">") or before.rfind("<a ") > before.rfind("</a>")


class GlossaryDialog(QDialog):
    """The terms on the left, the chosen one's meaning and where to see it on the right."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("glossaryDialog")
        self.setWindowTitle("Inference Workbench — Glossary")
        self.terms = QListWidget()
        self.terms.setObjectName("glossaryTerms")
        for key, (word, _, _) in TERMS.items():
            item = QListWidgetItem(word)
            item.setData(Qt.UserRole, key)
            self.terms.addItem(item)
        self.text = QTextBrowser()
        self.text.setObjectName("glossaryText")
        self.text.setOpenLinks(False)
        self.text.anchorClicked.connect(lambda url: self.show_term(url.toString().removeprefix("glossary:")))
        self.terms.currentItemChanged.connect(lambda item, _: item and self._show(item.data(Qt.UserRole)))
        layout = QHBoxLayout(self)
        layout.addWidget(self.terms, 1)
        layout.addWidget(self.text, 3)
        self.resize(fit_screen(820, 460))
        self.terms.setCurrentRow(0)

    def show_term(self, key: str) -> None:
        for row in range(self.terms.count()):
            if self.terms.item(row).data(Qt.UserRole) == key:
                self.terms.setCurrentRow(row)
                return

    @property
    def current(self) -> str | None:
        item = self.terms.currentItem()
        return item.data(Qt.UserRole) if item is not None else None

    def _show(self, key: str) -> None:
        word, meaning, where = TERMS[key]
        self.text.setHtml(f"<h3>{html.escape(word)}</h3><p>{linked(html.escape(meaning))}</p>"
                          f"<p><b>Where to see it:</b> {html.escape(where)}</p>")


_dialog: GlossaryDialog | None = None


def open_glossary(term: str | None = None, parent: QWidget | None = None) -> GlossaryDialog:
    """The glossary window (one per app), at ``term`` if given."""
    global _dialog
    if _dialog is None:
        _dialog = GlossaryDialog(parent)
        _dialog.destroyed.connect(_forget)
    if term:
        _dialog.show_term(term)
    _dialog.show()
    _dialog.raise_()
    return _dialog


def _forget(*_) -> None:
    global _dialog
    _dialog = None


def link_headers(table, terms: dict[str, str]) -> None:
    """Column headers of ``table`` (a QTableWidget) named in ``terms`` (header text → glossary key)
    say what they mean in their tooltip, and a double-click on one opens the glossary there."""
    keys: dict[int, str] = {}
    for column in range(table.columnCount()):
        item = table.horizontalHeaderItem(column)
        key = terms.get(item.text()) if item is not None else None
        if key in TERMS:
            word, meaning, _ = TERMS[key]
            item.setToolTip(f"{word}: {meaning}\n(double-click: the glossary)")
            keys[column] = key
    table.horizontalHeader().sectionDoubleClicked.connect(
        lambda column: column in keys and open_glossary(keys[column], table.window()))
