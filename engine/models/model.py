"""A loaded model: weights, tokenizer and the facts about them, as one value the rest of the
engine passes around (loading makes it; generation, batching and speculation read it). Plain
data: it runs nothing itself (engine/generation/generate.py's ``generate`` answers with it)."""

from __future__ import annotations


import inspect

from engine.base import heap
from engine.base.errors import InvalidRequestError, PromptTooLongError
from engine.base.events import Loaded
from engine.base.kv import KVLayout
from engine.models.precision import Precision, dtype_bytes
from engine.base.request import GenerationRequest, encode_prompt


class LoadedModel:
    """A model and tokenizer in memory, with the facts about them."""

    def __init__(self, model, tokenizer, info: Loaded, device, precision: Precision,
                 layout: KVLayout | None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.device = device
        self.precision = precision
        self.kv_layout = layout
        self.kv_element_bytes = dtype_bytes(info.kv_dtype)
        self.supports_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.eos_ids = _eos_ids(model, tokenizer)
        self._token_texts: dict[int, str] = {}
        self.fast = None
        """The fast path's decoder (engine/models/fast.py) when the precision asked for it."""
        self.batch_invariant = False
        """Compute every request's answer the same alone and in any batch, at a price
        (engine/generation/invariant.py); every engine core on this model reads it at each step."""
        self.decode_activations: int | None = None
        """A decode step's activations at one sequence, once read (engine/generation/generate.py)."""
        self.decode_activations_read = False
        """Whether they were (``decode_activations`` may stay ``None``: a device with no count)."""

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (cached: alternatives repeat a lot)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def encode(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids; raises if the prompt is empty or longer than the context."""
        request = request.validated()
        ids = encode_prompt(self.tokenizer, request)
        self.check_prompt(ids)
        return ids

    @property
    def vocab_size(self) -> int | None:
        """Rows of the input embedding: the token ids the model can read (0 to this, less one)."""
        try:
            rows = getattr(self.model.get_input_embeddings(), "num_embeddings", None)
        except (AttributeError, NotImplementedError):  # a model transformers can't ask (custom code)
            rows = None
        return int(rows) if rows is not None else self.info.vocab_size

    def check_prompt(self, ids: list[int]) -> None:
        """Raise if ``ids`` are not token ids of this model, or leave no room to answer in the
        context window."""
        vocab = self.vocab_size
        if vocab is not None:
            bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"The prompt holds token id {bad!r}, which is not a token of {self.info.name}: its ids run "
                    f"from 0 to {vocab - 1}.")
        limit = self.info.context_length
        if limit is not None and len(ids) >= limit:
            raise PromptTooLongError(
                f"The prompt is {len(ids)} tokens but {self.info.name} reads at most {limit} "
                "(its context window), and needs room to answer: shorten it."
            )

    def predicted_kv_bytes(self, tokens: int, batch: int = 1) -> int | None:
        if self.kv_layout is None:
            return None
        return self.kv_layout.bytes_for(tokens, self.kv_element_bytes, batch)

    def close(self) -> None:
        """Drop the weights and give device memory back."""
        import torch

        self.model = None
        self.fast = None
        heap.release()  # its reference cycles may be frozen (engine/base/heap.py)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif self.device.type == "mps":
            torch.mps.empty_cache()
        release_free_memory()


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS. glibc keeps freed blocks of a dropped model in the
    process for reuse, so without this the process's RSS (what the memory plots show) stays
    as if the model were still loaded."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def _eos_ids(model, tokenizer) -> frozenset[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
