"""Read an OpenAI-style stream chunk by chunk, as tokens.

A chunk (one server-sent event) may carry one token, several (vLLM's ``--stream-interval``,
llama.cpp under load, speculative decoding) or none (the role, the finish, the usage). How many
is read from what the server says, best first: its logprobs (one entry per token), its running
``usage`` (vLLM's ``continuous_usage_stats``), else the chunk is counted as one token and the
answer says so. The time between two chunks is shared evenly by the tokens of the later one, so
per-token latency is per token, not per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.base.errors import EndpointError
from engine.base.events import Alternative
from engine.base.units import format_rate, format_seconds

FINISH = {"stop": "eos", "length": "length", "abort": "cancelled", "content_filter": "eos",
          "tool_calls": "eos", "function_call": "eos", "error": "error"}
"""OpenAI's finish reasons as the engine's (a stop string is told apart by the caller)."""

COUNTED_BY = ("logprobs", "usage per chunk", "chunks")
"""How tokens were counted, best first (an answer says the weakest way any of its chunks needed)."""


@dataclass(frozen=True)
class Piece:
    """One token as a chunk told it."""

    text: str
    token_id: int
    """``-1`` when the server doesn't say (ids come from vLLM's ``return_tokens_as_token_ids``
    or llama.cpp's ``id``)."""
    logprob: float | None
    alternatives: tuple[Alternative, ...] = ()
    special: bool = False


def token_id(entry: dict) -> int:
    """A logprob entry's token id: ``"token_id:123"`` (vLLM's form) or an ``id`` field (llama.cpp)."""
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            return -1
    value = entry.get("id")
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _token_text(entry: dict) -> str:
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:") and entry.get("bytes") is not None:
        return bytes(entry["bytes"]).decode("utf-8", errors="replace")
    return token if isinstance(token, str) else ""


def _alternatives(entry: dict) -> tuple[Alternative, ...]:
    out = []
    for alt in entry.get("top_logprobs") or ():
        logprob = alt.get("logprob")
        if isinstance(logprob, (int, float)):
            out.append(Alternative(token_id(alt), _token_text(alt), float(logprob)))
    return tuple(out)


def _entries(logprobs) -> list[dict]:
    """Per-token entries of a chunk's logprobs, chat's shape or completions'."""
    if not isinstance(logprobs, dict):
        return []
    if isinstance(logprobs.get("content"), list):
        return [e for e in logprobs["content"] if isinstance(e, dict)]
    tokens = logprobs.get("tokens")
    if isinstance(tokens, list):
        scores = logprobs.get("token_logprobs") or [None] * len(tokens)
        tops = logprobs.get("top_logprobs") or [None] * len(tokens)
        return [{"token": t, "logprob": s,
                 "top_logprobs": [{"token": k, "logprob": v} for k, v in (top or {}).items()]}
                for t, s, top in zip(tokens, scores, tops)]
    return []


class StreamReader:
    """Turns the chunks of one answer into :class:`Piece` lists, and remembers what they said."""

    def __init__(self) -> None:
        self.usage_tokens_seen = 0
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.timings: dict | None = None
        self.counted: set[str] = set()
        self.running_usage = False
        """The server sends the tokens so far on every chunk (not only a total at the end)."""
        self._held = ""

    @property
    def counted_by(self) -> str:
        return max(self.counted, key=COUNTED_BY.index) if self.counted else "chunks"

    def read(self, chunk: dict) -> list[Piece]:
        if not isinstance(chunk, dict):
            raise EndpointError(f"The server sent a chunk that is not a JSON object: {str(chunk)[:120]}")
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise EndpointError(f"The server reported an error mid-answer: {message}")
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        text, entries = "", []
        for choice in choices:
            if "delta" in choice:
                text += (choice.get("delta") or {}).get("content") or ""
            else:
                text += choice.get("text") or ""
            entries += _entries(choice.get("logprobs"))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
        counted = None
        if isinstance(usage, dict):
            self.usage = usage
            if choices and not self.finish_reason:  # a total on the finishing chunk is no running count
                self.running_usage = True
            if self.running_usage and choices and isinstance(usage.get("completion_tokens"), int):
                counted = usage["completion_tokens"] - self.usage_tokens_seen
                self.usage_tokens_seen = usage["completion_tokens"]
        text, self._held = self._held + text, ""
        if entries:
            self.counted.add("logprobs")
            texts = [_token_text(e) for e in entries]
            specials = [False] * len(entries)
            if "".join(texts) != text:  # special tokens add no text; a trimmed stop string is cut
                texts = [text] + [""] * (len(entries) - 1)
                specials = [not text] + [False] * (len(entries) - 1)
            return [Piece(t, token_id(e), float(e["logprob"]) if isinstance(e.get("logprob"), (int, float)) else None,
                          _alternatives(e), special)
                    for t, e, special in zip(texts, entries, specials)]
        if counted is not None:
            if counted <= 0:
                self._held = text  # text without a token of its own (released stop-string text): the next token's
                return []
            self.counted.add("usage per chunk")
            return [Piece(text, -1, None)] + [Piece("", -1, None) for _ in range(counted - 1)]
        if text:
            self.counted.add("chunks")
            return [Piece(text, -1, None)]
        return []

    def rest(self) -> str:
        """Text that came without a token of its own, after the last token."""
        held, self._held = self._held, ""
        return held


def spread(pieces: int, gap_s: float, first: bool, ttft_s: float) -> list[float]:
    """Per-token latencies of a chunk of ``pieces`` tokens that arrived ``gap_s`` after the last
    one: the gap shared evenly, or, for the answer's first chunk, its TTFT for the first token and
    0 for those that came with it (as TPOT = (E2E − TTFT) / (n − 1) counts them)."""
    if first:
        return [ttft_s] + [0.0] * (pieces - 1)
    return [gap_s / pieces] * pieces


def served_line(answered: dict) -> str:
    """How a served answer was counted, and the server's own timings where it sent them (llama.cpp):
    the figures measured here can be checked against the server's."""
    times = list(answered.get("chunk_times_s") or ())
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    per_chunk = f" (p50 {format_seconds(gaps[len(gaps) // 2])} apart)" if gaps else ""
    counted = answered["counted_by"]
    if counted == "chunks" and answered["usage_completion_tokens"] is not None:
        counted = "usage (its chunks carry no per-token count)"  # the total is the server's
    line = (f"by {answered['server']} · {answered['chunks']} chunks{per_chunk} · tokens counted by {counted}"
            + (f" · usage {answered['usage_prompt_tokens']} prompt + {answered['usage_completion_tokens']} answer"
               if answered["usage_completion_tokens"] is not None else " · the server sent no usage"))
    timings = answered.get("timings") or {}
    own = [f"{name} {format_rate(timings.get(key))}" for name, key in (("prompt", "prompt_per_second"),
                                                                     ("decode", "predicted_per_second"))
           if isinstance(timings.get(key), (int, float))]
    return line + (f" · its own timings: {', '.join(own)}" if own else "")
