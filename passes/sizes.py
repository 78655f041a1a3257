"""sizes: byte sizes read from text ("24GiB", "512MB") and written for people ("1.50 MiB"), one
way everywhere."""

from __future__ import annotations

import math

UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30,
         "tb": 10**12, "tib": 2**40}
"""Size units, lower case: powers of 1000 (KB, MB, ...) and of 1024 (KiB, MiB, ...)."""
UNITS_SHOWN = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)"


def parse_size(text: str) -> int | None:
    """Bytes from a size like "2GiB", "512MB", "24 GiB" (GiB = 2**30, GB = 10**9); None when
    `text` is not a positive size with a unit."""
    text = text.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    try:
        value = float(number)
    except ValueError:
        return None
    return int(value * UNITS[unit]) if unit in UNITS and value > 0 else None


def format_size(nbytes: int, *, digits: int = 2) -> str:
    """A size as people read it, in the largest binary unit it reaches: "512 B", "1.50 MiB"."""
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes} B"


def size_literal(nbytes: int, *, up: bool = False) -> str:
    """`nbytes` written as parse_size reads it, to two decimals in the largest binary unit it
    reaches, e.g. '38.1MiB': rounded down (at least 1 byte), or with `up` rounded up (a size
    that is at least `nbytes`, for a limit it must fit)."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if nbytes >= scale:
            hundredths = math.ceil(nbytes / scale * 100) if up else int(nbytes / scale * 100)
            return f"{hundredths / 100:g}{unit}"
    return f"{max(nbytes, 1)}B"
