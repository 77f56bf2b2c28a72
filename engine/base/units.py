"""Sizes, times and rates for people: formatting them and parsing what someone typed (shared by the
command line and the window)."""

from __future__ import annotations

import re

from engine.base.errors import InvalidRequestError


def format_bytes(n: float | None) -> str:
    """Binary units: ``538.1 MiB``."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s < 1:
        return f"{s * 1000:.1f} ms"
    return f"{s:.2f} s"


def format_rate(r: float | None, unit: str = "tok/s") -> str:
    return "n/a" if r is None else f"{r:.1f} {unit}".rstrip()


def format_count(n: int | None) -> str:
    """``134.5 M``."""
    if n is None:
        return "n/a"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def binary_unit(largest: float) -> tuple[float, str]:
    """``(divisor, unit)`` to show values up to ``largest`` bytes in B/KiB/MiB/GiB/TiB."""
    divisor, unit = 1.0, "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if largest < divisor * 1024:
            break
        divisor *= 1024
        unit = next_unit
    return divisor, unit


def kv_dtype_label(torch_name: str) -> str:
    """A KV cache's dtype as a reader knows it: ``int8 (q8_0 blocks)``, ``float16``…"""
    return "int8 (q8_0 blocks: a scale per 32)" if torch_name == "int8" else torch_name


_SIZE = re.compile(r"^\s*([0-9.eE+]+)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")
_FACTORS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30,
            "ti": 2**40}


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1e9"`` → bytes."""
    match = _SIZE.match(text or "")
    if not match:
        raise InvalidRequestError(f"{text!r} is not a size: write e.g. 2GiB, 500MB or 1e9 (bytes).")
    unit = (match.group(2) or "").lower().rstrip("b")
    try:
        return int(float(match.group(1)) * _FACTORS[unit])
    except (KeyError, ValueError):
        raise InvalidRequestError(f"{text!r} is not a size: write e.g. 2GiB, 500MB or 1e9 (bytes).") from None


def parse_numbers(text: str, kind=float) -> list:
    """``"1,4,16"`` → numbers above 0 (a sweep's settings)."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidRequestError(f"{text!r} is not a comma-separated list of numbers.") from None
    if not values or any(v <= 0 for v in values):
        raise InvalidRequestError(f"{text!r}: give one or more numbers above 0.")
    return values
