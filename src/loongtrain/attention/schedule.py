"""The Double-Ring-Attention schedule and its causal block rule. Pure, no process group.

A context rank ``c = o * window + i`` holds the two zigzag chunks ``c`` and
``2*cp - 1 - c`` of the sequence. At outer step ``j`` and inner step ``s`` it holds the
key/value block of context rank ``src = ((o - j) mod n) * window + ((i - s) mod window)``
(``n = cp // window``) and computes one of the block kinds below.
"""

from __future__ import annotations

import enum


class BlockKind(enum.Enum):
    """Which part of (local q) x (visiting kv) a ring step computes."""

    #: own block, causal attention of [q0|q1] against [k0|k1] (top-left aligned mask)
    DIAGONAL = "diagonal"
    #: non-causal attention of all of q against all of the block
    FULL = "full"
    #: src < c (causal): all of q against the first kv chunk only, no mask
    KV_FIRST_HALF = "kv_first_half"
    #: src > c (causal): the second q chunk only against all of kv, no mask
    Q_SECOND_HALF = "q_second_half"


def block_kind(src: int, c: int, causal: bool) -> BlockKind:
    """Return the work of context rank ``c`` on the key/value block of rank ``src``."""
    if not causal:
        return BlockKind.FULL
    if src == c:
        return BlockKind.DIAGONAL
    return BlockKind.KV_FIRST_HALF if src < c else BlockKind.Q_SECOND_HALF


def ring_source(c: int, cp: int, window: int, outer_step: int, inner_step: int) -> int:
    """Context index whose key/value block rank ``c`` holds at step ``(j, s)``."""
    n = cp // window
    o, i = divmod(c, window)
    return ((o - outer_step) % n) * window + (i - inner_step) % window


def ring_sources(c: int, cp: int, window: int) -> list[int]:
    """Sources visited by rank ``c``, in schedule order (outer step major)."""
    n = cp // window
    return [ring_source(c, cp, window, j, s) for j in range(n) for s in range(window)]


def zigzag_chunks(c: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2*cp``) owned by context index ``c``."""
    return c, 2 * cp - 1 - c
