"""Protobuf wire-format primitives for the places that frame messages by hand.

The queue concatenates stored rollout bytes into `GetBatchResponse` pieces and the weight
stream writes/reads `WeightChunk` frames around tensor memory; both would otherwise pay for
extra copies through protobuf messages. `tb_events.py` encodes TensorBoard events with them
(so that writing metrics needs no protobuf classes). Only what they need is here: varints, the tag of a
field, and a bounds-checked varint reader that raises `WireError` (never IndexError) on
truncated or overlong input.
"""
from __future__ import annotations

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5  # wire types used by our messages


class WireError(ValueError):
    """Bytes that are not valid protobuf wire format."""


def varint(n: int) -> bytes:
    """Base-128 varint of a non-negative int."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def len_field(field: int, length: int) -> bytes:
    """Tag + length prefix of a length-delimited field (wire type 2)."""
    return varint(field << 3 | LEN) + varint(length)


def read_varint(buf, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `buf[pos]`; WireError if it is cut off
    or longer than 10 bytes."""
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated or overlong varint")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return value, pos
        shift += 7
