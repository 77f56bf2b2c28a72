"""The core's output stage: what a step's sampled tokens become for the request's client
(vLLM's ``OutputProcessor``).

Everything a client reads about its request is made here and nowhere else: the prompt's scores
(log-softmax, each token's rank and the likeliest alternatives) as a :class:`PromptScored`, the
:class:`Prefilled` before the first token, each token's :class:`TokenGenerated` (its text piece,
its log-probability and alternatives, its share of the step's time, the cache it left), and the
stop rules' verdict (engine/generation/output.py), which ends the request through the core.

Timing: a token's latency is the engine's own time. The first token's is the time since the
request arrived (queueing and prompt); a later token's is its share of the step that made it
(what the consumer does between steps is not the model's time); a request that stops part-way
through a step's tokens is charged the time of those it won't emit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from engine.base.errors import EngineError, non_finite_message
from engine.base.events import (Alternative, Finished, GenerationEvent, Prefilled, PromptScored,
                                PromptTokenScore, TokenGenerated)
from engine.generation.decoding import top_scores
from engine.generation.sampling import Choice


class StepOutputs:
    """Turns a loaded model's sampled tokens into its clients' events. ``finish(r, reason,
    stop_string=None, error=None)`` is the core's: it ends ``r`` and frees what it holds."""

    def __init__(self, loaded, runner, finish: Callable[..., Finished]) -> None:
        self.loaded, self.runner, self.finish = loaded, runner, finish
        self._special = frozenset(loaded.tokenizer.all_special_ids)

    # -- the prompt ---------------------------------------------------------------------
    def score_prompt(self, r, start: int, logits) -> None:
        """Keep the scores of the prompt tokens that ``logits`` (rows for positions ``start`` …)
        predict: each position's row scores the token after it."""
        import torch

        first = len(r.prompt_scores)  # positions before it were scored by an earlier chunk (or admission)
        end = min(start + logits.shape[0], len(r.prompt) - 1)
        if end <= first:
            return
        rows = logits[first - start:end - start].float()
        logprobs = torch.log_softmax(rows, dim=-1)
        if not torch.isfinite(logprobs).all():
            info = self.loaded.info
            raise EngineError(f"{info.name} in {info.precision} produced NaN/infinite scores in the prompt (tokens "
                              f"{first + 2}–{end + 1}): no prompt log-probabilities. Try fp32.")
        targets = torch.tensor(r.prompt[first + 1:end + 1], dtype=torch.long, device=logprobs.device)
        picked = logprobs.gather(-1, targets.unsqueeze(-1))
        ranks = (logprobs > picked).sum(-1) + 1
        k = r.request.prompt_logprobs
        top = logprobs.topk(k, dim=-1) if k else None
        picked, ranks = picked.squeeze(-1).tolist(), ranks.tolist()
        top_values, top_ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
        for i in range(end - first):
            r.prompt_scores.append((r.prompt[first + 1 + i], picked[i], ranks[i],
                                    tuple(zip(top_ids[i], top_values[i])) if top is not None else ()))

    def prompt_scored(self, r) -> PromptScored:
        """``r``'s prompt scores as the event its caller gets (the tokens' texts read now)."""
        text = self.loaded.token_text
        r.prompt_scored = True
        return PromptScored(tuple(
            PromptTokenScore(token, text(token), logprob, rank, tuple(Alternative(i, text(i), v) for i, v in top))
            for token, logprob, rank, top in r.prompt_scores), request_id=r.rid)

    # -- the tokens ----------------------------------------------------------------------
    def tokens(self, r, choice: Choice, began: float, now: float, memory, guessing: bool,
               still_running: Callable[[object], bool]) -> Iterator[GenerationEvent]:
        """``r``'s tokens from one step, one by one; they share the step's time. ``guessing``:
        a proposer guessed, so each token says whether a guess made it. Ends ``r`` where a stop
        rule fires, its cancel is pressed between two of them, or its scores weren't finite."""
        share = (now - began) / max(1, len(choice.tokens))
        for j, (token, scores, log_total, largest) in enumerate(choice.tokens):
            later = len(choice.tokens) - 1 - j
            yield from self._token(r, token, scores, log_total, now, memory, guessed=j < choice.accepted if guessing
                                   else None, latency=share, unused=share * later, ahead=later, largest=largest)
            if not still_running(r):  # it stopped at this token
                return
            if later and r.cancel.cancelled and not r.output.pending:
                yield self.finish(r, "cancelled")
                return
        if not choice.finite:
            info = self.loaded.info
            yield self.finish(r, "error", error=non_finite_message(info.precision, info.name, len(r.tokens)))

    def _token(self, r, token: int, scores, log_total: float, now: float, memory,
               guessed: bool | None = None, latency: float = 0.0, unused: float = 0.0,
               ahead: int = 0, largest=None) -> Iterator[GenerationEvent]:
        """``token``, chosen after ``scores`` (whose log-normaliser is ``log_total``), for ``r``:
        its events, and its end if it stops here. ``ahead``: tokens after this one that the step
        already put in the cache (accepted guesses); ``largest``: the scores' largest few (ids,
        scores), best first, where the sampler took them for the batch (else the alternatives
        are searched for here)."""
        loaded, request = self.loaded, r.request
        n_prompt = len(r.prompt)
        if not r.tokens:
            yield self._prefilled(r, now, memory)
        alternatives = self._alternatives(request.top_alternatives, scores, log_total, largest)
        if largest is not None and largest[0] and largest[0][0] == token:  # greedy's: the largest, read already
            chosen = largest[1][0] - log_total
        else:
            chosen = float(scores[token]) - log_total
        r.tokens.append(token)
        r.seen.append(token)
        piece, reason, stop_string = r.output.add(token, r.cancel)
        if len(r.tokens) == 1:
            latency = now - r.arrived
        if reason is not None:
            latency += unused
        r.latencies.append(latency)
        r.next_token = token
        in_cache = n_prompt + len(r.tokens) - 1 + ahead
        yield TokenGenerated(
            index=len(r.tokens) - 1, token_id=token, text=piece, logprob=chosen, top_alternatives=alternatives,
            latency_s=latency, elapsed_s=time.perf_counter() - r.arrived, kv_cache_bytes=self.runner.kv_bytes(r.rid),
            kv_cache_bytes_predicted=loaded.predicted_kv_bytes(in_cache), memory=memory,
            special=token in self._special, drafted=guessed, request_id=r.rid)
        if reason is not None:
            yield self.finish(r, reason, stop_string)

    def _prefilled(self, r, now: float, memory) -> Prefilled:
        """The prompt read, before ``r``'s first token: its time and rate (the tokens the prefix
        cache gave are not counted as computed), and the cache it holds."""
        n_prompt = len(r.prompt)
        prefill_s = now - (r.prefill_started or now)
        computed = n_prompt - r.cached_tokens
        return Prefilled(
            prompt_tokens=n_prompt, prefill_s=prefill_s,
            prefill_tokens_per_s=computed / prefill_s if prefill_s > 0 else 0.0,
            kv_cache_bytes=self.runner.kv_bytes(r.rid),
            kv_cache_bytes_predicted=self.loaded.predicted_kv_bytes(n_prompt),
            memory=memory, request_id=r.rid, cached_tokens=r.cached_tokens)

    def _alternatives(self, top_k: int, scores, log_total: float, largest) -> tuple[Alternative, ...]:
        """The ``top_k`` likeliest tokens with their log-probabilities (none when not asked)."""
        if not top_k:
            return ()
        if largest is not None and len(largest[0]) >= top_k:
            ids, values = largest[0][:top_k], largest[1][:top_k]
        else:
            ids, values = top_scores(scores, top_k)
        return tuple(Alternative(i, self.loaded.token_text(i), v - log_total) for i, v in zip(ids, values))
