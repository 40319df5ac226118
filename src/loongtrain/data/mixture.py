"""Several token files mixed by token share, and a source's long documents drawn more often.

A sample is one sequence of ``seq_len`` tokens of one source, so weights on samples are
weights on tokens. Which source global sample ``i`` comes from is a pure function of ``i``
(:class:`Interleaving`): source ``d``'s ``k``-th draw is due at ``(k + 1/2) / w_d`` (``w``
the normalised weights, exact: never rounded to integers) and the samples take the draws
in the order they fall due, so after ``n`` samples every source has had ``w_d * n`` draws
to within one (Webster's apportionment; Megatron's largest-deficit rule keeps the same
bound with a stored table). Position inside a source: its ``k``-th draw is in epoch
``k // size`` with a permutation per epoch seeded by the source's *name*
(:class:`~loongtrain.data.loader.TokenFileSource` with ``name``), so adding, removing or
reordering sources leaves every other source's order alone. The loader state stays one
integer and a run resumed on another layout sees the same samples.

Length upsampling (:class:`UpsampledSource`): a source's documents of at least
``upsample_length`` tokens form one stream and the rest another, each cut into sequences
as a single file is (packed, long documents split or dropped), and the source's draws go to
the two streams by the same interleaving at ``(share, 1 - share)``: its long documents
supply ``share`` of its tokens, and its share of the mix is unchanged.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loongtrain.data.loader import Sample, TokenFileSource, data_fingerprint
from loongtrain.data.tokens import TokenFile, TokenFileError

#: the interleaving's table is made a block of this many samples at a time (about 8 bytes each)
BLOCK = 4096
#: blocks kept per interleaving (consecutive indices hit the same block)
CACHED_BLOCKS = 4
#: more epochs than this over a run of a source's (or its long documents') tokens is warned about
REPEAT_WARNING = 4.0


class Interleaving:
    """Which part sample ``i`` is drawn from and which draw of that part it is, as a pure
    function of ``i``: part ``d``'s ``k``-th draw is due at ``(k + 1/2) / w_d`` and samples
    take the draws in the order they fall due (ties: the lower ``tie_order``). After any
    ``n`` samples part ``d`` has had ``w_d * n`` draws to within ``(parts + 1) / 2``, so over
    any window its share is the weight to within ``parts + 1`` samples.

    The order is made a block of :data:`BLOCK` time units (as many samples) at a time, from
    the closed-form count of draws due before the block; a lookup sorts one block at most.
    """

    def __init__(self, weights: Sequence[float], tie_order: Sequence[int] | None = None, block: int = BLOCK) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or not len(w) or not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"weights {list(weights)} must be positive finite numbers")
        self.weights = w / w.sum()
        self.tie_order = np.arange(len(w)) if tie_order is None else np.asarray(tie_order)
        self.block = block
        self._blocks: OrderedDict[int, tuple[int, np.ndarray, np.ndarray]] = OrderedDict()

    def _due_before(self, t: float) -> np.ndarray:
        """Draws of each part due strictly before time ``t`` (computed as the keys are, so that
        a block and the counts before it always agree)."""
        w = self.weights
        k = np.maximum(0, np.ceil(t * w - 0.5)).astype(np.int64)
        for _ in range(2):  # the float estimate is off by at most one
            k = np.where((k > 0) & ((k - 1 + 0.5) / w >= t), k - 1, k)
            k = np.where((k + 0.5) / w < t, k + 1, k)
        return k

    def _start(self, c: int) -> int:
        return int(self._due_before(float(c * self.block)).sum())

    def _block(self, c: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Block ``c``: its first sample index, and each of its samples' part and draw number."""
        found = self._blocks.get(c)
        if found is not None:
            self._blocks.move_to_end(c)
            return found
        lo, hi = self._due_before(float(c * self.block)), self._due_before(float((c + 1) * self.block))
        parts = np.repeat(np.arange(len(lo)), hi - lo)
        draws = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
        order = np.lexsort((self.tie_order[parts], (draws + 0.5) / self.weights[parts]))
        found = (int(lo.sum()), parts[order], draws[order])
        self._blocks[c] = found
        if len(self._blocks) > CACHED_BLOCKS:
            self._blocks.popitem(last=False)
        return found

    def _block_of(self, i: int) -> int:
        for c, (start, parts, _) in reversed(self._blocks.items()):  # the cached blocks first
            if start <= i < start + len(parts):
                return c
        c = i // self.block
        while c > 0 and self._start(c) > i:
            c -= 1
        while self._start(c + 1) <= i:
            c += 1
        return c

    def locate(self, i: int) -> tuple[int, int]:
        """``(part, k)``: sample ``i`` is part ``part``'s ``k``-th draw (both from 0)."""
        if i < 0:
            raise IndexError(f"sample index {i} is negative")
        start, parts, draws = self._block(self._block_of(i))
        return int(parts[i - start]), int(draws[i - start])

    def parts(self, start: int, stop: int) -> np.ndarray:
        """The part of each sample ``start .. stop - 1`` (int64)."""
        out, i = [], start
        while i < stop:
            first, parts, _ = self._block(self._block_of(i))
            take = parts[i - first : stop - first]
            out.append(take)
            i += len(take)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def counts(self, n: int) -> np.ndarray:
        """Draws of each part among samples ``0 .. n - 1`` (int64 [parts])."""
        if n <= 0:
            return np.zeros(len(self.weights), dtype=np.int64)
        c = self._block_of(n - 1)
        start, parts, _ = self._block(c)
        before = self._due_before(float(c * self.block))
        return before + np.bincount(parts[: n - start], minlength=len(before))


class UpsampledSource:
    """One source whose documents of at least ``threshold`` tokens supply ``share`` of its
    drawn tokens: ``long`` (those documents) and ``rest`` (the others) are each cut into
    sequences like a single token file, and the source's ``k``-th draw goes to one of them by
    an :class:`Interleaving` at ``(share, 1 - share)``. Held-out samples the same way, from
    each stream's held-out tail."""

    def __init__(self, long: TokenFileSource, rest: TokenFileSource, share: float, threshold: int) -> None:
        if not 0.0 < share < 1.0:
            raise ValueError(f"upsample_share={share} must be in (0, 1)")
        if (long.seq_len, long.pack) != (rest.seq_len, rest.pack):
            raise ValueError("the long-document and other streams of a source must have one seq_len and packing")
        self.long, self.rest, self.share, self.threshold = long, rest, share, threshold
        self.streams = (long, rest)
        self.seq_len, self.pack, self.file = long.seq_len, long.pack, long.file
        self.interleaving = Interleaving([share, 1.0 - share])

    @property
    def train_sequences(self) -> int:
        return self.long.train_sequences + self.rest.train_sequences

    @property
    def eval_sequences(self) -> int:
        return self.long.eval_sequences + self.rest.eval_sequences

    def sample(self, index: int, split: str = "train") -> Sample:
        part, k = self.interleaving.locate(index)
        return self.streams[part].sample(k, split)

    def stream_draws(self, draws: int) -> list[tuple[TokenFileSource, int]]:
        """Each stream and how many of the source's first ``draws`` draws it gives."""
        return list(zip(self.streams, self.interleaving.counts(draws).tolist()))

    def describe(self) -> str:
        return f"{self.long.describe()}, drawn for {self.share:.0%} of its tokens; the rest: {self.rest.describe()}"

    def fingerprint(self) -> str:
        """Both streams' fingerprints and the share."""
        return data_fingerprint({
            "kind": "upsampled", "long": self.long.fingerprint(), "rest": self.rest.fingerprint(),
            "share": repr(self.share),
        })  # fmt: skip

    def identity(self) -> dict:
        return {"kind": "upsampled", "long": self.long.identity(), "rest": self.rest.identity(),
                "share": repr(self.share)}  # fmt: skip


Part = TokenFileSource | UpsampledSource


class MixtureSource:
    """Sequences of several named sources, each ``weight / sum(weights)`` of the samples (so
    of the tokens): sample ``i`` is source ``d``'s ``k``-th draw, ``(d, k) =
    interleaving.locate(i)``, and each source gives its draws in its own seeded order. Held-out
    sample ``i`` is source ``d``'s held-out sample ``k`` (the held-out batches have the mix's
    shares). ``names``: the sources in config order; ``tagged_sample`` gives a sample with
    its source id (an index into ``names``), which the loader puts in ``Microbatch.sources``."""

    def __init__(self, parts: dict[str, Part], weights: dict[str, float]) -> None:
        if not parts:
            raise ValueError("a mixture needs at least one source")
        if set(weights) != set(parts):
            raise ValueError(f"weights {sorted(weights)} must name the sources {sorted(parts)}")
        self.names: tuple[str, ...] = tuple(parts)
        self.parts: tuple[Part, ...] = tuple(parts.values())
        shapes = {(p.seq_len, p.pack) for p in self.parts}
        if len(shapes) != 1:
            raise ValueError(f"the sources of a mixture must share seq_len and packing, got {sorted(shapes)}")
        ((self.seq_len, self.pack),) = shapes
        for name in self.names:
            if not (math.isfinite(weights[name]) and weights[name] > 0):
                raise ValueError(f"data.sources.{name}.weight={weights[name]} must be a positive finite number")
        ranks = {name: r for r, name in enumerate(sorted(self.names))}  # ties by name, not by place
        self.interleaving = Interleaving([weights[n] for n in self.names], [ranks[n] for n in self.names])
        self.weights: dict[str, float] = dict(zip(self.names, self.interleaving.weights.tolist()))

    def locate(self, index: int) -> tuple[int, int]:
        """``(source id, k)``: sample ``index`` is that source's ``k``-th draw."""
        return self.interleaving.locate(index)

    def tagged_sample(self, index: int, split: str = "train") -> tuple[int, Sample]:
        """Sample ``index`` and the id of its source."""
        d, k = self.interleaving.locate(index)
        return d, self.parts[d].sample(k, split)

    def sample(self, index: int, split: str = "train") -> Sample:
        return self.tagged_sample(index, split)[1]

    def source(self, name: str) -> Part:
        """The source called ``name`` (its own draws: ``source(name).sample(k)``)."""
        return self.parts[self.names.index(name)]

    def files(self) -> dict[str, TokenFile]:
        """Each source's token file."""
        return {name: part.file for name, part in zip(self.names, self.parts)}

    def describe(self) -> str:
        """One line per source: its name, share of the tokens and what its file gives."""
        return "\n".join(
            f"{name} ({self.weights[name]:.1%} of the tokens): {part.describe()}"
            for name, part in zip(self.names, self.parts)
        )

    def fingerprint(self) -> str:
        """A digest of the mixture: each source's fingerprint (file identity, seq_len, seed,
        upsampling, ...) under its name, and the normalised weights. Equal fingerprints give
        equal samples for every index; the trainer refuses a resume whose fingerprint differs."""
        return data_fingerprint({
            "kind": "mixture",
            "sources": {name: part.fingerprint() for name, part in zip(self.names, self.parts)},
            "weights": {name: repr(w) for name, w in self.weights.items()},
        })  # fmt: skip

    def identity(self) -> dict:
        """Each source's identity under its name and the normalised weights (what changed, at a
        resume on other data)."""
        return {"kind": "mixture", "sources": {name: part.identity() for name, part in zip(self.names, self.parts)},
                "weights": {name: repr(w) for name, w in self.weights.items()}}  # fmt: skip


@dataclass(frozen=True)
class StreamDraws:
    """How often one stream of sequences (a source, or its long documents or the rest) is
    drawn over a run."""

    source: str  # the source's name ("" for a single token file)
    stream: TokenFileSource
    draws: int  # sequences drawn from it
    role: str = "all"  # "all", "long" (documents of at least the threshold) or "rest"

    @property
    def epochs(self) -> float:
        """Times its training sequences are gone through."""
        return self.draws / self.stream.train_sequences


def stream_draws(source, samples: int) -> list[StreamDraws]:
    """Every stream of ``source`` (a token file's, a mixture's or an upsampled source's) and
    how many of the first ``samples`` training samples it gives."""
    if isinstance(source, MixtureSource):
        named = list(zip(source.names, source.parts, source.interleaving.counts(samples).tolist()))
    else:
        named = [("", getattr(source, "source", source), samples)]  # a LengthGroupedSource: its file's
    out = []
    for name, part, draws in named:
        if isinstance(part, UpsampledSource):
            (long, n_long), (rest, n_rest) = part.stream_draws(draws)
            out += [StreamDraws(name, long, n_long, "long"), StreamDraws(name, rest, n_rest, "rest")]
        else:
            out.append(StreamDraws(name, part, draws))
    return out


def repeat_notices(source, samples: int, bound: float = REPEAT_WARNING) -> list[str]:
    """One line for each stream whose tokens repeat more than ``bound`` times over ``samples``
    training samples (``run.steps x data.global_batch``), naming the factor of data needed."""
    out = []
    for s in stream_draws(source, samples):
        if s.epochs <= bound:
            continue
        what = f"data.sources.{s.source}" if s.source else "data.path"
        if s.role != "all":
            what += f" ({'its documents of at least' if s.role == 'long' else 'its documents below'} "
            what += f"upsample_length={s.stream.lengths[0] or s.stream.lengths[1]} tokens)"
        out.append(
            f"{what}: its {s.stream.train_sequences:,} training sequences are drawn {s.epochs:.1f} times over the "
            f"run's {samples:,} sequences (more than {bound:g} epochs); add {s.epochs / bound:.1f}x the data, or "
            f"lower its weight{' or upsample_share' if s.role == 'long' else ''}"
        )
    return out


def check_same_tokenizers(files: dict[str, TokenFile]) -> None:
    """Raise TokenFileError (one line naming both sources) unless the sources' token files
    were made with one tokenizer: equal recorded fingerprints; files that record none (format
    version 1) are compared by vocabulary size and end-of-document token."""
    items = list(files.items())
    first, ref = items[0]
    for name, file in items[1:]:
        both = ref.tokenizer_fingerprint is not None and file.tokenizer_fingerprint is not None
        if both:
            differ = ref.tokenizer_fingerprint != file.tokenizer_fingerprint
        else:
            differ = (ref.vocab_size, ref.eos) != (file.vocab_size, file.eos)
        if differ:
            raise TokenFileError(
                f"data.sources.{name} ({file.path}) was tokenized with another tokenizer than data.sources.{first} "
                f"({ref.path}): {_tokenizer_words(file)} vs {_tokenizer_words(ref)}; re-create one of them with "
                f"`loongtrain prepare --tokenizer` of the other's tokenizer"
            )


def _tokenizer_words(f: TokenFile) -> str:
    fp = "no fingerprint" if f.tokenizer_fingerprint is None else f"fingerprint {f.tokenizer_fingerprint:016x}"
    return f"{fp}, vocabulary {f.vocab_size}, EOS {f.eos}"


def token_source(
    file: TokenFile,
    seq_len: int,
    *,
    name: str | None = None,
    seed: int = 0,
    eos: int | None = None,
    pack: bool | None = None,
    long_documents: str = "split",
    upsample_length: int = 0,
    upsample_share: float = 0.0,
    eval_fraction: float = 0.01,
) -> Part:
    """One source's sequences: a :class:`TokenFileSource`, or with ``upsample_share`` > 0 an
    :class:`UpsampledSource` whose documents of at least ``upsample_length`` tokens supply
    that share of its tokens. Raises TokenFileError (one line naming ``data.sources.<name>``
    and the fix) for a target the file cannot give: no document that long, or too few
    sequences in either stream."""
    where = f"data.sources.{name}" if name else "data"
    common = dict(seed=seed, eval_fraction=eval_fraction, eos=eos, pack=pack, long_documents=long_documents)
    if not upsample_share:
        return TokenFileSource(file, seq_len, name=name, **common)
    if not 0.0 < upsample_share < 1.0:
        raise TokenFileError(f"{where}.upsample_share={upsample_share} must be in (0, 1) (0: documents as they come)")
    if upsample_length < 1:
        raise TokenFileError(f"{where}.upsample_share={upsample_share} needs {where}.upsample_length >= 1")
    boundaries = eos if eos is not None else file.eos
    if file.flags is None and boundaries is None:
        raise TokenFileError(
            f"{where}: upsampling long documents needs document boundaries, but {file.path} has no per-token flags "
            f"and records no end-of-document token; set data.eos_id or re-create it with `loongtrain prepare`"
        )
    starts = file.document_starts(boundaries)
    lengths = np.diff(np.append(starts, file.count))
    usable = lengths[lengths <= seq_len] if long_documents == "drop" else lengths
    longest = int(usable.max()) if len(usable) else 0
    if longest < upsample_length:
        kept = f" of at most data.seq_len={seq_len} (long_documents=drop)" if long_documents == "drop" else ""
        raise TokenFileError(
            f"{where}: no document{kept} has upsample_length={upsample_length} tokens or more (the longest has "
            f"{longest}) in {file.path}; lower {where}.upsample_length to at most {longest} or set upsample_share=0"
        )
    streams = []
    for role, lengths_kept, fix in (
        ("long", (upsample_length, None), f"lower {where}.upsample_length or add longer documents"),
        ("rest", (0, upsample_length), f"raise {where}.upsample_length or set {where}.upsample_share=0"),
    ):
        stream_name = f"{name or ''}:{role}"
        try:
            streams.append(TokenFileSource(file, seq_len, name=stream_name, lengths=lengths_kept, starts=starts,
                                           **common))  # fmt: skip
        except TokenFileError as e:
            raise TokenFileError(f"{where} (upsampling): {e}; or {fix}") from None
    return UpsampledSource(streams[0], streams[1], upsample_share, upsample_length)


__all__ = [
    "Interleaving",
    "MixtureSource",
    "StreamDraws",
    "UpsampledSource",
    "check_same_tokenizers",
    "repeat_notices",
    "stream_draws",
    "token_source",
]
