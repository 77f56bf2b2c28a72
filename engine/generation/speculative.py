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

Drafts: another model with the same tokenizer, the same model at a lower precision, the
target's own first K layers with its final norm and head ("early exit": no extra memory), or
no model at all: prompt lookup (``ngram:N``, vLLM's ``ngram`` method, transformers'
``prompt_lookup_num_tokens``) guesses that the text goes on as it went on after the last N
tokens' latest earlier occurrence in the prompt and answer. It costs nothing to run, so it pays
wherever an answer repeats its input (edits, extraction, quoting, code changes) and costs
only the verification's extra rows where it guesses wrong.
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
from engine.base.kv import kv_layout
from engine.models.precision import PRECISIONS
from engine.base.request import GenerationRequest
from engine.generation.proposer import MAX_DRAFT_TOKENS, NOTHING, Proposal, Proposer
from engine.models.loading import LoadRequest, load_model
from engine.generation.generate import stream
from engine.generation.kv_manager import KVCacheManager
from engine.generation.runners import runner_for

if TYPE_CHECKING:
    import torch

    from engine.generation.service import EngineService
    from engine.generation.sampling import RequestSampler
    from engine.models.model import LoadedModel

NGRAM = 3
"""The n-gram prompt lookup matches when none is named (``ngram``)."""
MAX_NGRAM = 8


@dataclass(frozen=True)
class DraftSpec:
    """``early-exit:K``, ``ngram[:N]``, ``default:PRECISION``, or a model (folder, .gguf, hub id)
    with an optional ``:PRECISION`` (the target's precision otherwise)."""

    kind: str  # "early-exit", "ngram" or "model"
    layers: int = 0
    """Early exit: the target's layers the draft runs; prompt lookup: the n-gram's tokens."""
    model: str = ""
    precision: str = ""

    @property
    def label(self) -> str:
        if self.kind == "model":
            return f"{self.model}:{self.precision}"
        return f"{self.kind}:{self.layers}"


def parse_draft(text: str, target_precision: str) -> DraftSpec:
    text = (text or "").strip()
    if not text:
        raise InvalidRequestError("Name a draft: early-exit:K, ngram:N, default:PRECISION or a model "
                                  "folder/file/hub id.")
    if text == "ngram" or text.startswith("ngram:"):
        _, _, size = text.partition(":")
        try:
            count = int(size) if size else NGRAM
        except ValueError:
            count = 0
        if not 1 <= count <= MAX_NGRAM:
            raise InvalidRequestError(f"ngram needs a size from 1 to {MAX_NGRAM} tokens, e.g. ngram:3, not {text!r}.")
        return DraftSpec("ngram", layers=count)
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
    """What proposes tokens: a model of its own, a view of the target's layers, or (prompt lookup)
    no model at all (``model`` ``None``)."""

    def __init__(self, model, spec: DraftSpec, loaded: "LoadedModel | None" = None,
                 supports_logits_to_keep: bool = True, fast=None) -> None:
        self.model = model
        self.spec = spec
        self.loaded = loaded
        self.supports_logits_to_keep = loaded.supports_logits_to_keep if loaded else supports_logits_to_keep
        self.fast = loaded.fast if loaded is not None else fast
        """The fast path's decoder the draft runs on (its own, or a view of the target's), if any."""

    def runner(self):
        """A fresh engine-core runner for the draft: the fast path's paged cache where the draft
        has one, else transformers' forward (caches that can roll back)."""

        return runner_for(self.model, self.fast, self.supports_logits_to_keep, rollback=True)

    def proposer(self, target: "LoadedModel", draft_tokens: int) -> "Guesses":
        """The engine core's proposer for a run of ``target`` with this draft."""
        if self.spec.kind == "ngram":
            return PromptLookup(target, self.spec.layers, draft_tokens)
        if target.model is None or self.model is None:
            raise EngineError("The model or its draft was unloaded: load it again.")
        return Speculation(target, self, draft_tokens)

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def weights_bytes(self) -> int:
        """Extra memory the draft's weights take (0 for early exit: it shares the target's)."""
        return self.loaded.info.weights_bytes if self.loaded else 0

    def compile_when_ready(self, target: "LoadedModel") -> None:
        """Where the target's compiled step is ready, build (or load) the draft's own on a
        background thread, as the target's was: its guesses run the eager step until then."""
        fast = self.fast
        if fast is None or fast.compiled is not None or fast._compile_thread is not None:
            return
        if target.fast is None or target.fast.compiled is None:
            return
        from engine.generation.compiled_step import compile_in_background  # lazy: importing it loads torch's export

        compile_in_background(fast, rows=False)  # one row at a time: the draft guesses one token after another

    def compiling(self) -> bool:
        """Whether the draft's compiled step is being built (or loaded) on its thread."""
        thread = self.fast._compile_thread if self.fast is not None else None
        return thread is not None and thread.is_alive()

    def wait_for_compile(self, cancelled=lambda: False) -> None:
        """Until the draft's compiled step is ready (or its build failed), or ``cancelled()``: a
        measured run's draft runs its own step, and its build doesn't share the machine with it."""
        while self.compiling() and not cancelled():
            self.fast._compile_thread.join(0.2)

    def close(self) -> None:
        if self.fast is not None:
            self.fast._stop_compile.set()  # a build in progress ends with its child
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
    if spec.kind == "ngram":
        return Draft(None, spec)
    if spec.kind == "early-exit":
        view = early_exit_model(target.model, spec.layers)
        fast = None
        if target.fast is not None:
            from engine.models.fast import early_exit_decoder  # lazy: importing it loads numpy, torch

            fast = early_exit_decoder(target.fast, spec.layers)
        draft = Draft(view, spec, supports_logits_to_keep=target.supports_logits_to_keep, fast=fast)
        draft.compile_when_ready(target)
        return draft

    loaded = load_model(LoadRequest(spec.model, spec.precision, str(target.device)), progress=progress, cancel=cancel)
    if loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        name = loaded.info.name
        loaded.close()
        raise InvalidRequestError(f"The draft {name} has another tokenizer than {target.info.name}: a draft must "
                                  "share the target's vocabulary so its tokens mean the same.")
    draft = Draft(loaded.model, spec, loaded)
    draft.compile_when_ready(target)
    return draft


def stream_speculative(target: "LoadedModel", draft: Draft, request: GenerationRequest, draft_tokens: int,
                       cancel: CancelToken | None = None, service: "EngineService | None" = None,
                       ) -> Iterator[GenerationEvent]:
    """Like :func:`~engine.generation.generate.generate`, with :class:`DraftVerified` events between
    the tokens: the request alone in an engine service (``service``: the model's own, idle, lent
    for the run; ``None``: one of its own) whose proposer is the draft's (:meth:`Draft.proposer`)."""

    if target.model is None:
        raise EngineError("The model was unloaded: load it again.")
    proposer = draft.proposer(target, draft_tokens)
    request = request.validated()
    return stream(target, request, cancel or CancelToken(), proposer=proposer, service=service)


@dataclass
class _Sequence:
    """One request's speculation state."""

    length: int = 0
    """Tokens in the draft's cache."""
    drafted: int = 0
    accepted: int = 0
    step: int = 0


class Guesses(Proposer):
    """What the proposers that guess share: each request's counts, and the event that says how a
    step's guesses fared (engine/generation/proposer.py)."""

    def __init__(self, target: "LoadedModel", draft_tokens: int) -> None:
        if not isinstance(draft_tokens, int) or isinstance(draft_tokens, bool) \
                or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(
                f"Draft tokens per step must be from 1 to {MAX_DRAFT_TOKENS}, not {draft_tokens!r}.")
        self.target, self.draft_tokens = target, draft_tokens
        self.lookahead = draft_tokens
        self.sequences: dict[int, _Sequence] = {}
        head = target.model.get_output_embeddings()
        self.width = getattr(head, "out_features", None) or target.model.config.get_text_config().vocab_size
        """The target's scores' width (a draft's distributions are laid over it)."""

    def add(self, seq: int, request: GenerationRequest, tokens: int) -> None:
        self.sequences[seq] = _Sequence()

    def remove(self, seq: int) -> None:
        self.sequences.pop(seq, None)

    def counts(self, seq: int) -> dict:
        state = self.sequences.get(seq)
        return {"drafted_tokens": state.drafted if state else 0, "accepted_tokens": state.accepted if state else 0}

    def settle(self, seq: int, proposal: Proposal, accepted: int, committed: int, verify_s: float,
               ) -> DraftVerified | None:
        state = self.sequences[seq]
        n = len(proposal.tokens)
        if not n:
            return None
        state.drafted += n
        state.accepted += accepted
        event = DraftVerified(step=state.step, drafted_ids=proposal.tokens,
                              drafted_text=tuple(self.target.token_text(t) for t in proposal.tokens),
                              accepted=accepted, draft_s=proposal.draft_s, verify_s=verify_s, elapsed_s=0.0,
                              request_id=seq)
        state.step += 1
        return event


class PromptLookup(Guesses):
    """Prompt lookup: after each step, the last ``ngram`` tokens of the prompt and answer are
    looked up among the earlier ones; where they occurred before, the tokens that followed their
    latest occurrence are the guesses (up to ``draft_tokens``). Nothing is guessed where they
    never occurred: the step is a plain one. Each request keeps an index of its n-grams, grown by
    the tokens it commits (a step's lookup is one dictionary read).

    A sampled request's guess is a certainty for the acceptance rule (the draft's distribution
    all on it): the target keeps it with its own probability of it and otherwise draws from its
    distribution without it, which leaves the output the target's (engine/generation/sampling.py)."""

    def __init__(self, target: "LoadedModel", ngram: int, draft_tokens: int) -> None:
        super().__init__(target, draft_tokens)
        self.ngram = ngram
        self.ids: dict[int, list[int]] = {}
        self.seen: dict[int, dict[tuple[int, ...], int]] = {}
        """Per request: each n-gram → where the tokens after its latest occurrence begin."""

    def add(self, seq: int, request: GenerationRequest, tokens: int) -> None:
        super().add(seq, request, tokens)
        self.ids[seq], self.seen[seq] = [], {}

    def remove(self, seq: int) -> None:
        super().remove(seq)
        self.ids.pop(seq, None)
        self.seen.pop(seq, None)

    def propose(self, seq: int, sampler: "RequestSampler", committed: "torch.Tensor", room: int) -> Proposal:
        started = time.perf_counter()
        n = max(0, min(self.draft_tokens, room - 1))
        ids, seen, size = self.ids[seq], self.seen[seq], self.ngram
        for token in committed[len(ids):].tolist():  # index the n-grams that end before the newest token
            if len(ids) >= size:
                seen[tuple(ids[-size:])] = len(ids)
            ids.append(token)
        if not n or len(ids) <= size:
            return NOTHING
        after = seen.get(tuple(ids[-size:]))
        if after is None:
            return NOTHING
        guesses = tuple(ids[after:after + n])
        probs = () if sampler.params.greedy else tuple(self._certain(t, committed.device) for t in guesses)
        return Proposal(guesses, probs, time.perf_counter() - started)

    def _certain(self, token: int, device) -> "torch.Tensor":
        import torch

        q = torch.zeros(self.width, device=device)
        q[token] = 1.0
        return q


class Speculation(Guesses):
    """The engine core's speculative proposer (engine/generation/proposer.py): for each generating
    request the draft guesses up to ``draft_tokens`` tokens one at a time on its own runner; the
    core's decode pass checks them all (the target's scores after each), the sampler keeps the
    agreeing ones, and both caches roll back to what was kept. The draft reads every prompt with
    the target, so its share is part of the TTFT."""

    def __init__(self, target: "LoadedModel", draft: Draft, draft_tokens: int) -> None:
        super().__init__(target, draft_tokens)
        self.draft = draft
        self.runner = draft.runner()

    # -- the core's hooks --------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """The draft's KV bytes per token: its pool's on the fast path; else its own load's, or for
        an early-exit view of the target, the target's for the view's layers."""
        if getattr(self.runner, "paged", False):
            return self.runner.per_token_bytes
        if self.draft.loaded is not None:
            return self.draft.loaded.info.kv_bytes_per_token or 0
        whole, view = kv_layout(self.target.model.config), kv_layout(self.draft.model.config)
        per_token = self.target.info.kv_bytes_per_token
        if whole is None or view is None or not per_token:
            return 0
        return per_token * view.num_layers // whole.num_layers

    def limit_blocks(self, blocks: int | None, block_tokens: int) -> None:
        """The draft's pool (on the fast path) within its share of the budget, taken while it holds
        nothing. The reference runner's caches grow with the tokens they hold, which are the
        target's (rolled back with them after each step): within the share as the target's blocks
        are within theirs."""
        if getattr(self.runner, "paged", False) and not len(self.runner):
            self.runner.bind(KVCacheManager(self.runner.per_token_bytes, blocks, block_tokens=block_tokens,
                                            storage=self.runner))

    def add(self, seq: int, request: GenerationRequest, tokens: int) -> None:
        self.runner.add(seq, tokens)
        super().add(seq, request, tokens)

    def remove(self, seq: int) -> None:
        if seq in self.sequences:
            super().remove(seq)
            self.runner.remove(seq)

    def prefill(self, seq: int, ids: "torch.Tensor") -> None:
        self.runner.prefill(seq, ids)
        self.sequences[seq].length += ids.shape[1]

    def _feed(self, seq: int, ids: "torch.Tensor") -> "torch.Tensor":
        """The draft's scores after ``ids`` ([1, n]) go into its cache: a single token through its
        runner's decode step (the fast path's one-sequence step, compiled where it is ready), more
        through a prompt chunk's pass."""
        if ids.shape[1] == 1 and getattr(self.runner, "paged", False):
            return self.runner.decode([seq], [int(ids[0, 0])])[0]
        return self.runner.prefill(seq, ids)

    def propose(self, seq: int, sampler: "RequestSampler", committed: "torch.Tensor", room: int) -> Proposal:
        """The draft's guesses after ``committed``: each the token the request's own sampler
        would pick from the draft's scores (greedy), or a draw from the draft's distribution,
        which is kept for the acceptance rule."""
        import torch

        started = time.perf_counter()
        n = max(0, min(self.draft_tokens, room - 1))  # the target always adds one token of its own
        if not n:
            return NOTHING
        state = self.sequences[seq]
        device = self.target.device
        history = committed
        drafted: list[int] = []
        probs: list["torch.Tensor"] = []
        with torch.inference_mode():
            scores = self._feed(seq, committed[state.length:].unsqueeze(0))
            state.length = len(committed)
            for j in range(n):
                scores = self._fit(scores.float())
                seen = history if not drafted else torch.cat([history, history.new_tensor(drafted)])
                if sampler.params.greedy:
                    drafted.append(sampler(scores, seen))
                else:
                    q = sampler.distribution(scores, seen)
                    probs.append(q)
                    drafted.append(sampler.draw(q))
                if j < n - 1:
                    scores = self._feed(seq, torch.tensor([drafted[-1:]], dtype=torch.long, device=device))
                    state.length += 1
        return Proposal(tuple(drafted), tuple(probs), time.perf_counter() - started)

    def settle(self, seq: int, proposal: Proposal, accepted: int, committed: int, verify_s: float,
               ) -> DraftVerified | None:
        """The draft's cache rolls back to the accepted guesses (its last guess was never fed)."""
        state = self.sequences[seq]
        n = len(proposal.tokens)
        if n:
            state.length = min(state.length, committed + min(accepted, n - 1))
            self.runner.crop(seq, state.length)
        return super().settle(seq, proposal, accepted, committed, verify_s)

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
