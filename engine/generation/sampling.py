"""The sampler: a pure function of the logits, the tokens so far and a seeded generator.

Order as in transformers' logits processors: repetition penalty, temperature, top-k,
top-p, min-p; then argmax (greedy) or a draw. The engine core samples a step's whole batch
at once (:func:`sample_batch`), verifying a draft's guesses where a proposer made some
(:func:`choose`, speculative decoding's acceptance rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.base.sampling import SamplingParams  # re-exported: the sampler's parameters

if TYPE_CHECKING:
    import torch


Sampler = Callable[["torch.Tensor", "torch.Tensor"], int]  # noqa: F821


class RequestSampler:
    """One request's sampler: its parameters and its seeded generator (every draw of the
    request, a draft's guesses included, comes from it, so a seed repeats the whole answer).
    ``sampler(logits[vocab], seen_ids[n]) -> token id``."""

    def __init__(self, params: SamplingParams, device: "torch.device | str" = "cpu") -> None:  # noqa: F821
        import torch

        self.params = params = params.validated()
        self.plain_greedy = params.greedy and params.repetition_penalty == 1.0
        """Greedy without a penalty: the token is the argmax of the raw scores (taken for the
        whole batch at once: :func:`sample_batch`)."""
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: "torch.Tensor", seen: "torch.Tensor") -> int:  # noqa: F821
        params = self.params
        if not params.greedy:
            return self.draw(self.distribution(logits, seen))
        scores = logits.float()
        if params.repetition_penalty != 1.0 and seen.numel():
            scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
        return argmax(scores)

    def distribution(self, logits: "torch.Tensor", seen: "torch.Tensor") -> "torch.Tensor":  # noqa: F821
        return distribution(self.params, logits, seen)

    def draw(self, probs: "torch.Tensor") -> int:  # noqa: F821
        import torch

        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        import torch

        return float(torch.rand((), generator=self.generator, device=self.generator.device))


def make_sampler(params: SamplingParams, device: "torch.device | str" = "cpu") -> Sampler:  # noqa: F821
    """``sampler(logits[vocab], seen_ids[n]) -> token id`` (a :class:`RequestSampler`)."""
    return RequestSampler(params, device)


@dataclass(frozen=True)
class Choice:
    """What one decode step gives one request: the tokens to emit, each with the target's scores
    before it, their log-normaliser (logprobs) and their largest few where the sampler took them
    (``(ids, scores)``, best first, else ``None``: the token's alternatives, :func:`row_totals`),
    the number of the draft's guesses accepted (they come first), and ``finite``: false when the
    scores after the emitted tokens were NaN/inf (the request ends there with an error)."""

    tokens: list[tuple[int, "torch.Tensor", float, "object"]]  # noqa: F821
    accepted: int = 0
    finite: bool = True


def choose(sampler: RequestSampler, rows: "torch.Tensor", log_totals: list[float], seen: "torch.Tensor",  # noqa: F821
           drafted: tuple[int, ...] = (), draft_probs: tuple = (), picked: list[int] | None = None,
           largest: list | None = None) -> Choice:
    """The tokens a request gets from the target's scores ``rows`` ([1 + guesses, vocab], float):
    after its last token and after each of the draft's guesses ``drafted``. Without guesses, the
    next token; with them, speculative decoding's verification: greedy keeps the guesses the
    target would have picked itself, sampling accepts guess ``d`` with probability
    min(1, p(d)/q(d)) and draws a rejection's replacement from max(0, p − q) (Leviathan et al.,
    2023), so either way the answer is distributed as the target's own; then the target's own
    next token (a correction, or a bonus after all guesses). ``seen``: the request's ids so far
    (repetition penalty); ``picked``: the argmax of each row, where already taken for the batch;
    ``largest``: each row's largest few (:func:`row_totals`), passed on with its token."""
    import torch

    n = len(drafted)

    def history(j: int) -> "torch.Tensor":  # noqa: F821
        return seen if not j else torch.cat([seen, seen.new_tensor(drafted[:j])])

    def pick(j: int) -> int:
        if sampler.plain_greedy and picked is not None:
            return picked[j]
        return sampler(rows[j], history(j))

    accepted, own = 0, None
    for j in range(n):
        if not math.isfinite(log_totals[j]):
            break
        if sampler.params.greedy:
            choice = pick(j)
            if choice == drafted[j]:
                accepted += 1
                continue
            own = choice
            break
        p = sampler.distribution(rows[j], history(j))
        d = drafted[j]
        if sampler.uniform() < min(1.0, float(p[d]) / max(float(draft_probs[j][d]), 1e-30)):
            accepted += 1
            continue
        residual = (p - draft_probs[j]).clamp(min=0)
        residual = residual if float(residual.sum()) > 0 else p
        own = sampler.draw(residual / residual.sum())
        break
    finite = math.isfinite(log_totals[accepted])  # checked before sampling: a sampler given NaN fails without saying why
    if own is None and finite:
        own = pick(accepted)

    def most(j: int):
        return largest[j] if largest is not None else None

    tokens = [(token, rows[j], log_totals[j], most(j)) for j, token in enumerate(drafted[:accepted])]
    if finite:
        tokens.append((own, rows[accepted], log_totals[accepted], most(accepted)))
    return Choice(tokens, accepted, finite)


def sample_batch(samplers: list[RequestSampler], rows: "torch.Tensor", counts: list[int],  # noqa: F821
                 seen: list["torch.Tensor"], drafted: list[tuple[int, ...]],  # noqa: F821
                 draft_probs: list[tuple], top: int = 0) -> list["Choice | Exception"]:
    """The sampler over a step's batch: ``rows`` [Σ counts, vocab] are the target's scores, the
    next ``counts[i]`` of them request ``i``'s (1 + its guesses). The log-normalisers of every row,
    the argmax of every row that greedy requests need and, where the kernels take them, the ``top``
    largest scores of every row (the alternatives the tokens' events show) are taken for the whole
    batch (:func:`row_totals`); then each request's tokens (:func:`choose`). A request whose
    sampling raises gets its exception in its place: it ends alone."""
    scores = rows.float()
    argmaxes, log_totals, largest = row_totals(scores, picks=any(s.plain_greedy for s in samplers), top=top)
    out: list[Choice | Exception] = []
    start = 0
    for i, sampler in enumerate(samplers):
        end = start + counts[i]
        try:
            out.append(choose(sampler, scores[start:end], log_totals[start:end], seen[i], drafted[i], draft_probs[i],
                              argmaxes[start:end] if argmaxes is not None else None,
                              largest[start:end] if largest is not None else None))
        except Exception as exc:
            out.append(exc)
        start = end
    return out


def row_totals(scores: "torch.Tensor", picks: bool = True,  # noqa: F821
               top: int = 0) -> tuple[list[int] | None, list[float], list | None]:
    """Each row's argmax (the first largest score; without the kernels, ``None`` for several rows
    unless ``picks``), its log-normaliser (log Σ exp) and, where the kernels take them, its ``top``
    largest scores (``[(ids, scores)]`` per row, best first, the lower id first among equals;
    ``None`` where the kernels don't take them or ``top`` is 0), for scores [rows, vocab] (float32,
    on any device). A row with NaN or +inf among its scores, or nothing but −inf, gets a non-finite
    total (its request ends with an error); a −inf score is a token that can't come.

    Where the int8 kernels are loaded, their ``row_totals`` (kernels/scores.h): one parallel pass
    in which each thread reads the scores its own core's cache holds from the step, the same for
    a row alone or in a batch, bit for bit. Right after a decode step a 49,152-score row lies half
    in each core's cache, where one numpy pass over it is an order of magnitude slower than hot,
    and numpy took three passes (and the search of the token's five likeliest alternatives,
    decoding.top_scores, more): a visible share of a quantized token (benchmarks/batch_step.py).

    Elsewhere, one CPU row: the argmax first, then the row less its maximum, exponentiated and
    summed in numpy. Several rows, or a GPU's: torch.logsumexp, whose CPU threads take rows each."""
    import numpy as np
    import torch

    from engine.models import kernels  # lazy: the kernels' module, loaded by a fast precision or not at all

    cpu = scores.device.type == "cpu"
    if cpu and kernels.loaded() is not None and scores.is_contiguous() and scores.shape[-1] >= max(top, 1):
        totals, values, ids = torch.ops.workbench.row_totals(scores, max(top, 1))
        ids_list = ids.tolist()
        largest = [(i[:top], v[:top]) for i, v in zip(ids_list, values.tolist())] if top else None
        return [i[0] for i in ids_list], totals.tolist(), largest
    if len(scores) > 1 or not cpu:
        totals = torch.logsumexp(scores, dim=-1).tolist()
        if not picks:
            return None, totals, None
        return (scores.numpy().argmax(axis=1) if cpu else torch.argmax(scores, dim=-1)).tolist(), totals, None
    values = scores.numpy()
    picked = values.argmax(axis=1)
    best = values[np.arange(len(values)), picked]
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = values - best[:, None]
        np.exp(shifted, out=shifted)
        totals = np.log(shifted.sum(axis=1)) + best
    return picked.tolist(), totals.tolist(), None


def distribution(params: SamplingParams, logits: "torch.Tensor", seen: "torch.Tensor") -> "torch.Tensor":  # noqa: F821
    """The probabilities the sampler draws from (after penalty, temperature and filters), for
    speculative sampling, which needs them for target and draft alike. Greedy: one-hot."""
    import torch

    scores = logits.float()
    if params.repetition_penalty != 1.0 and seen.numel():
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    if params.greedy:
        probs = torch.zeros_like(scores)
        probs[argmax(scores)] = 1.0
        return probs
    scores = filter_scores(scores / params.temperature, params.top_k, params.top_p, params.min_p)
    return torch.softmax(scores, dim=-1)


def argmax(scores: "torch.Tensor") -> int:  # noqa: F821
    """Index of the first largest score. On the CPU numpy's argmax is much faster than torch's
    for one vocabulary-sized vector (no dispatch), with the same first-index tie rule."""
    import torch

    if scores.device.type == "cpu":
        return int(scores.numpy().argmax())
    return int(torch.argmax(scores))


def apply_repetition_penalty(scores: "torch.Tensor", seen: "torch.Tensor", penalty: float) -> "torch.Tensor":  # noqa: F821
    """Divide positive scores of seen tokens by ``penalty``, multiply negative ones (CTRL paper)."""
    import torch

    scores = scores.clone()
    picked = scores.gather(0, seen)
    scores.scatter_(0, seen, torch.where(picked < 0, picked * penalty, picked / penalty))
    return scores


def filter_scores(scores: "torch.Tensor", top_k: int, top_p: float, min_p: float) -> "torch.Tensor":  # noqa: F821
    """Set the scores of filtered-out tokens to -inf; always keeps the most likely token."""
    import torch

    neg_inf = torch.finfo(scores.dtype).min
    if top_k and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, neg_inf)
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, neg_inf)
    if min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < min_p * probs.max(), neg_inf)
    return scores
