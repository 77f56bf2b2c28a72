"""Speculative decoding: a cheap draft guesses N tokens, the target checks them in one pass.

A decode step of a big model costs about the same for 1 token as for 5 (it is bound by
reading the weights), so when a small draft guesses right the target confirms several
tokens for the price of one. Per step: the draft proposes ``d1…dN`` one at a time; the
target runs once over ``[last, d1…dN]`` and so knows what it would have picked after each;
the longest agreeing prefix is kept, plus the target's own next token (a correction where
it disagreed, a bonus when it agreed with all N). Both caches roll back to what was kept.

Greedy output equals plain greedy decoding token for token. With sampling, each draft
token is accepted with probability min(1, p/q) and a rejection draws from max(0, p − q)
(Leviathan et al., 2023), which leaves the output distribution that of the target.

Drafts: another model with the same tokenizer, the same model at a lower precision, or the
target's own first K layers with its final norm and head ("early exit": no extra memory).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.cancel import CancelToken
from engine.decoding import PREFILL_CHUNK, finished_event, stop_reason, top_scores
from engine.detokenize import IncrementalDetokenizer
from engine.errors import (
    EngineError,
    InvalidRequestError,
    NonFiniteError,
    OutOfMemoryError,
    is_out_of_memory,
    non_finite_message,
)
from engine.events import Alternative, DraftVerified, Finished, GenerationEvent, Prefilled, TokenGenerated
from engine.kv import cache_bytes
from engine.memory import MemoryProbe
from engine.precision import PRECISIONS
from engine.request import GenerationRequest
from engine.sampling import apply_repetition_penalty, argmax, distribution
from engine.threads import adapt as adapt_threads

if TYPE_CHECKING:
    import torch

    from engine.model import LoadedModel

MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class DraftSpec:
    """``early-exit:K``, ``default:PRECISION``, or a model (folder, .gguf, hub id) with an optional
    ``:PRECISION`` (the target's precision otherwise)."""

    kind: str  # "early-exit" or "model"
    layers: int = 0
    model: str = ""
    precision: str = ""

    @property
    def label(self) -> str:
        return f"early-exit:{self.layers}" if self.kind == "early-exit" else f"{self.model}:{self.precision}"


def parse_draft(text: str, target_precision: str) -> DraftSpec:
    text = (text or "").strip()
    if not text:
        raise InvalidRequestError("Name a draft: early-exit:K, default:PRECISION or a model folder/file/hub id.")
    if text == "early-exit" or text.startswith("early-exit:"):
        _, _, layers = text.partition(":")
        try:
            count = int(layers)
        except ValueError:
            raise InvalidRequestError(f"early-exit needs a layer count, e.g. early-exit:8, not {text!r}.") from None
        return DraftSpec("early-exit", layers=count)
    head, sep, tail = text.rpartition(":")
    if sep and tail.lower() in PRECISIONS:
        return DraftSpec("model", model=head, precision=tail.lower())
    return DraftSpec("model", model=text, precision=target_precision)


class Draft:
    """The model that proposes tokens: its own loaded model, or a view of the target's layers."""

    def __init__(self, model, spec: DraftSpec, loaded: "LoadedModel | None" = None,
                 supports_logits_to_keep: bool = True) -> None:
        self.model = model
        self.spec = spec
        self.loaded = loaded
        self.supports_logits_to_keep = loaded.supports_logits_to_keep if loaded else supports_logits_to_keep

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def weights_bytes(self) -> int:
        """Extra memory the draft's weights take (0 for early exit: it shares the target's)."""
        return self.loaded.info.weights_bytes if self.loaded else 0

    def close(self) -> None:
        self.model = None
        if self.loaded is not None:
            self.loaded.close()


def _decoder_layers(model):
    """(owner module, attribute name, ModuleList) of a causal LM's stack of decoder layers."""
    import torch

    base = getattr(model, model.base_model_prefix, None)
    layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    if base is not None:
        for name, child in base.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) == layers:
                return base, name, child
    raise InvalidRequestError(f"Early exit is not supported for {type(model).__name__}: its layers were not found.")


def early_exit_model(model, layers: int):
    """A view of ``model`` that runs only its first ``layers`` decoder layers, then the final
    norm and the head. It shares every weight with ``model`` (no copy, no extra memory)."""
    import torch

    base, name, stack = _decoder_layers(model)
    total = len(stack)
    if not 1 <= layers < total:
        raise InvalidRequestError(f"Early exit needs between 1 and {total - 1} layers of this {total}-layer model, "
                                  f"not {layers}.")
    config = copy.deepcopy(model.config)
    text = config.get_text_config(decoder=True)
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:layers]
    view_base = copy.copy(base)
    view_base._modules = dict(base._modules)
    view_base._modules[name] = torch.nn.ModuleList(list(stack)[:layers])
    view_base.config = text if base.config is model.config.get_text_config(decoder=True) else config
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._modules[model.base_model_prefix] = view_base
    view.config = config
    return view


def load_draft(spec: DraftSpec, target: "LoadedModel", progress: Callable | None = None,
               cancel: CancelToken | None = None) -> Draft:
    if spec.kind == "early-exit":
        return Draft(early_exit_model(target.model, spec.layers), spec,
                     supports_logits_to_keep=target.supports_logits_to_keep)
    from engine.loading import LoadRequest, load_model

    loaded = load_model(LoadRequest(spec.model, spec.precision, str(target.device)), progress=progress, cancel=cancel)
    if loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        name = loaded.info.name
        loaded.close()
        raise InvalidRequestError(f"The draft {name} has another tokenizer than {target.info.name}: a draft must "
                                  "share the target's vocabulary so its tokens mean the same.")
    return Draft(loaded.model, spec, loaded)


def stream_speculative(target: "LoadedModel", draft: Draft, request: GenerationRequest, draft_tokens: int,
                       cancel: CancelToken | None = None) -> Iterator[GenerationEvent]:
    """Like :meth:`LoadedModel.generate`, with :class:`DraftVerified` events between the tokens."""
    if target.model is None or draft.model is None:
        raise EngineError("The model or its draft was unloaded: load it again.")
    if not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise InvalidRequestError(f"Draft tokens per step must be from 1 to {MAX_DRAFT_TOKENS}, not {draft_tokens!r}.")
    request = request.validated()
    prompt_ids = target.encode(request)
    return _guarded(target, draft, request, prompt_ids, draft_tokens, cancel or CancelToken())


def _guarded(target, draft, request, prompt_ids, draft_tokens, cancel) -> Iterator[GenerationEvent]:
    try:
        yield from _run(target, draft, request, prompt_ids, draft_tokens, cancel)
    except EngineError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            raise OutOfMemoryError(f"Out of memory on {target.device} during speculative decoding: "
                                   "use a smaller draft or fewer tokens.") from exc
        raise EngineError(f"Speculative decoding failed: {type(exc).__name__}: {exc}") from exc


def _run(target: "LoadedModel", draft: Draft, request: GenerationRequest, prompt_ids: list[int],
         draft_tokens: int, cancel: CancelToken) -> Iterator[GenerationEvent]:
    import torch
    from transformers import DynamicCache

    model, draft_model, device = target.model, draft.model, target.device
    params = request.sampling
    exact_greedy = params.greedy and params.repetition_penalty == 1.0
    generator = None
    if not params.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed) if params.seed is not None else generator.seed()
    context = target.info.context_length
    eos = frozenset() if request.ignore_eos else target.eos_ids
    special = frozenset(target.tokenizer.all_special_ids)
    keep = {"logits_to_keep": 1} if target.supports_logits_to_keep else {}
    draft_keep = {"logits_to_keep": 1} if draft.supports_logits_to_keep else {}
    top_k = request.top_alternatives
    detok = IncrementalDetokenizer(target.tokenizer)
    probe = MemoryProbe(device)
    predicted = target.predicted_kv_bytes
    n_prompt = len(prompt_ids)
    committed = list(prompt_ids)
    tokens: list[int] = []
    latencies: list[float] = []
    drafted_total = accepted_total = 0

    width = None

    def fit(scores: "torch.Tensor") -> "torch.Tensor":
        """Draft scores over the target's vocabulary: models sharing a tokenizer may pad their
        output layers to different widths (Qwen2.5 0.5B: 151,936; 7B: 152,064)."""
        if width is None or scores.numel() == width:
            return scores
        if scores.numel() > width:
            return scores[:width]
        return torch.cat([scores, scores.new_full((width - scores.numel(),), float("-inf"))])

    def ids_tensor(ids: list[int]) -> "torch.Tensor":
        return torch.tensor([ids], dtype=torch.long, device=device)

    def seen(extra: list[int] = ()) -> "torch.Tensor":
        return torch.tensor(committed + list(extra), dtype=torch.long, device=device)

    def pick(scores: "torch.Tensor", extra: list[int] = ()) -> int:
        """The token the plain sampler would choose after ``committed + extra``."""
        if exact_greedy:
            return argmax(scores)
        if params.greedy:
            return argmax(apply_repetition_penalty(scores, seen(extra), params.repetition_penalty))
        return int(torch.multinomial(distribution(params, scores, seen(extra)), 1, generator=generator))

    def finished(reason, stop_string=None) -> Finished:
        return finished_event(reason, tokens, latencies, n_prompt, start, probe, cache_bytes(target_cache),
                              predicted(len(committed) - 1), detok.text, stop_string,
                              drafted_tokens=drafted_total, accepted_tokens=accepted_total)

    def emit(token: int, scores: "torch.Tensor", latency: float, drafted: bool | None, unused: float = 0.0):
        """The TokenGenerated for ``token`` and the reason to stop after it (or None). ``unused``:
        time of the step's later tokens, charged to this one if the generation stops here."""
        with torch.inference_mode():
            log_total = float(torch.logsumexp(scores, dim=-1))
            alternatives = ()
            if top_k:
                ids, values = top_scores(scores, top_k)
                alternatives = tuple(Alternative(i, target.token_text(i), v - log_total) for i, v in zip(ids, values))
            chosen = float(scores[token]) - log_total
        if not math.isfinite(log_total):
            raise NonFiniteError(non_finite_message(target.info.precision, target.info.name, len(tokens)),
                                 finished("error"))
        tokens.append(token)
        committed.append(token)
        piece = detok.add(token)
        reason, stop_string = stop_reason(token, piece, detok.text, request, eos, len(tokens), len(committed),
                                          context, cancel)
        if reason is not None:
            piece += detok.flush()
            latency += unused
        latencies.append(latency)
        in_cache = min(target_length, len(committed) - 1)
        event = TokenGenerated(
            index=len(tokens) - 1, token_id=token, text=piece, logprob=chosen, top_alternatives=alternatives,
            latency_s=latency, elapsed_s=time.perf_counter() - start, kv_cache_bytes=cache_bytes(target_cache),
            kv_cache_bytes_predicted=predicted(in_cache), memory=probe.sample(), special=token in special,
            drafted=drafted,
        )
        return event, reason, stop_string

    adapt_threads(force=True)
    probe.reset_peak()
    probe.sample()
    start = time.perf_counter()
    target_cache = DynamicCache(config=model.config)
    target_cache.activate_past_recording()  # sliding-window layers keep what a rollback needs
    draft_cache = DynamicCache(config=draft_model.config)
    draft_cache.activate_past_recording()
    target_length = draft_length = 0
    prompt = ids_tensor(prompt_ids)
    # the prompt goes through the target and the draft alike (the draft's share is part of the TTFT)
    for chunk in range(0, n_prompt, PREFILL_CHUNK):
        if cancel.cancelled:
            yield finished("cancelled")
            return
        with torch.inference_mode():
            out = model(input_ids=prompt[:, chunk:chunk + PREFILL_CHUNK], cache=target_cache, use_cache=True, **keep)
            draft_model(input_ids=prompt[:, chunk:chunk + PREFILL_CHUNK], cache=draft_cache, use_cache=True,
                        **draft_keep)
        target_length = draft_length = min(n_prompt, chunk + PREFILL_CHUNK)
    prefill_s = time.perf_counter() - start
    yield Prefilled(prompt_tokens=n_prompt, prefill_s=prefill_s,
                    prefill_tokens_per_s=n_prompt / prefill_s if prefill_s > 0 else 0.0,
                    kv_cache_bytes=cache_bytes(target_cache), kv_cache_bytes_predicted=predicted(n_prompt),
                    memory=probe.sample())
    resumed = time.perf_counter()  # the consumer's time with Prefilled is not the model's
    with torch.inference_mode():
        scores = out.logits[0, -1].float()
        width = scores.numel()
        first = pick(scores)
    event, reason, stop_string = emit(first, scores, prefill_s + time.perf_counter() - resumed, False)
    yield event
    if reason is not None:
        yield finished(reason, stop_string)
        return

    step = 0
    step_start = time.perf_counter()
    while True:
        adapt_threads()
        room = request.max_new_tokens - len(tokens) - 1  # the target always adds one token of its own
        if context is not None:
            room = min(room, context - len(committed) - 1)
        n = max(0, min(draft_tokens, room))
        drafted: list[int] = []
        draft_probs: list["torch.Tensor"] = []
        with torch.inference_mode():
            if n:
                out = draft_model(input_ids=ids_tensor(committed[draft_length:]), cache=draft_cache, use_cache=True,
                                  **draft_keep)
                draft_length = len(committed)
                for j in range(n):
                    scores = fit(out.logits[0, -1].float())
                    if params.greedy:
                        drafted.append(pick(scores, drafted))
                    else:
                        q = distribution(params, scores, seen(drafted))
                        draft_probs.append(q)
                        drafted.append(int(torch.multinomial(q, 1, generator=generator)))
                    if j < n - 1:
                        out = draft_model(input_ids=ids_tensor(drafted[-1:]), cache=draft_cache, use_cache=True,
                                          **draft_keep)
                        draft_length += 1
            draft_s = time.perf_counter() - step_start
            verify_start = time.perf_counter()
            feed = committed[target_length:] + drafted
            verify_keep = {"logits_to_keep": n + 1} if target.supports_logits_to_keep else {}
            out = model(input_ids=ids_tensor(feed), cache=target_cache, use_cache=True, **verify_keep)
            rows = out.logits[0, -(n + 1):].float()
            accepted, own = 0, None
            for j in range(n):
                if params.greedy:
                    choice = pick(rows[j], drafted[:j])
                    if choice == drafted[j]:
                        accepted += 1
                        continue
                    own = choice
                    break
                p = distribution(params, rows[j], seen(drafted[:j]))
                d = drafted[j]
                ratio = float(p[d]) / max(float(draft_probs[j][d]), 1e-30)
                if float(torch.rand((), generator=generator, device=device)) < min(1.0, ratio):
                    accepted += 1
                    continue
                residual = (p - draft_probs[j]).clamp(min=0)
                residual = residual if float(residual.sum()) > 0 else p
                own = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
                break
            if own is None:
                own = pick(rows[n], drafted)
            # roll both caches back to what was kept
            target_length = len(committed) + accepted
            target_cache.crop(-(len(committed) + n - target_length))
            if n:
                kept = len(committed) + min(accepted, n - 1)
                draft_cache.crop(-(draft_length - kept))
                draft_length = kept
            verify_s = time.perf_counter() - verify_start
        drafted_total += n
        accepted_total += accepted
        now = time.perf_counter()
        if n:
            yield DraftVerified(step=step, drafted_ids=tuple(drafted),
                                drafted_text=tuple(target.token_text(t) for t in drafted), accepted=accepted,
                                draft_s=draft_s, verify_s=verify_s, elapsed_s=now - start)
        step += 1
        emitted = drafted[:accepted] + [own]
        share = (now - step_start) / len(emitted)
        for j, token in enumerate(emitted):
            event, reason, stop_string = emit(token, rows[j], share, j < accepted,
                                              unused=share * (len(emitted) - 1 - j))
            yield event
            if reason is None and cancel.cancelled and not detok.pending:
                reason = "cancelled"
            if reason is not None:
                yield finished(reason, stop_string)
                return
        step_start = time.perf_counter()


def speculative_report(target: "LoadedModel", draft: Draft, request: GenerationRequest, draft_tokens: int,
                       compare_plain: bool = False, cancel: CancelToken | None = None,
                       on_event: Callable[[str, GenerationEvent], None] | None = None,
                       record: bool = False) -> dict:
    """The bench report of a speculative run, with the draft's counts, and (``compare_plain``)
    the speed-up over plain decoding of the same request measured right before it. ``record``:
    keep the run in the history (a read-only data folder doesn't fail the run)."""
    from engine import bench

    plain = None
    if compare_plain:
        plain = bench.run(target, request, cancel,
                          on_event=(lambda e: on_event("plain", e)) if on_event else None)
    prefilled, tokens, final = None, [], None
    for event in stream_speculative(target, draft, request, draft_tokens, cancel):
        if on_event is not None:
            on_event("speculative", event)
        if isinstance(event, Prefilled):
            prefilled = event
        elif isinstance(event, TokenGenerated):
            tokens.append(event)
        elif isinstance(event, Finished):
            final = event
    result = bench.report(target, request, prefilled, tokens, final)
    result.update(summary(final, draft, draft_tokens, plain))
    if record and final is not None and final.tokens:
        from engine import history

        extra = {k: v for k, v in result.items() if k in SUMMARY_KEYS}
        try:
            history.save(history.record_from(target.info, final, "speculative", series=history.series_from(tokens),
                                             transcript_markdown=final.text, **extra))
        except OSError:
            pass
    return result


SUMMARY_KEYS = ("draft", "draft_tokens_per_step", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "plain_decode_tokens_per_s", "speedup_vs_plain", "wall_speedup_vs_plain", "same_tokens_as_plain")


def summary(final: Finished, draft: Draft, draft_tokens: int, plain: dict | None = None) -> dict:
    drafted, accepted = final.drafted_tokens or 0, final.accepted_tokens or 0
    out = {
        "draft": draft.label, "draft_tokens_per_step": draft_tokens, "draft_weights_bytes": draft.weights_bytes,
        "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
    }
    if plain is not None:
        speed, base = final.decode_tokens_per_s, plain["decode_tokens_per_s"]
        out["plain_decode_tokens_per_s"] = base
        out["speedup_vs_plain"] = speed / base if speed and base else None
        out["wall_speedup_vs_plain"] = plain["total_s"] / final.total_s if final.total_s else None
        out["same_tokens_as_plain"] = list(final.token_ids) == plain["token_ids"]
    return out
