"""The kinds of work a loaded model does for the app, one small frozen dataclass each.

A job runs in the model's engine thread with a :class:`JobContext`: the model, the job's cancel
token, ``emit`` for its events as they happen (batched to the GUI by the worker), ``keep``, a
place for what should outlive one job (a speculative draft), and ``door``, where the window's
prompts wait for the model (engine/prompts.py: a prompt is a job of its own, or joins a
running server's batch). ``run`` returns the job's typed result or raises. The app's session
(app/worker.py) queues jobs per model and knows of two kinds only, the prompts' and the
server's, whose ends it sees to; any other new kind of job is a new class here, and nothing
else changes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from engine.base.cancel import CancelToken
from engine.base.errors import EngineError
from engine.base.events import BatchStep, Finished, TokenGenerated
from engine.base.request import GenerationRequest
from engine.generation.generate import generate, kept_service
from engine.models.loading import weights_read_bytes
from engine.models.model import LoadedModel
from engine.estimates.hardware import THIS_MACHINE, this_machine
from engine.measure.sweep import ceiling_for, estimate_for, profile_for, record_points, run_sweep
from engine.generation.speculative import load_draft, parse_draft
from engine.storage.history import remember

if TYPE_CHECKING:
    from engine.generation.service import EngineService
    from engine.measure.quality import QualityReport, Reference
    from engine.measure.sweep import SweepPoint, SweepSkip
    from engine.prompts import PromptDoor
    from engine.serve.protocol import Defaults


@dataclass
class JobContext:
    model: "LoadedModel"
    cancel: CancelToken
    emit: Callable[[object], None]
    keep: dict = field(default_factory=dict)
    """Kept by the worker from one job to the next while the model stays loaded."""
    door: "PromptDoor | None" = None
    """The model's door for the window's prompts (engine/prompts.py)."""


@dataclass(frozen=True)
class Tagged:
    """An event of one part of a job (``tag``: which), e.g. a sweep's batch size or the plain
    run before a speculative one."""

    tag: object
    event: object


def model_service(ctx: JobContext) -> "EngineService | None":
    """The loaded model's engine service, kept while it stays loaded (``None`` for a model served
    elsewhere): every job of the model submits to it (the window's prompts one at a time, sweeps
    and speculative runs under their own limits for a while, and serving, which runs it on this
    thread for the HTTP clients and the window alike), so all find what its prefix cache keeps."""
    if not isinstance(ctx.model, LoadedModel) or ctx.model.model is None:
        return None
    service = ctx.keep.get("service")
    if service is None or service.loaded is not ctx.model:  # none yet, or another model's
        service = ctx.keep["service"] = kept_service(ctx.model)
    return service


@contextmanager
def using_model_service(ctx: JobContext) -> Iterator["EngineService | None"]:
    """:func:`model_service` for one job's work; if that work fails and leaves the service other
    than idle and open (a request's own error, which the service contains, leaves it so), it is
    dropped, its state perhaps half-changed, and the next job gets a fresh one."""
    service = model_service(ctx)
    try:
        yield service
    except BaseException:
        if service is not None and not service.ready:
            ctx.keep.pop("service", None)
        raise


@dataclass(frozen=True)
class MeasureJob:
    """One measured run at a context (the Cost explorer's *Measure here*): about ``context`` tokens of
    the shipped text as a raw prompt, the whole prompt computed, then ``tokens`` greedy tokens. The
    run joins the history, where the explorer reads it back and draws its measured bytes and
    speed beside its prediction. Returns the ``Finished``."""

    context: int
    tokens: int = 16
    kind: ClassVar[str] = "measure"

    def run(self, ctx: JobContext) -> Finished:
        from engine.measure import quality  # lazy: importing it loads numpy

        loaded = ctx.model
        longest = (loaded.info.context_length or self.context) - self.tokens
        name, text = quality.read_text(None)
        ids = quality.text_tokens(loaded, text)[1:]
        ids = ids[:max(1, min(self.context - self.tokens, longest, len(ids)))]
        request = GenerationRequest(loaded.tokenizer.decode(ids), mode="raw", max_new_tokens=self.tokens,
                                    ignore_eos=True, reuse_prefix=False)
        final, tokens = None, []
        for event in generate(loaded, request, ctx.cancel):
            if isinstance(event, Finished):
                final = event
            else:
                tokens += [event] if isinstance(event, TokenGenerated) else []
                ctx.emit(event)
        remember(loaded.info, final, "single", f"*Measured for the Cost explorer: {final.prompt_tokens:,} tokens of "
                                               f"{name}, then {final.tokens} tokens.*", tokens)
        return final


@dataclass(frozen=True)
class Scored:
    prompt_ids: tuple[int, ...] | None
    """``None``: a served model's (the server tokenizes)."""
    logprobs: tuple[float, ...] | None
    """``None``: the model could not score these tokens (another tokenizer's ids, say)."""


@dataclass(frozen=True)
class ScoreJob:
    """Teacher-force ``token_ids`` after the request's prompt: each token's log-probability
    under this model (a comparison lane scoring lane 1's answer)."""

    request: GenerationRequest
    token_ids: tuple[int, ...]
    kind: ClassVar[str] = "scoring"

    def run(self, ctx: JobContext) -> Scored:
        from engine.measure.compare import teacher_forced_logprobs  # lazy: importing it loads numpy

        if ctx.model.model is None:  # a served model: its weights are the server's
            return Scored(None, None)
        prompt_ids = ctx.model.encode(self.request)
        try:
            scores = teacher_forced_logprobs(ctx.model, prompt_ids, list(self.token_ids))
        except Exception:  # noqa: BLE001 - a score is a bonus figure: its absence is shown, not fatal
            return Scored(tuple(prompt_ids), None)
        return Scored(tuple(prompt_ids), tuple(scores))


@dataclass(frozen=True)
class Tokenized:
    token_ids: tuple[int, ...]
    pieces: tuple[str, ...]
    """How each token reads on its own."""
    context_length: int | None
    text_tokens: int | None = None
    """The prompt's own text's tokens, without the chat template and system prompt around it."""


@dataclass(frozen=True)
class TokenizeJob:
    """The prompt as the model reads it: its tokens (chat template included), each as text, and
    how much of the context window they take."""

    request: GenerationRequest
    kind: ClassVar[str] = "tokenizing"

    def run(self, ctx: JobContext) -> Tokenized:
        ids = ctx.model.encode(self.request)
        own = len(ctx.model.tokenizer(self.request.prompt, add_special_tokens=False)["input_ids"])
        return Tokenized(tuple(ids), tuple(ctx.model.token_text(i) for i in ids), ctx.model.info.context_length, own)


@dataclass(frozen=True)
class WeightsFigures:
    """The weights' memory, predicted (parameters × bytes each) and measured, beside a reference
    model's prediction (the essay's Llama-3.1-8B: 16 GB in bf16)."""

    parameters: int
    precision: str
    predicted_bytes: int
    measured_bytes: int | None
    reference: str
    reference_parameters: int
    reference_bytes: int
    """The reference in bf16."""

    @property
    def bits_per_parameter(self) -> float:
        return 8 * self.predicted_bytes / self.parameters


@dataclass(frozen=True)
class WeightsJob:
    """Count the loaded model's parameters from its config, predict its weights' bytes in its
    precision, and read what it measured when it loaded (the tour's memory step)."""

    reference: str = "meta-llama/Llama-3.1-8B"
    kind: ClassVar[str] = "weights"

    def run(self, ctx: JobContext) -> WeightsFigures:
        # lazy: counting parameters imports transformers
        from engine.estimates.estimate import count_parameters, shipped_config, weights_bytes

        if ctx.model.model is None:
            raise EngineError("A model served elsewhere keeps its weights on its server: load one here.")
        info = ctx.model.info
        count = count_parameters(ctx.model.model.config)
        predicted = weights_bytes(count, info.precision, info.device.split(":")[0])
        reference = count_parameters(shipped_config(self.reference))
        return WeightsFigures(count.total, info.precision, predicted, info.weights_bytes, self.reference,
                              reference.total, weights_bytes(reference, "bf16"))


@dataclass(frozen=True)
class Ceiling:
    """This machine's read bandwidth, measured when asked, and the decode speed it allows one request."""

    bandwidth_bytes_per_s: float
    source: str
    """How the bandwidth was found (measured when, how)."""
    tokens_per_s: float | None
    """The cost model's ceiling: bandwidth ÷ bytes read per token (weights, then the KV cache)."""
    weights_bytes: int
    """The loaded weights' bytes, and of them what a token reads (all but an input embedding
    table only looked up, a row a token: engine.models.loading.weights_read_bytes)."""
    weights_read_bytes: int
    level: str = "memory"
    """Where a token's bytes are read from: ``memory``, or ``L3`` where they fit in the CPU's
    last-level cache (the ceiling is then that cache's bandwidth, ``level_bandwidth_bytes_per_s``)."""
    level_bandwidth_bytes_per_s: float | None = None
    cache_bytes: int | None = None

    @property
    def bytes_per_token(self) -> float | None:
        bandwidth = self.level_bandwidth_bytes_per_s or self.bandwidth_bytes_per_s
        return bandwidth / self.tokens_per_s if self.tokens_per_s else None


@dataclass(frozen=True)
class CeilingJob:
    """The bandwidth ceiling of one request of ``context`` tokens on this machine: its read
    bandwidth measured now (a second or two: the machine's speed moves with its load), from memory
    and from its last-level cache, and the level a token's bytes fit in."""

    context: int
    kind: ClassVar[str] = "bandwidth ceiling"

    def run(self, ctx: JobContext) -> Ceiling:
        if ctx.model.model is None:
            raise EngineError("A model served elsewhere runs on its server's memory: load one here.")
        profile = profile_for(ctx.model)
        if profile.id == THIS_MACHINE:
            profile = this_machine(bandwidth=True)
        weights = ctx.model.info.weights_bytes
        read = weights_read_bytes(ctx.model.model, weights)
        e = estimate_for(ctx.model, 1, max(1, self.context), profile)
        return Ceiling(profile.bandwidth_bytes_per_s, (profile.sources or {}).get("bandwidth_bytes_per_s", ""),
                       None if e is None else e.decode_tokens_per_s_ceiling, weights, read,
                       "memory" if e is None else e.bandwidth_level, None if e is None else e.bandwidth_bytes_per_s,
                       profile.cache_bytes)


@dataclass(frozen=True)
class QualityResult:
    report: "QualityReport"
    reference: "Reference"
    """This run's kept distributions: lane 1's are the others' reference."""
    pieces: tuple[str, ...]
    """How each scored token reads (the window colours them by their KL divergence)."""
    tokens: tuple[int, ...] = field(default=(), repr=False)
    """The whole text's token ids as this model read it (a served lane is sent these)."""
    bos: int | None = None
    """The BOS id each chunk begins with, where the tokenizer adds one."""


@dataclass(frozen=True)
class QualityJob:
    """Perplexity over a text and, given a reference, the KL divergence from it
    (engine/measure/quality.py): emits ``QualityProgress`` after each batch of chunks; the
    figures join the history."""

    text: str | None = None
    """A UTF-8 file; ``None``: the shipped text."""
    ctx: int = 512
    chunks: int | None = None
    reference: object = field(default=None, compare=False)
    """A ``Reference`` of the same tokens (another precision's run), or ``None``."""
    top_k: int = 512
    read_by: QualityResult | None = field(default=None, compare=False)
    """A served model: the run of the model here whose tokens it is sent (and whose tokens'
    texts its server's are checked against)."""
    kind: ClassVar[str] = "perplexity"

    def run(self, ctx: JobContext) -> QualityResult:
        from engine.measure import quality  # lazy: importing it loads numpy

        name, text = quality.read_text(self.text)
        if ctx.model.model is None:
            return self._served(ctx, name)
        tokens = quality.text_tokens(ctx.model, text)
        report, kept = quality.measure(ctx.model, tokens, name, self.ctx, self.chunks, self.reference, self.top_k,
                                       cancel=ctx.cancel, on_progress=ctx.emit)
        quality.record(ctx.model.info, report)
        pieces = tuple(ctx.model.token_text(i) for i in report.scored_ids)
        return QualityResult(report, kept, pieces, tuple(tokens), quality.adds_bos(ctx.model.tokenizer))

    def _served(self, ctx: JobContext, name: str) -> QualityResult:
        """A served model, scored from the prompt log-probabilities its server returns
        (engine/measure/served_quality.py), on the tokens a model here read."""
        from engine.measure import quality  # lazy: importing it loads numpy
        from engine.measure.served_quality import measure_served  # lazy: importing it loads numpy

        if self.read_by is None:
            raise EngineError("A served model is measured on the tokens of a model here, the same model: put it in "
                              "lane 1 (its tokenizer reads the text, and its distributions are the reference).")
        ours = self.read_by
        texts = dict(zip(ours.report.scored_ids, ours.pieces))
        report = measure_served(ctx.model, ours.tokens, lambda token: texts.get(token, ""), ours.bos, name,
                                self.ctx, self.chunks, self.reference, cancel=ctx.cancel, on_progress=ctx.emit)
        quality.record(ctx.model.info, report)
        return QualityResult(report, None, tuple(texts.get(i, "") for i in report.scored_ids))


@dataclass(frozen=True)
class SweepResult:
    points: tuple["SweepPoint", ...]
    skipped: tuple["SweepSkip", ...]


@dataclass(frozen=True)
class SweepJob:
    """Batch sizes in turn (engine/measure/sweep.py): emits ``Tagged(batch, BatchStep)`` and each
    ``SweepPoint`` as it is measured; the points join the run history for the cost explorer."""

    request: GenerationRequest
    batches: tuple[int, ...]
    kind: ClassVar[str] = "sweep"

    def run(self, ctx: JobContext) -> SweepResult:
        steps: dict[int, list] = {}

        def on_event(batch: int, event) -> None:
            if isinstance(event, BatchStep):
                steps.setdefault(batch, []).append(event)
                ctx.emit(Tagged(batch, event))

        with using_model_service(ctx) as service:  # under each batch's limits in turn
            points, skipped = run_sweep(ctx.model, self.request, self.batches, ctx.cancel, on_event=on_event,
                                        on_point=ctx.emit, service=service)
        if points:
            try:
                record_points(ctx.model, points, len(ctx.model.encode(self.request)), steps)
            except OSError:
                pass  # the history is a convenience: a read-only data folder must not fail the sweep
        return SweepResult(tuple(points), tuple(skipped))


BUILDING_DRAFT = "building"
"""What a speculative run says while its draft's compiled step is built (its first on this machine)."""


@dataclass(frozen=True)
class SpeculateJob:
    """Speculative decoding with ``draft`` (kept loaded for the next job), after plain decoding of
    the same request when ``compare_plain``: emits ``Tagged("plain" | "speculative", event)``;
    returns the report (engine/generation/speculative.py)."""

    request: GenerationRequest
    draft: str
    draft_tokens: int
    compare_plain: bool = False
    kind: ClassVar[str] = "speculative decoding"

    def run(self, ctx: JobContext) -> dict:
        from engine.measure.speculative_run import speculative_report  # lazy: importing it loads numpy

        spec = parse_draft(self.draft, ctx.model.info.precision)
        draft = ctx.keep.get("draft")
        if draft is None or draft.spec != spec:
            if draft is not None:
                draft.close()
            ctx.keep.pop("draft", None)
            ctx.keep["draft"] = draft = load_draft(spec, ctx.model, cancel=ctx.cancel)
        if draft.compiling():  # the draft's own compiled step, before any timing
            ctx.emit(Tagged("draft", BUILDING_DRAFT))
            draft.wait_for_compile(lambda: ctx.cancel.cancelled)
        with using_model_service(ctx) as service:  # lent to the draft for the run
            return speculative_report(ctx.model, draft, self.request, self.draft_tokens, self.compare_plain,
                                      ctx.cancel, lambda run, event: ctx.emit(Tagged(run, event)), record=True,
                                      service=service)


@dataclass(frozen=True)
class ServerStarted:
    """The server listens: where, for which model, within which limits."""

    url: str
    model_name: str
    max_batch: int
    kv_budget_bytes: int
    api_key: bool
    """Whether clients need a key (the key itself never leaves the job)."""
    ceilings: tuple[tuple[int, float], ...] = ()
    """The cost model's decode ceiling (batch, tok/s all requests) on this machine."""
    defaults: "Defaults | None" = None
    """What requests that leave sampling or ``max_tokens`` out get (engine/serve/protocol.py)."""
    kv: str = ""
    """The KV cache's blocks and whether prefix caching is on (and why not), in a line."""
    kv_dtype: str = ""
    """What the cache keeps keys and values in (``Loaded.kv_dtype``)."""
    kv_bytes_per_token: int | None = None
    """A token's keys and values in that dtype (``None``: not known)."""


@dataclass(frozen=True)
class Served:
    url: str
    requests: int


@dataclass(frozen=True)
class ServeJob:
    """The model behind the OpenAI-compatible API (engine/serve) until cancelled: emits
    :class:`ServerStarted`, then the core's traffic events (engine/generation/service.py) as they
    happen; cancelling drains the requests in flight, or cancels them if ``stop_now`` is set
    (then or later). Other jobs of this model wait meanwhile."""

    settings: object
    """engine.serve.server.ServeSettings"""
    stop_now: CancelToken = field(default_factory=CancelToken, compare=False)
    kind: ClassVar[str] = "serving"

    def run(self, ctx: JobContext) -> Served:
        from engine.serve.server import Server  # lazy: importing it loads uvicorn

        service = model_service(ctx)
        if service is None:
            raise EngineError(f"{ctx.model.info.name} is served elsewhere: it can't be served again from here. "
                              "Load a local model to serve it.")
        alone, waiting = service.settings, service.max_waiting
        try:
            server = Server(ctx.model, self.settings, service=service)  # the window's, under the server's limits
        except BaseException:  # a busy port, say: the window's service goes back as it was
            service.reconfigure(alone, waiting)
            raise
        settings = server.service.settings
        stop_listening = server.service.listen(ctx.emit)
        server.start(core_thread=False)  # the core steps on this thread, where the model was loaded
        watcher = threading.Thread(target=self._watch, args=(ctx, server), name="serve-watch", daemon=True)
        try:
            ceilings = tuple((b, c) for b in sorted({1, 2, 4, 8, 16, 32, 64, settings.max_batch})
                             if b <= settings.max_batch and (c := ceiling_for(ctx.model, b, 512)) is not None)
            # the window's prompts join the served batch: the door opens before anyone hears of the
            # start, so a prompt sent the moment the window hears of it finds the door open
            if ctx.door is not None:
                ctx.door.open(server.service, ctx.emit)
            info = ctx.model.info
            ctx.emit(ServerStarted(server.url, server.model_name, settings.max_batch, settings.kv_budget_bytes,
                                   bool(self.settings.api_key), ceilings, server.defaults,
                                   server.service.describe_kv(), info.kv_dtype, info.kv_bytes_per_token))
            watcher.start()
            server.run_core()
            requested = ctx.cancel.cancelled
        finally:
            if ctx.door is not None:
                ctx.door.close()
            ctx.cancel.cancel()  # the watcher ends too
            ended = server.stop(drain=False, timeout=30)
            stop_listening()
            served = service.served
            if ended and service.core is not None and service.core.idle:  # back to one request at a
                service.reconfigure(alone, waiting)  # time, its prefix cache kept
                service.reopen()
            else:  # still stopping, or broken: the next job gets a fresh one
                ctx.keep.pop("service", None)
        if not requested:
            raise RuntimeError("The server stopped by itself (see the log).")
        return Served(server.url, served)

    def _watch(self, ctx: JobContext, server) -> None:
        """Turn the job's cancel (and ``stop_now``) into the service's stop; stop it too if HTTP
        died by itself."""
        while not ctx.cancel.wait(0.5):
            if not server.running:
                server.service.stop(drain=False)
                return
        server.service.stop(drain=not self.stop_now.cancelled)
        while not server.service.join(0.1):
            if self.stop_now.cancelled:
                server.service.stop(drain=False)
