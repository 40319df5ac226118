"""``loongtrain bench data``: what drawing a step's batch costs the loader, one process.

Writes (once, reused) token files of lognormal document lengths with per-token flags, as
``loongtrain prepare`` makes them, and builds each case through the trainer's own
:func:`~loongtrain.train.spec.make_source` and :class:`~loongtrain.data.loader.BatchLoader`:
one file (``data.path``, the baseline), a mixture of three files at 0.3 / 0.3 / 0.4, and the
same mixture with one source's long documents upsampled to half its tokens. For each: the
seconds to build the source (its indexes: one scan of each file's flags), the first step
(the first epoch's permutations, the interleaving's first block) and the median of the next
steps, in ms per step and per sequence of 128K tokens. Files are memory-mapped; once written
they sit in the page cache, so this is the loader's own cost, not a disk's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from loongtrain.config import load_config
from loongtrain.data import write_tokens
from loongtrain.data.loader import BatchLoader
from loongtrain.data.tokens import DOC_START, TARGET
from loongtrain.train.spec import make_source

SOURCES = {"code": 0.3, "books": 0.3, "web": 0.4}
VOCAB = 128_256  # Llama-3's: 4-byte ids
REFERENCE_SEQ = 128 * 1024  # costs are also given per sequence of this many tokens


def write_source(path: Path, tokens: int, median: int, seed: int) -> None:
    """A token file of about ``tokens`` tokens in documents of lognormal lengths (median
    ``median``, sigma 1.5), with flags (every token a target, document starts marked)."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(2, rng.lognormal(np.log(median), 1.5, size=4 * tokens // median + 16).astype(np.int64))
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    ids = rng.integers(0, VOCAB, int(lengths.sum()), dtype=np.int64)
    flags = np.full(len(ids), TARGET, dtype=np.uint8)
    flags[np.concatenate([[0], np.cumsum(lengths)[:-1]])] |= DOC_START
    write_tokens(path, ids, VOCAB, eos=None, flags=flags)


def cases(folder: Path, long_length: int) -> dict[str, list[str]]:
    """Config overrides of each case."""
    mixture = [f"data.sources.{n}.path={folder / f'{n}.tok'}" for n in SOURCES]
    mixture += [f"data.sources.{n}.weight={w}" for n, w in SOURCES.items()]
    return {
        "one file": [f"data.path={folder / 'web.tok'}"],
        "mixture of 3": mixture,
        "mixture, upsampled": [
            *mixture,
            f"data.sources.code.upsample_length={long_length}",
            "data.sources.code.upsample_share=0.5",
        ],
    }


def measure(overrides: list[str], seq: int, batch: int, steps: int) -> dict:
    """Build time, first step and the median later step (seconds) of one case."""
    base = ["data.source=tokens", f"data.seq_len={seq}", "data.pack=true", f"data.global_batch={batch}"]
    cfg = load_config(None, [*base, *overrides])
    t0 = time.perf_counter()
    source = make_source(cfg)
    built = time.perf_counter() - t0
    loader = BatchLoader(source, batch, 1, 1, 0)
    t0 = time.perf_counter()
    loader.next()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loader.next()
        times.append(time.perf_counter() - t0)
    return {"build_s": built, "first_s": first, "step_s": statistics.median(times), "max_s": max(times)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", type=int, default=REFERENCE_SEQ, help="tokens per sequence (data.seq_len)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (data.global_batch)")
    parser.add_argument("--steps", type=int, default=20, help="steps timed after the first")
    parser.add_argument(
        "--tokens", type=int, default=24 << 20, help="tokens per source file (default 24M: 192 sequences of 128K)"
    )
    parser.add_argument("--dir", default="", help="folder for the token files (default: a temporary one)")


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="loongtrain-bench-data-") as tmp:
        folder = Path(args.dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for seed, name in enumerate(SOURCES):
            path = folder / f"{name}.tok"
            if not path.is_file():
                write_source(path, args.tokens, median={"code": 2048, "books": 8192, "web": 512}[name], seed=seed)
        run(folder, args.seq, args.batch, args.steps)


def run(folder: Path, seq: int, batch: int, steps: int) -> list[dict]:
    """Measure every case on the files in ``folder`` and print the table; returns its rows."""
    per_ref = REFERENCE_SEQ / seq
    print(f"loader: {batch} sequences of {seq:,} tokens per step, median of {steps} steps after the first")
    print(f"{'case':<20} {'build s':>8} {'first step ms':>14} {'step ms':>8} {'max ms':>8} {'ms per 128K seq':>16}")
    rows = []
    for name, overrides in cases(folder, long_length=min(seq // 4, 32_768)).items():
        r = measure(overrides, seq, batch, steps)
        r["case"], r["ms_per_128k"] = name, 1e3 * r["step_s"] / batch * per_ref
        rows.append(r)
        print(
            f"{name:<20} {r['build_s']:>8.2f} {1e3 * r['first_s']:>14.1f} {1e3 * r['step_s']:>8.1f} "
            f"{1e3 * r['max_s']:>8.1f} {r['ms_per_128k']:>16.2f}",
            flush=True,
        )
    return rows
