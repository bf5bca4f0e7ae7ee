"""How /kv_events snapshots carry block keys: JSON arrays, or packed.

A snapshot holds every block an engine caches: a million keys on an engine
with a large host tier.  As a JSON array of decimal integers that is ~21 MB,
and encoding or parsing it holds the event loop for hundreds of milliseconds
(json's C code never yields), stalling every stream on the engine and every
request on the gateway.  Packed, each tier's keys are the base64 of
little-endian unsigned 64-bit integers: ~11 MB, packed and unpacked at C speed
by ``array``.  A gateway asks for it (``/kv_events?keys=packed``); an engine
that does not know the query sends arrays, which gateways still read, so
either side may be upgraded first.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Sequence

PACKED_KEYS = "u64le-base64"  # the snapshot's "keys_format" when packed
PACKED_QUERY = {"keys": "packed"}


def pack_keys(keys: Sequence[int]) -> str:
    packed = array("Q", keys)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def unpack_keys(text: str) -> array:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 8:
        raise ValueError(f"packed keys of {len(raw)} bytes: not a whole number of 8-byte keys")
    keys = array("Q")
    keys.frombytes(raw)
    if sys.byteorder == "big":
        keys.byteswap()
    return keys


def held_from_snapshot(snapshot: dict) -> dict[str, Sequence[int]]:
    """The snapshot's keys by tier, whichever way they were sent."""
    held = snapshot["keys"]
    if snapshot.get("keys_format") == PACKED_KEYS:
        return {tier: unpack_keys(text) for tier, text in held.items()}
    return held
