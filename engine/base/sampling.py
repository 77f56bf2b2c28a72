"""Sampling parameters: what a request asks of the sampler (engine/generation/sampling.py
applies them)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.base.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0 means greedy: always the most likely token."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to p."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p × the most likely one."""
    repetition_penalty: float = 1.0
    """>1 makes tokens already in the prompt or answer less likely."""
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validated(self) -> "SamplingParams":
        """These parameters as proper numbers, or :class:`InvalidRequestError`."""
        def number(name: str, kind: type, ok: Callable[[float], bool], rule: str):
            value = getattr(self, name)
            if isinstance(value, bool) or value is None and name != "seed":
                raise InvalidRequestError(f"{name} must be a number, not {value!r}.")
            try:
                converted = kind(value)
            except (TypeError, ValueError):
                raise InvalidRequestError(f"{name} must be a number, not {value!r}.") from None
            if kind is int and converted != float(value):
                raise InvalidRequestError(f"{name} must be a whole number, not {value!r}.")
            if isinstance(converted, float) and not math.isfinite(converted) or not ok(converted):
                raise InvalidRequestError(f"{name} must be {rule}, not {value!r}.")
            return converted

        return SamplingParams(
            # below 0.01 the scores overflow to inf; use 0 (greedy) for "always the most likely"
            temperature=number("temperature", float, lambda v: v == 0 or 0.01 <= v <= 100,
                               "0 (greedy) or between 0.01 and 100"),
            top_k=number("top_k", int, lambda v: v >= 0, ">= 0"),
            top_p=number("top_p", float, lambda v: 0 < v <= 1, "in (0, 1]"),
            min_p=number("min_p", float, lambda v: 0 <= v < 1, "in [0, 1)"),
            repetition_penalty=number("repetition_penalty", float, lambda v: v > 0, "> 0"),
            seed=None if self.seed is None else number("seed", int, lambda v: v >= 0, ">= 0"),
        )
