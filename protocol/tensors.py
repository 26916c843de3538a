"""Tensor sets on the wire (work in progress: fingerprints first)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

__all__ = ["architecture_fingerprint"]


def architecture_fingerprint(shapes: Mapping[str, Sequence[int]]) -> str:
    """Stable fingerprint of a model architecture from its tensor names and shapes.

    The fingerprint is the first 16 hex digits of SHA-256 over the UTF-8 text made of
    one line ``name:d0xd1x...`` per tensor (``name:`` for a scalar), sorted by name,
    each line ending in ``\\n``. Insertion order does not matter; any change of a name
    or shape changes it. Devices announce it in their hello message.
    """
    lines = sorted(f"{name}:{'x'.join(str(int(d)) for d in shape)}\n" for name, shape in shapes.items())
    return hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()[:16]
