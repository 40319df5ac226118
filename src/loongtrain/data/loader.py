"""Data sources addressed by a global sample index, and the stateful batch loader.

A step consumes the next ``global_batch`` sample indices; replica ``d`` takes its rows
of each microbatch, and every rank of a replica gets the same full sequences (it keeps
its own shard when the step shards them). Because samples are a function of the index
alone, the loader state is one integer, and a run resumed on another layout (other dp,
hp, cp or world size) sees exactly the samples it would have seen.

Packed sources (a sample is ``(tokens, labels, cu_seqlens)``) give microbatches of one
row: the microbatch's samples concatenated, with their document boundaries. The
boundaries are a function of the sample too, so they need no loader state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from loongtrain.data.batch import Microbatch, pack_rows
from loongtrain.data.identity import data_fingerprint
from loongtrain.data.recall import IGNORE_INDEX, RecallTask, sample_seed
from loongtrain.data.tokens import DOC_START, SCAN_CHUNK, TARGET, TokenFile, TokenFileError
from loongtrain.options import LONG_DOCUMENTS

Sample = tuple[torch.Tensor, ...]  # (tokens [S], labels [S]) or, packed, (tokens, labels, cu_seqlens)


class Source(Protocol):
    seq_len: int

    def sample(self, index: int, split: str = "train") -> Sample: ...


class TaggedSource(Source, Protocol):
    """A source whose samples come from named sources (a mixture): the loader fills
    ``Microbatch.sources`` with the id (an index into ``names``) of each sample's source."""

    names: tuple[str, ...]

    def tagged_sample(self, index: int, split: str = "train") -> tuple[int, Sample]: ...


def document_boundaries(inputs: torch.Tensor, labels: torch.Tensor, eos: int) -> torch.Tensor:
    """Boundaries of the documents in a slice of a token stream: a document ends after each
    ``eos`` input token. Sets the label that would predict across a boundary (the one at an
    ``eos`` input) to IGNORE_INDEX in place; returns ``cu_seqlens`` [D+1]."""
    ends = (inputs == eos).nonzero().flatten()
    labels[ends] = IGNORE_INDEX
    inner = (ends + 1)[ends + 1 < inputs.shape[0]]
    return torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.tensor([inputs.shape[0]])])


def flag_labels(flags: np.ndarray, labels: torch.Tensor, pack: bool) -> torch.Tensor | None:
    """For a sequence of ``S + 1`` token flags: sets to IGNORE_INDEX (in place) the labels
    [S] of tokens that are not targets and, when packing, the labels that would predict the
    first token of a document (across a boundary). Returns the sequence's ``cu_seqlens``
    [D+1] (documents start at flagged tokens) when packing, else None."""
    following = flags[1:]
    ignore = (following & TARGET) == 0
    if pack:
        ignore |= (following & DOC_START) != 0
    labels[torch.from_numpy(ignore)] = IGNORE_INDEX
    if not pack:
        return None
    inner = np.flatnonzero(flags[1:-1] & DOC_START) + 1
    seq = flags.shape[0] - 1
    return torch.from_numpy(np.concatenate([[0], inner, [seq]]).astype(np.int64))


class TokenFileSource:
    """Non-overlapping sequences (slices of the token stream) of ``seq_len + 1`` tokens
    (stride ``seq_len``), in a seeded order per epoch; the last ``eval_fraction`` of sequences
    is held out for evaluation.

    Files with per-token flags: labels of tokens that are not targets (a chat's prompts) are
    IGNORE_INDEX. With ``pack`` each sequence also yields its document boundaries (from the
    flags, else after each ``eos`` token; default: the file's): no target crosses a boundary,
    and the attention and RoPE positions of each document start afresh. A sequence's first
    document may be the tail of one that began in the previous sequence. ``pack`` defaults to
    ``eos is not None``.

    ``long_documents``: ``"split"`` cuts the sequences from the whole file (a document longer
    than ``seq_len`` continues in the next sequence); ``"drop"`` cuts them from the file without
    the documents longer than ``seq_len`` (an index of the kept ranges is built once;
    ``dropped_documents`` and ``dropped_tokens`` count what was left out).

    ``lengths = (lo, hi)``: the stream is made of the documents of at least ``lo`` and fewer
    than ``hi`` tokens only (``hi`` None: no upper bound), through the same kept-ranges index:
    how a mixture's source is split into its long documents and the rest
    (:mod:`loongtrain.data.mixture`). ``name``: a mixture source's name, which seeds its
    order of sequences (None: the order a single token file has always had). ``starts``: the
    file's document starts when the caller has them already (one scan of the file for two
    sub-streams).

    Files with flags: a sequence none of whose labels is a target (a chat prompt longer than
    ``seq_len``) is never drawn. The sequences with targets are indexed once (one pass over the
    flags), and sample indices address that index, so a sample is still a function of its
    index alone (resume and layouts agree) and no batch is ever without targets;
    ``untargeted_sequences`` counts the sequences left out, ``target_tokens`` the labels scored.
    A file with fewer than two sequences with targets is refused.
    """

    def __init__(
        self,
        file: TokenFile,
        seq_len: int,
        seed: int = 0,
        eval_fraction: float = 0.01,
        eos: int | None = None,
        pack: bool | None = None,
        long_documents: str = "split",
        *,
        name: str | None = None,
        lengths: tuple[int, int | None] = (0, None),
        starts: np.ndarray | None = None,
    ) -> None:
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"long_documents={long_documents!r}: use one of {', '.join(LONG_DOCUMENTS)}")
        self.file, self.seq_len, self.seed, self.name = file, seq_len, seed, name
        self.lengths, self.eval_fraction = (int(lengths[0]), lengths[1]), eval_fraction
        self.pack = eos is not None if pack is None else pack
        self.eos = eos if eos is not None else file.eos
        if self.pack and file.flags is None and self.eos is None:
            raise TokenFileError(
                f"{file.path}: packing needs document boundaries, but the file has neither flags nor an "
                f"end-of-document token; set data.eos_id or re-create it with `loongtrain prepare`"
            )
        self.long_documents = long_documents
        self.dropped_documents = self.dropped_tokens = 0
        self._runs: tuple[np.ndarray, np.ndarray] | None = None  # (file start, virtual start) of kept ranges
        length = file.count
        if long_documents == "drop" or self.lengths != (0, None):
            length = self._keep_documents(starts)
        self.stream_tokens = length  # tokens the sequences are cut from
        sequences = max(0, (length - 1) // seq_len)
        dropped = (
            f" after dropping {self.dropped_documents} document(s) longer than {seq_len}"
            if self.dropped_documents
            else ""
        )
        if self.lengths != (0, None):
            dropped = f" in documents of {self.length_label()} tokens{dropped}"
        if sequences < 2:
            raise TokenFileError(
                f"{file.path}: {length} tokens{dropped} make {sequences} sequence(s) of {seq_len}+1 tokens; need at "
                f"least 2 (one to train, one to evaluate): use more text or a smaller data.seq_len"
            )
        self.sequences = sequences
        self.target_tokens: int | None = None  # labels scored over all sequences (known for files with flags)
        self._targeted: np.ndarray | None = self._index_targeted_sequences(sequences)  # None: every sequence
        usable = sequences if self._targeted is None else len(self._targeted)
        self.untargeted_sequences = sequences - usable
        if usable < 2:
            raise TokenFileError(
                f"{file.path}: {usable} of its {sequences} sequence(s) of {seq_len}+1 tokens{dropped} hold a loss "
                f"target (every label of the others is a prompt or crosses a document boundary); need at least 2 "
                f"(one to train, one to evaluate): use a longer data.seq_len, data.long_documents='drop', or records "
                f"whose prompts are shorter than data.seq_len"
            )
        self.eval_sequences = max(1, int(usable * eval_fraction))
        self.train_sequences = usable - self.eval_sequences
        self._perm: tuple[int, torch.Tensor] | None = None

    def _index_targeted_sequences(self, sequences: int) -> np.ndarray | None:
        """The sequences with at least one target label, in file order (one pass over the flags,
        in chunks); None for a file without flags (every sequence has targets). Sets ``target_tokens``."""
        if self.file.flags is None:
            return None
        seq = self.seq_len
        has_target = np.zeros(sequences, dtype=bool)
        per_chunk = max(1, SCAN_CHUNK // seq)
        self.target_tokens = 0
        for w0 in range(0, sequences, per_chunk):
            w1 = min(sequences, w0 + per_chunk)
            following = self._slice(w0 * seq + 1, w1 * seq + 1, tokens=False)[1]  # what the labels predict
            scored = (following & TARGET) != 0
            if self.pack:
                scored &= (following & DOC_START) == 0
            has_target[w0:w1] = scored.reshape(w1 - w0, seq).any(axis=1)
            self.target_tokens += int(scored.sum())
        return None if has_target.all() else np.flatnonzero(has_target)

    def describe(self) -> str:
        """One line for the trainer's start-up: the file, its targets and what was left out."""
        text = f"{self.file.path} ({self.file.count:,} tokens"
        if self.lengths != (0, None):
            text += f", its {self.stream_tokens:,} in documents of {self.length_label()} tokens"
        if self.target_tokens is not None:
            text += f", {self.target_tokens:,} loss targets"
        text += (
            f"; {self.train_sequences:,} train + {self.eval_sequences:,} held-out sequence(s) of {self.seq_len}"
            f"{', packed' if self.pack else ''})"
        )
        if self.untargeted_sequences:
            text += f"; {self.untargeted_sequences:,} sequence(s) without a target skipped"
        if self.long_documents == "drop":
            text += (
                f"; long_documents=drop left out {self.dropped_documents:,} document(s) "
                f"({self.dropped_tokens:,} tokens) longer than {self.seq_len}"
            )
        return text

    def length_label(self) -> str:
        """The documents this stream holds, in words (``"at least 4096"``, ``"fewer than 4096"``)."""
        lo, hi = self.lengths
        parts = ([f"at least {lo}"] if lo else []) + ([f"fewer than {hi}"] if hi is not None else [])
        return " and ".join(parts) or "any number of"

    def fingerprint(self) -> str:
        """A digest of what decides this source's samples: the file's identity (header and
        sampled content, not its path: a copied file matches), ``seq_len``, seed, name, packing,
        the end-of-document token, the long-document policy, the document lengths kept and
        the held-out fraction. Equal fingerprints give equal samples for every index."""
        return data_fingerprint(self.identity())

    def identity(self) -> dict:
        """What :meth:`fingerprint` digests, as a dict (a checkpoint records it)."""
        return {
            "kind": "tokens", "file": self.file.identity(), "seq_len": self.seq_len, "seed": self.seed,
            "name": self.name, "pack": self.pack, "eos": self.eos, "long_documents": self.long_documents,
            "lengths": list(self.lengths), "eval_fraction": self.eval_fraction,
        }  # fmt: skip

    def document_mask(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the file's documents of ``lengths`` (in file order): which this stream holds,
        and which its range would hold but ``long_documents="drop"`` leaves out."""
        lo, hi = self.lengths
        chosen = (lengths >= lo) & (lengths < hi if hi is not None else True)
        keep = chosen & (lengths <= self.seq_len) if self.long_documents == "drop" else chosen
        return keep, chosen & ~keep

    def _keep_documents(self, starts: np.ndarray | None) -> int:
        """Index the maximal runs of consecutive documents this stream keeps (their length in
        ``lengths`` and, with ``long_documents="drop"``, at most ``seq_len``); returns their
        total length."""
        if starts is None:
            starts = self.file.document_starts(self.eos)
        lengths = np.diff(np.append(starts, self.file.count))
        keep, dropped = self.document_mask(lengths)
        self.dropped_documents = int(dropped.sum())
        self.dropped_tokens = int(lengths[dropped].sum())
        edges = np.flatnonzero(np.diff(np.concatenate([[0], keep.astype(np.int8), [0]])))
        first, last = edges[0::2], edges[1::2]  # kept runs: documents first[r] .. last[r] - 1
        run_start = starts[first]
        run_len = np.append(starts, self.file.count)[last] - run_start
        self._runs = (run_start, np.concatenate([[0], np.cumsum(run_len)]))
        return int(self._runs[1][-1])

    def _slice(self, start: int, stop: int, tokens: bool = True) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Tokens [start, stop) of the stream (and their flags): memory-mapped slices of the
        file, gathered from the kept ranges when documents were dropped (``tokens=False``:
        the flags only)."""
        flags = self.file.flags
        if self._runs is None:
            ids = self.file.tokens[start:stop] if tokens else None
            return ids, None if flags is None else flags[start:stop]
        run_start, cum = self._runs
        first = int(np.searchsorted(cum, start, side="right")) - 1
        last = int(np.searchsorted(cum, stop, side="left"))
        spans = []
        for r in range(first, last):
            lo = run_start[r] + max(start, cum[r]) - cum[r]
            spans.append((lo, run_start[r] + min(stop, cum[r + 1]) - cum[r]))
        ids = np.concatenate([self.file.tokens[a:b] for a, b in spans]) if tokens else None
        return ids, None if flags is None else np.concatenate([flags[a:b] for a, b in spans])

    def _sequence(self, w: int) -> Sample:
        start = w * self.seq_len
        tokens, flags = self._slice(start, start + self.seq_len + 1)
        chunk = torch.from_numpy(tokens.astype("int64"))
        inputs, labels = chunk[:-1].clone(), chunk[1:].clone()
        if flags is not None:
            cu = flag_labels(flags, labels, self.pack)
            return (inputs, labels) if cu is None else (inputs, labels, cu)
        if not self.pack:
            return inputs, labels
        return inputs, labels, document_boundaries(inputs, labels, self.eos)

    def _usable(self, i: int) -> Sample:
        """The ``i``-th sequence with targets (every sequence, for a file without flags)."""
        return self._sequence(i if self._targeted is None else int(self._targeted[i]))

    def sample(self, index: int, split: str = "train") -> Sample:
        if split == "eval":
            return self._usable(self.train_sequences + index % self.eval_sequences)
        epoch, pos = divmod(index, self.train_sequences)
        if self._perm is None or self._perm[0] != epoch:
            parts = ("tokens", self.seed, epoch) if self.name is None else ("tokens", self.seed, self.name, epoch)
            gen = torch.Generator().manual_seed(sample_seed(*parts))
            self._perm = (epoch, torch.randperm(self.train_sequences, generator=gen))
        return self._usable(int(self._perm[1][pos]))


class LengthGroupedSource:
    """A packed source whose training order groups sequences of alike documents: within each
    window of ``window_steps`` steps (``window_steps * global_batch`` consecutive indices of an
    epoch), the sequences are sorted by their longest document, cut into steps of
    ``global_batch``, and the steps put in a seeded order. A step's microbatches (and its
    replicas) then hold sequences of similar documents, so a layout per microbatch can run the
    short ones without the ring while the long ones share theirs.

    A sample is still a function of its index (the window's order is computed from the
    window alone), so resuming from the loader's one integer and changing layouts see the
    same order, and each epoch trains every sequence exactly once (windows stop at the
    epoch's end). Held-out samples are not reordered.
    """

    def __init__(self, source: TokenFileSource, window_steps: int, global_batch: int) -> None:
        if not isinstance(source, TokenFileSource):
            raise ValueError(
                f"data.group_by_length orders the sequences of one token file, not a {type(source).__name__}; "
                "set data.group_by_length=0"
            )
        if not source.pack:
            raise ValueError(
                "data.group_by_length groups sequences by their documents: it needs packed documents "
                "(data.pack=true with source=tokens)"
            )
        if window_steps < 1 or global_batch < 1:
            raise ValueError(f"window_steps={window_steps} and global_batch={global_batch} must be >= 1")
        self.source, self.window_steps, self.global_batch = source, window_steps, global_batch
        self.seq_len = source.seq_len
        self.train_sequences = source.train_sequences
        self._window: tuple[int, list[int]] | None = None  # (first index, the window's indices in order)

    def __getattr__(self, name: str):  # describe(), pack, counts: the wrapped source's
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)

    def describe(self) -> str:
        return f"{self.source.describe()}; steps grouped by longest document in windows of {self.window_steps} steps"

    def fingerprint(self) -> str:
        """The wrapped source's :meth:`TokenFileSource.fingerprint` with the grouping's windows."""
        return data_fingerprint({
            "kind": "group_by_length", "source": self.source.fingerprint(), "window_steps": self.window_steps,
            "global_batch": self.global_batch,
        })  # fmt: skip

    def identity(self) -> dict:
        return {"kind": "group_by_length", "source": self.source.identity(), "window_steps": self.window_steps,
                "global_batch": self.global_batch}  # fmt: skip

    def window_order(self, index: int) -> tuple[int, list[int]]:
        """The first index of ``index``'s window and the source indices its positions take."""
        epoch, pos = divmod(index, self.train_sequences)
        span, gb = self.window_steps * self.global_batch, self.global_batch
        lo = epoch * self.train_sequences + pos // span * span
        hi = epoch * self.train_sequences + min(self.train_sequences, (pos // span + 1) * span)
        if self._window is None or self._window[0] != lo:
            indices = list(range(lo, hi))
            longest = [int(self.source.sample(i)[2].diff().max()) for i in indices]
            ranked = [indices[j] for j in sorted(range(len(indices)), key=lambda j: longest[j])]
            # the loader's steps within the window (absolute multiples of global_batch; the
            # first and last may be partial): each takes the next run of alike sequences, in a
            # seeded order of steps
            edges = [lo, *range((lo // gb + 1) * gb, hi, gb), hi]
            steps = list(zip(edges[:-1], edges[1:]))
            gen = torch.Generator().manual_seed(sample_seed("group_by_length", self.source.seed, lo))
            order, taken = [0] * len(indices), 0
            for k in torch.randperm(len(steps), generator=gen).tolist():
                a, b = steps[k]
                order[a - lo : b - lo] = ranked[taken : taken + b - a]
                taken += b - a
            self._window = (lo, order)
        return self._window

    def sample(self, index: int, split: str = "train") -> Sample:
        if split == "eval":
            return self.source.sample(index, split)
        lo, order = self.window_order(index)
        return self.source.sample(order[index - lo])


def rows_per_microbatch(global_batch: int, dp: int, micro_batches: int) -> int:
    """Sequences per microbatch per replica; raises unless the batch splits evenly."""
    per_step = dp * micro_batches
    if global_batch % per_step != 0:
        raise ValueError(
            f"data.global_batch={global_batch} is not divisible by dp*micro_batches = "
            f"{dp}*{micro_batches} = {per_step}; every replica needs whole microbatches"
        )
    return global_batch // per_step


@dataclass
class BatchLoader:
    """Hands each replica its microbatches of full sequences; ``state_dict`` resumes it."""

    source: Source
    global_batch: int
    micro_batches: int
    dp: int
    dp_rank: int
    next_index: int = 0
    mask_documents: bool = True  # packed sources: mask attention at document boundaries (False: ablation)

    def __post_init__(self) -> None:
        self.rows = rows_per_microbatch(self.global_batch, self.dp, self.micro_batches)

    def _rows(self, base: int, split: str) -> list[Microbatch]:
        out = []
        tagged = getattr(self.source, "names", None) is not None
        for m in range(self.micro_batches):
            first = base + (m * self.dp + self.dp_rank) * self.rows
            if tagged:
                drawn = [self.source.tagged_sample(first + r, split) for r in range(self.rows)]
                ids, samples = [d for d, _ in drawn], [sample for _, sample in drawn]
            else:
                ids, samples = None, [self.source.sample(first + r, split) for r in range(self.rows)]
            if len(samples[0]) == 3:
                out.append(pack_rows(samples, self.mask_documents, ids))
                continue
            tokens, labels = torch.stack([t for t, _ in samples]), torch.stack([lab for _, lab in samples])
            tags = None if ids is None else torch.tensor(ids, dtype=torch.int64)[:, None].expand_as(labels).clone()
            out.append(Microbatch(tokens, labels, sources=tags))
        return out

    def next(self) -> list[Microbatch]:
        """This replica's microbatches of the next step (``[B, S]``, or one packed row ``[1, B*S]``)."""
        batch = self._rows(self.next_index, "train")
        self.next_index += self.global_batch
        return batch

    def step_batch(self, step: int) -> list[Microbatch]:
        """This replica's microbatches of training step ``step`` (0-based: global samples
        ``step * global_batch`` onwards), without moving the loader: what :meth:`next`
        returns at that step, on any layout and after any resume."""
        return self._rows(step * self.global_batch, "train")

    def eval_batch(self, i: int) -> list[Microbatch]:
        """Held-out global batch ``i`` (same split over replicas as training)."""
        return self._rows(i * self.global_batch, "eval")

    def state_dict(self) -> dict:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict) -> None:
        self.next_index = int(state["next_index"])


__all__ = ["IGNORE_INDEX", "BatchLoader", "LengthGroupedSource", "RecallTask", "TaggedSource", "TokenFileSource"]
