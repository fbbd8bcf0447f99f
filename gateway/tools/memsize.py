"""Byte sizes as people write them: ``24GiB`` read in, ``1.50 GiB`` written out."""

from __future__ import annotations

from gateway.errors import InvalidRequest

KIB = 1024
MIB = 1024**2
GIB = 1024**3


def parse_memory(text: str) -> int:
    """``24GiB``, ``80GB``, ``81920MiB``, ``1.5T`` or plain bytes. GB and G read as GiB, as GPU
    vendors use them (an "80GB" H100 has 80 GiB)."""
    raw = text.strip().replace(" ", "")
    units = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
             "g": GIB, "gb": GIB, "gib": GIB, "t": GIB * 1024, "tb": GIB * 1024, "tib": GIB * 1024}
    number = raw.rstrip("bBiIkKmMgGtT")
    unit = raw[len(number):].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise InvalidRequest(
            f"GPU memory must look like 24GiB, 80GB or 81920MiB; got {text!r}", param="gpu_memory"
        )
    return int(value * units[unit])


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
