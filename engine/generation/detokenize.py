"""Incremental detokenization: a text piece per token whose concatenation is ``decode(ids)``.

Decoding one token alone goes wrong in three ways, each handled here:

- byte-level BPE splits a multi-byte character over several tokens; until its last byte
  arrives the text ends in U+FFFD, so that tail is held back;
- SentencePiece-style tokenizers drop a word's leading space when it starts the decoded
  text, so each step decodes a window that starts one step back and emits only what the
  new tokens added;
- byte-fallback tokens (``<0xE6>``) are decoded as a run, and a run that turns out invalid
  becomes U+FFFD as a whole, so text is held while the newest token is such a byte;
- tokenizers that "clean up tokenization spaces" delete a space before punctuation
  (``"one ."`` → ``"one."``) once the punctuation arrives, so for them a trailing space is
  held until the next token shows whether it stays.
"""

from __future__ import annotations

import re

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _plain_backend(tokenizer):
    """The Rust tokenizer that ``tokenizer.decode`` hands every call to unchanged (a fast tokenizer
    whose ``_decode`` is transformers' own and cleans up no spaces), or ``None``. Called directly,
    a decode skips transformers' wrapping (two decodes a token, for every sequence of a step)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: always through the tokenizer
        return None
    if getattr(type(tokenizer), "_decode", None) is not TokenizersBackend._decode:
        return None
    return getattr(tokenizer, "backend_tokenizer", None)


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # the window starts here: one step before the unread tokens
        self._read = 0  # tokens before this have all their text emitted
        self._partial = 0  # characters of the unread tokens' text emitted already
        self._hold_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._backend = _plain_backend(tokenizer) if not self._hold_spaces else None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._tokenizer.decode(ids)

    def _is_byte_token(self, token_id: int) -> bool:
        return bool(_BYTE_TOKEN.fullmatch(self._tokenizer.convert_ids_to_tokens(token_id) or ""))

    def add(self, token_id: int) -> str:
        """Append a token; return the new text it completes (maybe ``""``)."""
        self.ids.append(int(token_id))
        if self._is_byte_token(token_id):
            return ""
        window = self._decode(self.ids[self._prefix:])
        before = self._decode(self.ids[self._prefix:self._read])
        if window.startswith(before):
            new = window[len(before):]
        else:  # decoding the window changed earlier text: measure against the whole text
            new = self._decode(self.ids)[len(self.text) - self._partial:]
        stable = new.rstrip(_REPLACEMENT)
        if self._hold_spaces:
            stable = stable.rstrip(" ")
        piece = stable[self._partial:]
        if len(stable) == len(new):  # nothing incomplete left: move the window on
            self._prefix, self._read, self._partial = self._read, len(self.ids), 0
        else:
            self._partial = max(self._partial, len(stable))
        self.text += piece
        return piece

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD)."""
        full = self._decode(self.ids)
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += piece
        self._prefix = self._read = len(self.ids)
        self._partial = 0
        return piece

    @property
    def pending(self) -> bool:
        """Some tokens' text is still held back."""
        return self._read < len(self.ids)
