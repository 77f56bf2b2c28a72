"""The decode loop: prefill the prompt, then one forward pass per token over a KV cache.

Our own loop rather than ``model.generate()`` with a streamer, so every token comes with
what it cost (latency, KV bytes measured and predicted, memory) and a cancel flag is
checked between tokens. Greedy output equals ``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.cancel import CancelToken
from engine.detokenize import IncrementalDetokenizer
from engine.errors import OutOfMemoryError
from engine.events import Alternative, Finished, GenerationEvent, Prefilled, TokenGenerated
from engine.kv import cache_bytes
from engine.memory import MemoryProbe
from engine.request import GenerationRequest
from engine.sampling import make_sampler

if TYPE_CHECKING:
    from engine.loading import LoadedModel

PREFILL_CHUNK = 512
"""Long prompts go through in chunks of this many tokens, so cancel works during prefill."""


def top_scores(scores: "torch.Tensor", k: int) -> tuple[list[int], list[float]]:  # noqa: F821
    """The k largest scores, best first. numpy's argpartition on the CPU (about half of torch.topk's time)."""
    import numpy as np
    import torch

    if scores.device.type == "cpu":
        values = scores.numpy()
        ids = np.argpartition(values, -k)[-k:]
        ids = ids[np.argsort(-values[ids], kind="stable")]
        return ids.tolist(), values[ids].tolist()
    values, ids = torch.topk(scores, k)
    return ids.tolist(), values.tolist()


def stream(loaded: "LoadedModel", request: GenerationRequest, prompt_ids: list[int],
           cancel: CancelToken) -> Iterator[GenerationEvent]:
    import torch

    try:
        with torch.inference_mode():
            yield from _run(loaded, request, prompt_ids, cancel)
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise OutOfMemoryError(
            f"Out of memory on {loaded.device} while generating: shorten the prompt or answer, "
            "or pick a smaller precision."
        ) from exc


def _run(loaded: "LoadedModel", request: GenerationRequest, prompt_ids: list[int],
         cancel: CancelToken) -> Iterator[GenerationEvent]:
    import torch
    from transformers import DynamicCache

    model, tokenizer, device = loaded.model, loaded.tokenizer, loaded.device
    context = loaded.info.context_length
    eos = frozenset() if request.ignore_eos else loaded.eos_ids
    special = frozenset(tokenizer.all_special_ids)
    keep = {"logits_to_keep": 1} if loaded.supports_logits_to_keep else {}
    sampler = make_sampler(request.sampling, device)
    plain_greedy = request.sampling.greedy and request.sampling.repetition_penalty == 1.0
    detok = IncrementalDetokenizer(tokenizer)
    probe = MemoryProbe(device)
    n_prompt = len(prompt_ids)
    top_k = request.top_alternatives
    longest_stop = max((len(s) for s in request.stop), default=0)

    # Tokens seen so far (prompt + answer) for the repetition penalty, preallocated.
    seen = torch.empty(n_prompt + request.max_new_tokens, dtype=torch.long, device=device)
    seen[:n_prompt] = torch.tensor(prompt_ids, dtype=torch.long)
    n_seen = n_prompt

    def predicted(tokens_in_cache: int) -> int | None:
        return loaded.predicted_kv_bytes(tokens_in_cache)

    def finished(reason, tokens, ttft, t_first, t_last, kv, kv_pred, stop_string=None) -> Finished:
        decode_s = (t_last - t_first) if t_first is not None else 0.0
        n = len(tokens)
        peak_device = probe.peak_device()
        return Finished(
            reason=reason, tokens=n, prompt_tokens=n_prompt, ttft_s=ttft, decode_s=decode_s,
            decode_tokens_per_s=(n - 1) / decode_s if n >= 2 and decode_s > 0 else None,
            total_s=time.perf_counter() - start,
            peak_memory_bytes=peak_device if peak_device is not None else probe.peak_rss,
            peak_rss_bytes=probe.peak_rss, kv_cache_bytes=kv, kv_cache_bytes_predicted=kv_pred,
            token_ids=tuple(tokens), text=detok.text, stop_string=stop_string,
        )

    probe.reset_peak()
    probe.sample()
    start = time.perf_counter()
    cache = DynamicCache(config=model.config)
    input_ids = seen[:n_prompt].unsqueeze(0)
    out = None
    for chunk_start in range(0, n_prompt, PREFILL_CHUNK):
        if cancel.cancelled:
            yield finished("cancelled", [], None, None, None, cache_bytes(cache), predicted(chunk_start))
            return
        out = model(input_ids=input_ids[:, chunk_start:chunk_start + PREFILL_CHUNK], cache=cache,
                    use_cache=True, **keep)
    logits = out.logits[0, -1]
    prefill_s = time.perf_counter() - start
    kv = cache_bytes(cache)
    yield Prefilled(prompt_tokens=n_prompt, prefill_s=prefill_s,
                    prefill_tokens_per_s=n_prompt / prefill_s if prefill_s > 0 else 0.0,
                    kv_cache_bytes=kv, kv_cache_bytes_predicted=predicted(n_prompt), memory=probe.sample())

    tokens: list[int] = []
    t_prev = start
    t_first = ttft = None
    while True:
        scores = logits.float()
        alternatives: tuple[Alternative, ...] = ()
        if top_k:
            ids, values = top_scores(scores, top_k)
        if plain_greedy and top_k and (top_k == 1 or values[0] > values[1]):
            token = ids[0]  # the argmax, found by top_scores already (no tie to break)
        else:
            token = sampler(scores, seen[:n_seen])
        log_total = float(torch.logsumexp(scores, dim=-1))
        chosen = float(scores[token]) - log_total
        if top_k:
            alternatives = tuple(Alternative(i, loaded.token_text(i), v - log_total) for i, v in zip(ids, values))
        tokens.append(token)
        seen[n_seen] = token
        n_seen += 1
        piece = detok.add(token)

        reason, stop_string = None, None
        if token in eos:
            reason = "eos"
        elif longest_stop:
            tail = detok.text[-(longest_stop + len(piece)):]
            stop_string = next((s for s in request.stop if s in tail), None)
            reason = "stop_string" if stop_string else None
        if reason is None:
            if len(tokens) >= request.max_new_tokens:
                reason = "length"
            elif context is not None and n_prompt + len(tokens) >= context:
                reason = "context"
            elif cancel.cancelled:
                reason = "cancelled"
        if reason is not None:
            piece += detok.flush()

        now = time.perf_counter()
        if t_first is None:
            t_first, ttft = now, now - start
        in_cache = n_prompt + len(tokens) - 1  # the newest token is not in the cache yet
        kv = cache_bytes(cache)
        yield TokenGenerated(
            index=len(tokens) - 1, token_id=token, text=piece, logprob=chosen,
            top_alternatives=alternatives, latency_s=now - t_prev, elapsed_s=now - start,
            kv_cache_bytes=kv, kv_cache_bytes_predicted=predicted(in_cache), memory=probe.sample(),
            special=token in special,
        )
        t_prev = now
        if reason is None and cancel.cancelled and not detok.pending:
            reason = "cancelled"  # set while the consumer handled the token: stop before another step
        if reason is not None:
            yield finished(reason, tokens, ttft, t_first, now, kv, predicted(in_cache), stop_string)
            return
        out = model(input_ids=seen[n_seen - 1:n_seen].unsqueeze(0), cache=cache, use_cache=True, **keep)
        logits = out.logits[0, -1]
