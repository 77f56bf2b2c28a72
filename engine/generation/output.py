"""What a request's tokens become, in one place for every door (the window, the server, the CLI):
text pieces that concatenate to ``tokenizer.decode(ids)``, the stop rules (end of sequence, stop
strings, length, context, cancel) and, for a client that must not see a stop string (OpenAI
leaves it out of the answer), how much of the text can be shown yet.

The engine core (engine/generation/core.py) makes one :class:`OutputProcessor` per request; the
server's streams cut their text with a :class:`StopTrimmer`; both match stop strings with
:func:`find_stop`.
"""

from __future__ import annotations

from engine.base.cancel import CancelToken
from engine.base.request import GenerationRequest
from engine.generation.detokenize import IncrementalDetokenizer


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """Where the first stop string in ``text`` begins (at or after ``start``), and which one
    (at the same place, the one listed first); ``None`` if there is none."""
    found = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (found is None or at < found[0]):
            found = (at, stop)
    return found


def pending_stop(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` might be the start of a stop string (the
    next token decides): what a client that must not see a stop string waits for."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def stop_reason(token: int, piece: str, text: str, request: GenerationRequest, eos: frozenset[int],
                generated: int, length: int, context: int | None,
                cancel: CancelToken) -> tuple[str | None, str | None]:
    """Why generation ends after ``token`` (its ``piece`` ends ``text``), with the stop string
    that matched; ``(None, None)`` to go on. ``length``: prompt and answer tokens so far."""
    if token in eos:
        return "eos", None
    if request.stop:
        longest = max(len(s) for s in request.stop)
        found = find_stop(text, request.stop, max(0, len(text) - longest - len(piece)))
        if found is not None:
            return "stop_string", found[1]
    if generated >= request.max_new_tokens:
        return "length", None
    if context is not None and length >= context:
        return "context", None
    if cancel.cancelled:
        return "cancelled", None
    return None, None


class OutputProcessor:
    """One request's output: each token's text piece and whether the request stops there."""

    def __init__(self, tokenizer, request: GenerationRequest, eos: frozenset[int], context: int | None,
                 prompt_tokens: int) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.request, self.context, self.prompt_tokens = request, context, prompt_tokens
        self.eos = frozenset() if request.ignore_eos else eos
        self.tokens = 0

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def pending(self) -> bool:
        """The last token left half a character (one more completes it)."""
        return self.detok.pending

    def add(self, token: int, cancel: CancelToken) -> tuple[str, str | None, str | None]:
        """``token`` appended: (its text, why the request ends here or ``None``, the stop string
        that ended it). An ending token's text includes what the detokenizer still held."""
        piece = self.detok.add(token)
        self.tokens += 1
        reason, stop_string = stop_reason(token, piece, self.detok.text, self.request, self.eos, self.tokens,
                                          self.prompt_tokens + self.tokens, self.context, cancel)
        if reason is not None:
            piece += self.detok.flush()
        return piece, reason, stop_string


class StopTrimmer:
    """The answer as a client that must not see the stop string sees it (OpenAI's rule). While
    streaming, text that might be the start of a stop string is held back until the next token
    settles it."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.sent = 0

    def add(self, piece: str) -> str:
        """What can be sent after ``piece``: none of a stop string it completes, nor what might
        begin one."""
        self.text += piece
        longest = max((len(s) for s in self.stops), default=0)
        found = find_stop(self.text, self.stops, max(0, self.sent - longest))
        upto = found[0] if found is not None else len(self.text) - pending_stop(self.text, self.stops)
        upto = max(self.sent, upto)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def finish(self, reason: str, stop_string: str | None) -> str:
        """The rest, cut before the stop string if one ended the answer."""
        end = len(self.text)
        if reason == "stop_string" and stop_string:
            found = self.text.find(stop_string)
            if found >= 0:
                end = found
        out = self.text[self.sent:max(self.sent, end)]
        self.sent = max(self.sent, end)
        return out

    def final(self, reason: str, stop_string: str | None) -> str:
        self.finish(reason, stop_string)
        return self.text[:self.sent]
