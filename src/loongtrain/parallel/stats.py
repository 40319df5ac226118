"""Counters of the distributed attention's work and ZeRO's collectives, kept on the ParallelState."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AttentionStats:
    """Transfers started and blocks computed, by kind, since the last ``reset()``.

    Kinds are ``<phase>.<what>``: phase ``fwd`` (the attention's forward, also when a
    checkpoint recomputes it) or ``bwd`` (its backward); what: ``all_to_all``,
    ``ring_kv``, ``ring_dkv`` (transfers sent, with ``bytes`` sent and ``received``) and
    ``block`` (block kernels run). A ring transfer that a rank only receives adds to
    ``received`` alone. ZeRO's collectives count under ``zero.all_gather``,
    ``zero.reduce_scatter`` and ``zero.all_reduce`` (:mod:`loongtrain.apply.zero_comm`).
    Counting is a dict update per event, cheap enough to stay on.
    """

    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int = 0) -> None:
        """One event of ``kind`` (a transfer sent: its ``nbytes``)."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def add_received(self, kind: str, nbytes: int) -> None:
        self.received[kind] = self.received.get(kind, 0) + nbytes

    def get(self, kind: str) -> int:
        return self.counts.get(kind, 0)

    def reset(self) -> None:
        self.counts.clear()
        self.bytes.clear()
        self.received.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
