"""Human formatting of sizes, times and rates (shared by the CLI and the window)."""

from __future__ import annotations


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
