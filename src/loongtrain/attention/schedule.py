"""The Double-Ring-Attention schedule and its causal block rule. Pure, no process group.

A context rank ``c = o * ring_window + i`` holds the two zigzag chunks ``c`` and
``2*cp - 1 - c`` of the sequence. At outer step ``j`` and inner step ``s`` it holds the
key/value block of context rank ``src = ((o - j) mod n) * ring_window + ((i - s) mod ring_window)``
(``n = cp // ring_window``, :attr:`ParallelConfig.n_ring_windows`) and computes one of the block kinds below.
"""

from __future__ import annotations

import enum

from loongtrain.parallel.config import ParallelConfig


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


def ring_source(c: int, config: ParallelConfig, outer_step: int, inner_step: int) -> int:
    """Context index whose key/value block rank ``c`` holds at step ``(j, s)`` of ``config``'s double ring."""
    w = config.ring_window
    o, i = divmod(c, w)
    return ((o - outer_step) % config.n_ring_windows) * w + (i - inner_step) % w


def zigzag_chunks(c: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2*cp``) owned by context index ``c``."""
    return c, 2 * cp - 1 - c
