"""One microbatch of full sequences, as the loader hands it to the training step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.attention.documents import range_work


@dataclass(frozen=True)
class Microbatch:
    """Full sequences of one data-parallel replica's microbatch (the same on every rank of
    its sp group; each rank keeps its own shard when the step shards them).

    ``cu_seqlens`` marks packed documents: the boundaries ``[0, ..., S]`` of the one packed
    row (``tokens`` is ``[1, S]``; the loader concatenates a microbatch's packed samples
    into one row), kept on the CPU so that planning the attention needs no device sync.
    RoPE positions restart at 0 in each document.

    ``sources``: for a mixture of sources (:class:`~loongtrain.data.mixture.MixtureSource`),
    the source id of every token (int64, shaped like ``labels``; an index into the source's
    ``names``), for losses per source; None for a single source.
    """

    tokens: torch.Tensor  # [B, S] token ids
    labels: torch.Tensor  # [B, S] next-token targets, IGNORE_INDEX where nothing is scored
    cu_seqlens: torch.Tensor | None = None  # int64 [D + 1] on the CPU, or None: one sequence per row
    mask_documents: bool = True  # False (an ablation): positions restart per document, attention is not masked
    sources: torch.Tensor | None = None  # int64 [B, S]: the source id of each token (mixtures), or None

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.shape != self.labels.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and labels {tuple(self.labels.shape)} must both be [B, S]"
            )
        if self.cu_seqlens is not None:
            if self.tokens.shape[0] != 1:
                raise ValueError(
                    f"a packed microbatch is one row [1, S] with document boundaries, got tokens "
                    f"{tuple(self.tokens.shape)}; concatenate the rows and their cu_seqlens"
                )
            # the boundaries themselves are validated once, where the step makes the batch's
            # SequenceLayout (loongtrain.attention.layout)
        if self.sources is not None and self.sources.shape != self.labels.shape:
            raise ValueError(
                f"sources {tuple(self.sources.shape)} must be shaped like the labels {tuple(self.labels.shape)}"
            )

    def to(self, device: torch.device) -> Microbatch:
        """Tokens, labels and source ids on ``device`` (the boundaries stay on the CPU)."""
        return Microbatch(
            self.tokens.to(device, non_blocking=True),
            self.labels.to(device, non_blocking=True),
            self.cu_seqlens,
            self.mask_documents,
            None if self.sources is None else self.sources.to(device, non_blocking=True),
        )

    @property
    def attention_documents(self) -> torch.Tensor | None:
        """The boundaries the attention masks with (None when not packed or not masked)."""
        return self.cu_seqlens if self.mask_documents else None

    def attention_keys(self, sliding_window: int = 0) -> int:
        """Keys seen by all its queries under the causal mask, its document masks (when
        masked) and a ``sliding_window`` (0: none): the attention work the kernels do."""
        rows, seq = self.tokens.shape
        documents = self.attention_documents
        boundaries = (0, seq) if documents is None else tuple(documents.tolist())
        return rows * range_work(boundaries, 0, seq, causal=True, sliding_window=sliding_window or None)

    def positions(self) -> torch.Tensor:
        """RoPE position ids [1, S]: ``arange(S)``, restarting at 0 in each document."""
        seq = self.tokens.shape[1]
        pos = torch.arange(seq)
        if self.cu_seqlens is not None:
            starts = self.cu_seqlens[:-1].repeat_interleave(self.cu_seqlens.diff())
            pos = pos - starts
        return pos.unsqueeze(0).to(self.tokens.device)


def pack_rows(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    mask_documents: bool = True,
    sources: list[int] | None = None,
) -> Microbatch:
    """One packed row from samples ``(tokens [S], labels [S], cu_seqlens [D+1])``;
    ``sources``: each sample's source id, repeated over its tokens into ``Microbatch.sources``."""
    offsets, cus = 0, [torch.zeros(1, dtype=torch.int64)]
    for tokens, _, cu in rows:
        cus.append(cu[1:].to(torch.int64) + offsets)
        offsets += tokens.shape[0]
    tags = None
    if sources is not None:  # (torch.repeat_interleave took 5 ms for four 8K rows here; this, 0.02)
        tags = torch.cat([torch.full((t.shape[0],), d, dtype=torch.int64) for (t, _, _), d in zip(rows, sources)])
        tags = tags.unsqueeze(0)
    return Microbatch(
        torch.cat([t for t, _, _ in rows]).unsqueeze(0),
        torch.cat([lab for _, lab, _ in rows]).unsqueeze(0),
        torch.cat(cus),
        mask_documents,
        tags,
    )
