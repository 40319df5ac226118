"""``loongtrain data-inspect``: what a config's token files will feed, without a model or a GPU.

For each source (a mixture's ``[data.sources.NAME]``, or ``data.path``) over the run's
``run.steps x data.global_batch`` sequences (or ``--steps``): its target and drawn share of
the tokens, the share of its drawn tokens from long documents (at least its
``upsample_length``, or ``--long``, default ``data.seq_len``) against its upsampling target,
a histogram of document lengths (share of the source's drawn tokens in documents of each
length, log-spaced bins: a table and, with ``--out``, a PNG), the tokens that packing
splits (in a document continued from the previous sequence) or drops
(``long_documents = "drop"``), and how many times its sequences repeat over the run,
warned about past 4 epochs.

Draw counts are exact (the same :class:`~loongtrain.data.mixture.Interleaving` the loader
uses); what the drawn tokens hold is each stream's content (its sequences' documents) times
how often the stream is drawn: exact for whole epochs, the expectation for the part of an
epoch a run takes. The sequences themselves come from :func:`~loongtrain.train.spec.make_source`
and :class:`~loongtrain.data.loader.BatchLoader` (``step_batch``), as in training.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loongtrain.config import ConfigError, TrainConfig, load_config
from loongtrain.data import TokenFileError
from loongtrain.data.loader import LengthGroupedSource, TokenFileSource
from loongtrain.data.mixture import REPEAT_WARNING, MixtureSource, StreamDraws, UpsampledSource, stream_draws
from loongtrain.train.spec import make_source

TABLE_FILE, PLOT_FILE = "data_inspect.txt", "document_lengths.png"


@dataclass(frozen=True)
class StreamContent:
    """What one stream's sequences hold, in tokens of their inputs (``sequences * seq_len``)."""

    tokens: int  # inputs of all its sequences
    long_tokens: int  # in documents of at least the long threshold
    split_tokens: int  # in a document that began in an earlier sequence
    split_documents: int  # documents continued across a sequence boundary
    histogram: np.ndarray  # tokens per length bin (documents' full lengths)


def stream_content(stream: TokenFileSource, long_length: int, edges: np.ndarray) -> StreamContent | None:
    """The documents inside ``stream``'s sequences (None when the file records no documents):
    its kept documents laid end to end, clipped to the tokens the sequences cover."""
    file, seq = stream.file, stream.seq_len
    if not (file.knows_documents or stream.eos is not None):
        return None
    starts = file.document_starts(stream.eos)
    lengths = np.diff(np.append(starts, file.count))
    kept = lengths[stream.document_mask(lengths)[0]]
    begin = np.concatenate([[0], np.cumsum(kept)[:-1]]).astype(np.int64)
    covered = stream.sequences * seq
    inside = np.clip(begin + kept, None, covered) - np.clip(begin, None, covered)  # tokens inside the sequences
    first_end = (begin // seq + 1) * seq  # end of the sequence a document starts in
    continued = np.clip(np.minimum(begin + kept, covered) - first_end, 0, None)
    bins = np.clip(np.searchsorted(edges, kept, side="right") - 1, 0, len(edges) - 2)
    return StreamContent(
        tokens=covered, long_tokens=int(inside[kept >= long_length].sum()), split_tokens=int(continued.sum()),
        split_documents=int((continued > 0).sum()), histogram=np.bincount(bins, inside, len(edges) - 1),
    )  # fmt: skip


@dataclass
class SourceReport:
    """One source's numbers over the inspected run."""

    name: str  # "" for data.path
    path: str
    target: float  # share of the mix's tokens asked for
    drawn: float  # share of the sequences (so of the tokens) drawn from it
    sequences: int  # sequences drawn
    long_length: int  # documents of at least this many tokens count as long
    long_target: float | None  # upsample_share, or None (documents as they come)
    long_drawn: float | None  # share of its drawn tokens in long documents (None: no document boundaries)
    split_drawn: float | None  # share of its drawn tokens in a document continued from an earlier sequence
    dropped_tokens: int  # tokens left out by long_documents="drop"
    file_tokens: int
    epochs: dict[str, float]  # stream role ("all", "long", "rest") -> times its sequences are drawn
    histogram: np.ndarray | None  # share of its drawn tokens per length bin

    @property
    def label(self) -> str:
        return self.name or "data.path"


@dataclass
class DataReport:
    """What :func:`inspect_data` found: a row per source, the histogram's bin edges, warnings."""

    samples: int
    seq_len: int
    steps: int
    global_batch: int
    sources: list[SourceReport]
    edges: np.ndarray  # histogram bin edges (tokens), log-spaced
    warnings: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The report as plain-text tables."""
        tokens = self.samples * self.seq_len
        lines = [
            f"{self.samples:,} sequences of {self.seq_len:,} tokens ({self.steps:,} steps x {self.global_batch} "
            f"sequences) = {tokens:,} tokens",
            "",
            f"{'source':<12} {'target':>7} {'drawn':>7} {'sequences':>10} {'long from':>10} {'long target':>11} "
            f"{'long drawn':>10} {'split':>7} {'dropped':>12} {'epochs':>18}",
        ]

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.1f}%"

        for s in self.sources:
            epochs = " / ".join(f"{r} {e:.2f}" if r != "all" else f"{e:.2f}" for r, e in s.epochs.items())
            lines.append(
                f"{s.label:<12} {pct(s.target):>7} {pct(s.drawn):>7} {s.sequences:>10,} {s.long_length:>10,} "
                f"{pct(s.long_target):>11} {pct(s.long_drawn):>10} {pct(s.split_drawn):>7} {s.dropped_tokens:>12,} "
                f"{epochs:>18}"
            )
        lines += [
            "",
            "target/drawn: share of the run's tokens; long: share of the source's drawn tokens in documents of at "
            "least 'long from' tokens; split: in a document continued from the previous sequence; dropped: tokens "
            "of the file left out (long_documents=drop); epochs: times its sequences are drawn (long / rest: its "
            "long documents and the others)",
            "",
            "document lengths: share of each source's drawn tokens in documents of these lengths (tokens)",
            f"{'length':>17} " + " ".join(f"{s.label:>12}" for s in self.sources),
        ]
        for b in range(len(self.edges) - 1):
            shares = [s.histogram[b] if s.histogram is not None else None for s in self.sources]
            if all(x is None or x == 0 for x in shares):
                continue
            span = f"{int(self.edges[b]):,}-{int(self.edges[b + 1]) - 1:,}"
            lines.append(f"{span:>17} " + " ".join(f"{pct(x):>12}" for x in shares))
        lines += [""] + [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines).rstrip() + "\n"

    def columns_and_rows(self) -> tuple[list[str], list[list]]:
        """The per-source table as columns and rows (shares as fractions, None where unknown)."""
        columns = ["source", "target", "drawn", "sequences", "long_from", "long_target", "long_drawn", "split_drawn",
                   "dropped_tokens", "file_tokens", "epochs"]  # fmt: skip
        rows = [
            [s.label, s.target, s.drawn, s.sequences, s.long_length, s.long_target, s.long_drawn, s.split_drawn,
             s.dropped_tokens, s.file_tokens, " / ".join(f"{r} {e:.2f}" for r, e in s.epochs.items())]
            for s in self.sources
        ]  # fmt: skip
        return columns, rows

    def plot(self, path: str | Path) -> None:
        """The document-length histogram as a PNG (one line of bars per source, log x axis)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        shown = [s for s in self.sources if s.histogram is not None]
        width = 0.8 / max(1, len(shown))
        centers = np.arange(len(self.edges) - 1)
        for j, s in enumerate(shown):
            ax.bar(centers + (j - (len(shown) - 1) / 2) * width, 100 * s.histogram, width, label=s.label)
        ax.set_xticks(centers, [_short(int(e)) for e in self.edges[:-1]], rotation=45)
        ax.set_xlabel("document length, tokens (bins from this length to the next, log-spaced)")
        ax.set_ylabel("% of the source's drawn tokens")
        ax.set_title(f"documents fed over {self.samples:,} sequences of {self.seq_len:,} tokens")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _short(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def length_edges(longest: int) -> np.ndarray:
    """Histogram bin edges: powers of two from 1 to above ``longest``."""
    return 2 ** np.arange(0, max(1, int(np.ceil(np.log2(max(longest, 1) + 1)))) + 1, dtype=np.int64)


def _streams_by_source(source, samples: int) -> dict[str, list[StreamDraws]]:
    out: dict[str, list[StreamDraws]] = {}
    for s in stream_draws(source, samples):
        out.setdefault(s.source, []).append(s)
    return out


def inspect_data(cfg: TrainConfig, steps: int | None = None, long_length: int = 0) -> DataReport:
    """What ``cfg``'s token files feed over ``steps`` optimizer steps (default ``run.steps``):
    a :class:`DataReport`. ``long_length``: the length from which a document counts as long
    (0: each source's ``upsample_length``, else ``data.seq_len``). Raises ConfigError or
    TokenFileError (one line) for a config that cannot be drawn from."""
    if cfg.data.source != "tokens":
        raise ConfigError(
            f"data-inspect reads token files; data.source={cfg.data.source!r} is generated on the fly: set "
            f"data.source='tokens' with data.path or [data.sources.NAME]"
        )
    steps = cfg.run.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"--steps {steps}: inspect at least one step")
    source = make_source(cfg)
    samples, seq = steps * cfg.data.global_batch, cfg.data.seq_len
    mixture = source if isinstance(source, MixtureSource) else None
    names = mixture.names if mixture is not None else ("",)
    parts = mixture.parts if mixture is not None else (source.source if isinstance(source, LengthGroupedSource)
                                                       else source,)  # fmt: skip
    settings = cfg.data.sources
    thresholds = {
        name: long_length or (settings[name].upsample_length if name in settings else 0) or seq for name in names
    }
    streams = _streams_by_source(source, samples)
    longest = max(int(np.diff(np.append(p.file.document_starts(_eos(p)), p.file.count)).max())
                  if _knows(p) else 1 for p in parts)  # fmt: skip
    edges = length_edges(longest)
    rows = []
    for name, part in zip(names, parts):
        draws = streams[name]
        contents = [stream_content(s.stream, thresholds[name], edges) for s in draws]
        drawn = sum(s.draws for s in draws)
        known = all(c is not None for c in contents) and drawn > 0

        rows.append(SourceReport(
            name=name, path=str(part.file.path),
            target=mixture.weights[name] if mixture is not None else 1.0, drawn=drawn / samples, sequences=drawn,
            long_length=thresholds[name],
            long_target=part.share if isinstance(part, UpsampledSource) else None,
            long_drawn=_mean(draws, [c.long_tokens / c.tokens for c in contents]) if known else None,
            split_drawn=_mean(draws, [c.split_tokens / c.tokens for c in contents]) if known else None,
            dropped_tokens=sum(s.stream.dropped_tokens for s in draws), file_tokens=part.file.count,
            epochs={s.role: s.epochs for s in draws},
            histogram=_mean(draws, [c.histogram / c.tokens for c in contents]) if known else None,
        ))  # fmt: skip
    warnings = []
    for name, draws in streams.items():
        for s in draws:
            if s.epochs > REPEAT_WARNING:
                what = f"source {name or 'data.path'}" + ("" if s.role == "all" else f" ({s.role} documents)")
                warnings.append(
                    f"{what}: its sequences repeat {s.epochs:.1f} times over {samples:,} sequences (past "
                    f"{REPEAT_WARNING:g} epochs); add {s.epochs / REPEAT_WARNING:.1f}x its data, lower its weight or "
                    f"run fewer steps"
                )
    for name, part in zip(names, parts):
        warnings += _part_notes(name or "data.path", part)
    return DataReport(samples, seq, steps, cfg.data.global_batch, rows, edges, warnings)


def natural_long_share(part: UpsampledSource) -> float:
    """The share of an upsampled source's tokens in its long documents as the file holds them."""
    long, rest = part.long.stream_tokens, part.rest.stream_tokens
    return long / (long + rest) if long + rest else 0.0


def _part_notes(label: str, part) -> list[str]:
    """What a source's settings do that its numbers do not show: an ``upsample_share`` below the
    file's own long share (its long documents are then drawn less: downsampled), and sequences
    skipped for having no loss target."""
    notes = []
    if isinstance(part, UpsampledSource) and part.share < natural_long_share(part):
        natural = natural_long_share(part)
        notes.append(
            f"source {label}: upsample_share={part.share:g} is below the share of its tokens in documents of at "
            f"least {part.threshold:,} tokens as the file holds them ({natural:.1%}), so those documents are "
            f"downsampled, not upsampled; raise upsample_share above {natural:.2f}, or remove upsample_length and "
            f"upsample_share to draw the documents as they come"
        )
    streams = part.streams if isinstance(part, UpsampledSource) else (getattr(part, "source", part),)
    for stream in streams:
        skipped = getattr(stream, "untargeted_sequences", 0)
        if skipped:
            total = stream.sequences
            notes.append(
                f"source {label}: {skipped:,} of its {total:,} sequences of {stream.seq_len:,} tokens"
                + (f" (documents of {stream.length_label()} tokens)" if stream.lengths != (0, None) else "")
                + " have no loss target (every label a prompt, or across a document boundary) and are skipped: "
                "never drawn, nor counted above"
            )
    return notes


def _mean(draws: list[StreamDraws], values: list):
    """``values`` (one per stream) weighted by how often each stream is drawn."""
    return sum(s.draws * v for s, v in zip(draws, values)) / sum(s.draws for s in draws)


def _eos(part) -> int | None:
    stream = part.long if isinstance(part, UpsampledSource) else part
    return stream.eos


def _knows(part) -> bool:
    return part.file.knows_documents or _eos(part) is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="TOML training config whose [data] is inspected")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps to inspect (default: run.steps)")
    parser.add_argument("--out", default="", help=f"folder for {TABLE_FILE} and {PLOT_FILE} (default: print only)")
    parser.add_argument(
        "--long", type=int, default=0, metavar="N",
        help="documents of at least N tokens count as long (default: each source's upsample_length, else seq_len)",
    )  # fmt: skip
    parser.epilog = "Config keys can be overridden: --section.key value (e.g. --data.sources.code.weight 0.4)."


def main(args: argparse.Namespace, extra: list[str]) -> None:
    from loongtrain.train.cli import split_overrides

    try:
        cfg = load_config(args.config, split_overrides(extra))
        report = inspect_data(cfg, args.steps, args.long)
    except (ConfigError, TokenFileError) as e:
        print(f"loongtrain data-inspect: {e}")
        raise SystemExit(2) from None
    text = report.table()
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / TABLE_FILE).write_text(text)
        report.plot(out / PLOT_FILE)
        print(f"wrote {out / TABLE_FILE} and {out / PLOT_FILE}")
