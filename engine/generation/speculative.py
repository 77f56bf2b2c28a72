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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.base.cancel import CancelToken
from engine.base.errors import EngineError, InvalidRequestError
from engine.base.events import DraftVerified, GenerationEvent
from engine.models.precision import PRECISIONS
from engine.base.request import GenerationRequest
from engine.generation.sampling import SamplingParams, apply_repetition_penalty, argmax, distribution
from engine.models.loading import LoadRequest, load_model
from engine.generation.generate import stream
from engine.generation.runners import runner_for

if TYPE_CHECKING:
    import torch

    from engine.models.model import LoadedModel

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
                 supports_logits_to_keep: bool = True, fast=None) -> None:
        self.model = model
        self.spec = spec
        self.loaded = loaded
        self.supports_logits_to_keep = loaded.supports_logits_to_keep if loaded else supports_logits_to_keep
        self.fast = loaded.fast if loaded is not None else fast
        """The fast path's decoder the draft runs on (its own, or a view of the target's), if any."""

    def runner(self):
        """A fresh engine-core runner for the draft: the fast path's slot cache where the draft
        has one, else transformers' forward (caches that can roll back)."""

        return runner_for(self.model, self.fast, self.supports_logits_to_keep, rollback=True)

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def weights_bytes(self) -> int:
        """Extra memory the draft's weights take (0 for early exit: it shares the target's)."""
        return self.loaded.info.weights_bytes if self.loaded else 0

    def close(self) -> None:
        self.model = self.fast = None
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
        view = early_exit_model(target.model, spec.layers)
        fast = None
        if target.fast is not None:
            from engine.models.fast import early_exit_decoder  # lazy: importing it loads numpy, torch

            fast = early_exit_decoder(target.fast, spec.layers)
        return Draft(view, spec, supports_logits_to_keep=target.supports_logits_to_keep, fast=fast)

    loaded = load_model(LoadRequest(spec.model, spec.precision, str(target.device)), progress=progress, cancel=cancel)
    if loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        name = loaded.info.name
        loaded.close()
        raise InvalidRequestError(f"The draft {name} has another tokenizer than {target.info.name}: a draft must "
                                  "share the target's vocabulary so its tokens mean the same.")
    return Draft(loaded.model, spec, loaded)


def stream_speculative(target: "LoadedModel", draft: Draft, request: GenerationRequest, draft_tokens: int,
                       cancel: CancelToken | None = None) -> Iterator[GenerationEvent]:
    """Like :meth:`LoadedModel.generate`, with :class:`DraftVerified` events between the tokens:
    the request alone in an engine core whose decode step is :class:`Speculation`'s."""

    if target.model is None or draft.model is None:
        raise EngineError("The model or its draft was unloaded: load it again.")
    speculation = Speculation(target, draft, draft_tokens)
    request = request.validated()
    return stream(target, request, target.encode(request), cancel or CancelToken(), speculation)


@dataclass
class _Sequence:
    """One request's speculation state."""

    params: SamplingParams
    generator: "torch.Generator | None"
    length: int = 0
    """Tokens in the draft's cache."""
    drafted: int = 0
    accepted: int = 0
    step: int = 0


@dataclass(frozen=True)
class Verified:
    """What one speculative step of a request gives: the tokens to emit, each with the target's
    scores before it and whether the draft proposed it, and the step's :class:`DraftVerified`
    (``None`` when there was no room to draft). ``finite``: false when the target's scores
    went NaN/inf at the token after the emitted ones."""

    tokens: list[tuple[int, "torch.Tensor", bool]]
    verified: DraftVerified | None
    finite: bool = True


class Speculation:
    """The engine core's speculative decode step (engine/generation/core.py): for each generating request
    the draft proposes up to ``draft_tokens`` tokens one at a time on its own runner, the target
    runner checks them in one forward pass, and both caches roll back to what was kept. The
    draft reads every prompt with the target, so its share is part of the TTFT."""

    def __init__(self, target: "LoadedModel", draft: Draft, draft_tokens: int) -> None:
        if not isinstance(draft_tokens, int) or isinstance(draft_tokens, bool) \
                or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(
                f"Draft tokens per step must be from 1 to {MAX_DRAFT_TOKENS}, not {draft_tokens!r}.")
        self.target, self.draft, self.draft_tokens = target, draft, draft_tokens
        self.runner = draft.runner()
        head = target.model.get_output_embeddings()
        self.width = getattr(head, "out_features", None) or target.model.config.get_text_config().vocab_size
        self.sequences: dict[int, _Sequence] = {}

    # -- the core's hooks --------------------------------------------------------------
    def add(self, seq: int, request: GenerationRequest, tokens: int) -> None:
        import torch

        params = request.sampling
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.target.device)
            generator.manual_seed(params.seed) if params.seed is not None else generator.seed()
        self.runner.add(seq, tokens)
        self.sequences[seq] = _Sequence(params, generator)

    def remove(self, seq: int) -> None:
        if self.sequences.pop(seq, None) is not None:
            self.runner.remove(seq)

    def prefill(self, seq: int, ids: "torch.Tensor") -> None:
        self.runner.prefill(seq, ids)
        self.sequences[seq].length += ids.shape[1]

    def counts(self, seq: int) -> dict:
        state = self.sequences.get(seq)
        return {"drafted_tokens": state.drafted if state else 0, "accepted_tokens": state.accepted if state else 0}

    def step(self, target_runner, seq: int, committed: list[int], room: int, started: float) -> Verified:
        """One speculative step of ``seq``, whose tokens so far are ``committed`` (its last one
        not yet in the target's cache); ``room``: tokens it may still get."""
        import torch

        state = self.sequences[seq]
        params, generator = state.params, state.generator
        device = self.target.device
        exact_greedy = params.greedy and params.repetition_penalty == 1.0

        def ids_tensor(ids: list[int]) -> "torch.Tensor":
            return torch.tensor([ids], dtype=torch.long, device=device)

        def seen(extra: list[int]) -> "torch.Tensor":
            return torch.tensor(committed + extra, dtype=torch.long, device=device)

        def pick(scores: "torch.Tensor", extra: list[int]) -> int:
            """The token the plain sampler would choose after ``committed + extra``."""
            if exact_greedy:
                return argmax(scores)
            if params.greedy:
                return argmax(apply_repetition_penalty(scores, seen(extra), params.repetition_penalty))
            return int(torch.multinomial(distribution(params, scores, seen(extra)), 1, generator=generator))

        n = max(0, min(self.draft_tokens, room - 1))  # the target always adds one token of its own
        drafted: list[int] = []
        draft_probs: list["torch.Tensor"] = []
        cached = len(committed) - 1  # in the target's cache
        with torch.inference_mode():
            if n:
                scores = self.runner.prefill(seq, ids_tensor(committed[state.length:]))
                state.length = len(committed)
                for j in range(n):
                    scores = self._fit(scores.float())
                    if params.greedy:
                        drafted.append(pick(scores, drafted))
                    else:
                        q = distribution(params, scores, seen(drafted))
                        draft_probs.append(q)
                        drafted.append(int(torch.multinomial(q, 1, generator=generator)))
                    if j < n - 1:
                        scores = self.runner.prefill(seq, ids_tensor(drafted[-1:]))
                        state.length += 1
            draft_s = time.perf_counter() - started
            verify_start = time.perf_counter()
            rows = target_runner.prefill(seq, ids_tensor(committed[-1:] + drafted), rows=n + 1)
            rows = rows.float().view(n + 1, -1)
            finite = torch.isfinite(torch.logsumexp(rows, dim=-1)).tolist()
            accepted, own = 0, None
            for j in range(n):
                if not finite[j]:
                    break
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
            ok = finite[accepted]
            if own is None and ok:
                own = pick(rows[n], drafted)
            # roll both caches back to what was kept: the accepted guesses (the target's own token
            # goes in with the next step)
            target_runner.crop(seq, cached + 1 + accepted)
            if n:
                state.length = min(state.length, len(committed) + min(accepted, n - 1))
                self.runner.crop(seq, state.length)
            verify_s = time.perf_counter() - verify_start
        state.drafted += n
        state.accepted += accepted
        verified = None
        if n:
            verified = DraftVerified(step=state.step, drafted_ids=tuple(drafted),
                                     drafted_text=tuple(self.target.token_text(t) for t in drafted),
                                     accepted=accepted, draft_s=draft_s, verify_s=verify_s, elapsed_s=0.0,
                                     request_id=seq)
        state.step += 1
        tokens = [(token, rows[j], True) for j, token in enumerate(drafted[:accepted])]
        if ok:
            tokens.append((own, rows[accepted], False))
        return Verified(tokens, verified, ok)

    def _fit(self, scores: "torch.Tensor") -> "torch.Tensor":
        """Draft scores over the target's vocabulary: models sharing a tokenizer may pad their
        output layers to different widths (Qwen2.5 0.5B: 151,936; 7B: 152,064)."""
        import torch

        width = self.width
        if width is None or scores.numel() == width:
            return scores
        if scores.numel() > width:
            return scores[:width]
        return torch.cat([scores, scores.new_full((width - scores.numel(),), float("-inf"))])
