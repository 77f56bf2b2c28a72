"""A served model's perplexity and its divergence from a reference here, measured from the
prompt log-probabilities the server returns (vLLM's ``prompt_logprobs``), with llama.cpp's
method (engine/measure/quality.py): the same text, tokenized here, cut into the same chunks,
each sent as token ids with ``max_tokens`` 1 and scored on its second half.

What a server returns per prompt token is the token's own log-probability and its rank, and its
top ``k`` tokens (vLLM allows 20 by default; so does this workbench's server):

- perplexity, Δp and the correlation of ln p are exact: they need only the text's own token;
- "same top" needs the server's likeliest token (of tied ones the lowest id, as greedy decoding
  picks): exact whenever ``k`` ≥ 1 (and fewer than ``k`` tokens tie at the top);
- the KL divergence needs the whole distribution, which the server does not send: it is summed
  over the tokens both the server's top ``k`` and the reference's kept top list hold, the rest of
  each distribution as one bucket. Grouping tokens can only lower a KL divergence (the log-sum
  inequality), so the figure is a lower bound, said as such in the report.

vLLM (``prompt_logprobs``) and this workbench's server return prompt log-probabilities; a
server that answers without them is refused with that said (servers that only echo the prompt
with OpenAI's older ``logprobs``, keyed by text rather than token id, are not read). The text
is tokenized with a model here, which must have the served model's tokenizer: the tokens' texts
the server sends back are checked against it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import replace

import numpy as np

from engine.base.cancel import CancelToken
from engine.base.errors import CancelledError, EndpointError, InvalidRequestError
from engine.base.request import MAX_LOGPROBS
from engine.endpoint.source import http_error, unreachable
from engine.measure.quality import (DEFAULT_CTX, QualityProgress, QualityReport, Reference, _divergence, _stderr,
                                    plan_chunks, tokens_sha)

SERVED_TOP_K = MAX_LOGPROBS
"""The likeliest tokens asked for per prompt token (vLLM's default ``--max-logprobs``)."""
CONCURRENCY = 4
"""Chunks in flight at once (a batching server reads them together)."""
AGREEMENT = 0.9
"""The share of tokens whose text the server must read as the tokenizer here does."""
WITHOUT = "vLLM and this workbench's server (inference-workbench serve) return them"


def _request(endpoint, ids: list[int], top_k: int) -> list:
    """The server's ``prompt_logprobs`` for one chunk of token ids."""
    import httpx

    body = {"model": endpoint.spec.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": False,
            "prompt_logprobs": top_k}
    where = f"{endpoint.spec.url}/completions"
    try:
        response = endpoint.client.post("/completions", json=body)
    except httpx.HTTPError as exc:
        raise unreachable(endpoint.spec.url, exc) from None
    if response.status_code != 200:
        error = http_error(where, response)
        if response.status_code in (400, 422) and "prompt_logprobs" in str(error):
            raise EndpointError(f"{error} This server does not take vLLM's prompt_logprobs, so its perplexity can't "
                                f"be measured ({WITHOUT}).") from None
        raise error
    try:
        scores = response.json()["choices"][0].get("prompt_logprobs")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise EndpointError(f"{where} did not answer a completion (is this an OpenAI-compatible API?).") from None
    if not scores:
        raise EndpointError(f"{endpoint.server} at {endpoint.spec.url} answered without prompt log-probabilities "
                            f"(vLLM's prompt_logprobs), so its perplexity can't be measured: {WITHOUT}.")
    if len(scores) != len(ids):
        raise EndpointError(f"{where} scored {len(scores)} prompt tokens of the {len(ids)} sent: it read the token "
                            "ids as something else.")
    return scores


def _parse(entry, target: int, position: int) -> tuple[np.ndarray, np.ndarray, float, str]:
    """One position's entry: (ids, logprobs) of what the server sent best first, the text's
    token's log-probability, and that token's text as the server reads it."""
    if not isinstance(entry, dict) or str(target) not in entry:
        raise EndpointError(f"The server's prompt_logprobs at token {position} don't hold the prompt's own token "
                            f"({target}), as vLLM's always do.")
    try:
        items = sorted(((int(k), float(v["logprob"]), int(v.get("rank") or 10**9)) for k, v in entry.items()),
                       key=lambda item: (item[2], -item[1]))
    except (TypeError, ValueError, KeyError, AttributeError):
        raise EndpointError(f"The server's prompt_logprobs at token {position} are not vLLM's shape "
                            "({token id: {logprob, rank, decoded_token}}).") from None
    ids = np.array([i for i, _, _ in items], dtype=np.int64)
    lps = np.array([lp for _, lp, _ in items], dtype=np.float64)
    if not np.isfinite(lps).all():
        raise EndpointError(f"The server's prompt_logprobs at token {position} are not finite numbers.")
    mine = entry[str(target)]
    return ids, lps, float(mine["logprob"]), str(mine.get("decoded_token") or "")


def measure_served(endpoint, tokens: Sequence[int], token_text: Callable[[int], str], bos: int | None,
                   text_name: str = "", ctx: int = DEFAULT_CTX, chunks: int | None = None,
                   reference: Reference | None = None, top_k: int = SERVED_TOP_K, concurrency: int = CONCURRENCY,
                   cancel: CancelToken | None = None,
                   on_progress: Callable[[QualityProgress], None] | None = None) -> QualityReport:
    """The served model's perplexity over ``tokens`` (tokenized here, ``bos`` as the chunks'
    first token where the tokenizer adds one) and, with ``reference`` (kept by a run here on
    the same tokens), its divergence from it; ``token_text`` reads a token as the tokenizer here
    does, to check that the server has the same tokenizer."""
    chunks = plan_chunks(len(tokens), ctx, chunks)
    if reference is not None and (reference.tokens_sha != tokens_sha(tokens, ctx, chunks) or reference.ctx != ctx):
        raise InvalidRequestError(f"The reference ({reference.model} {reference.precision}) scored other tokens "
                                  "(another text, model, --ctx or --chunks): make it again with these.")
    if not 1 <= top_k <= MAX_LOGPROBS:
        raise InvalidRequestError(f"The served top-k: from 1 to {MAX_LOGPROBS} (what servers allow).")
    first = ctx // 2
    scored = ctx - 1 - first
    data = [list(tokens[c * ctx:(c + 1) * ctx]) for c in range(chunks)]
    sent = [([bos] + chunk[1:]) if bos is not None else chunk for chunk in data]
    cancel = cancel or CancelToken()
    results: dict[int, list] = {}
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="served-quality") as pool:
        pending = {pool.submit(_request, endpoint, sent[0], top_k): 0}  # the first alone: a refusal says so once
        next_chunk = 1
        try:
            while pending:
                done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                if cancel.cancelled:
                    raise CancelledError("Perplexity stopped.")
                for future in done:
                    results[pending.pop(future)] = future.result()
                    if on_progress is not None:
                        on_progress(QualityProgress.since(started, len(results), chunks, ctx))
                while results and next_chunk < chunks and len(pending) < concurrency:
                    pending[pool.submit(_request, endpoint, sent[next_chunk], top_k)] = next_chunk
                    next_chunk += 1
        finally:
            for future in pending:
                future.cancel()
    seconds = time.perf_counter() - started
    n = chunks * scored
    token_lp = np.empty(n, dtype=np.float64)
    argmax = np.empty(n, dtype=np.int64)
    kld = np.empty(n, dtype=np.float64) if reference is not None else None
    agree = checked = 0
    for c in range(chunks):
        for i in range(scored):
            at = first + 1 + i
            g = c * scored + i
            target = data[c][at]
            ids, lps, token_lp[g], read_as = _parse(results[c][at], target, at + 1)
            argmax[g] = ids[lps == lps.max()].min()  # of tied tokens the lowest id, as greedy decoding picks
            if read_as:
                mine = token_text(target)
                if mine:
                    checked += 1
                    agree += read_as == mine
            if reference is not None:
                kld[g] = _bounded_kld(reference.top_ids[g], reference.top_logprobs[g], ids, lps)
    if checked and agree / checked < AGREEMENT:
        raise EndpointError(f"The served model reads these token ids as other text ({100 * agree / checked:.0f}% of "
                            "the tokens agree): it has another tokenizer than the model here, so the figures would "
                            "compare different things. Name the served model's own model with --local.")
    nll = -token_lp
    ppl = math.exp(float(nll.mean()))
    divergence = None
    if reference is not None:
        divergence = _divergence(reference.precision, reference.k, kld, token_lp.astype(np.float32),
                                 reference.token_logprobs, argmax, reference.top_ids[:, 0].astype(np.int64), nll)
        divergence = replace(divergence, served_top_k=top_k)
    info = endpoint.info
    return QualityReport(info.name, "served", info.device_name, text_name, ctx, chunks, n, ppl, ppl * _stderr(nll),
                         seconds, chunks * ctx / seconds if seconds > 0 else 0.0, info.weights_bytes, divergence,
                         tuple(kld.tolist()) if kld is not None else (),
                         tuple(int(t) for chunk in data for t in chunk[first + 1:]))


def _bounded_kld(ref_ids: np.ndarray, ref_lps: np.ndarray, ids: np.ndarray, lps: np.ndarray) -> float:
    """KL(reference ‖ served) over the tokens both lists hold, the rest of each as one bucket: a
    lower bound of the whole sum."""
    match = ref_ids[None, :] == ids[:, None]  # [served, reference]
    both = match.any(1)
    p_lp = ref_lps[match.argmax(1)[both]].astype(np.float64)
    q_lp = lps[both]
    p = np.exp(p_lp)
    p_rest = max(0.0, 1.0 - float(p.sum()))
    q_rest = max(1e-30, 1.0 - float(np.exp(q_lp).sum()))
    rest = p_rest * (math.log(p_rest) - math.log(q_rest)) if p_rest > 0 else 0.0
    return float((p * (p_lp - q_lp)).sum()) + rest
