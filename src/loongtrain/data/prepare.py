"""``loongtrain prepare``: text, JSONL, Parquet and ``datasets`` folders -> one token file.

Each record (or text file) is one document (see :mod:`loongtrain.data.encode` for how text,
chat and prompt/completion records become ids and loss targets). The token file gets the ids,
one flag byte per token (target, document start) and the tokenizer's fingerprint. It streams:
the main process reads the inputs in small tasks, workers (``--workers``) tokenize them, and
their results are written in input order to a temporary file next to the output, renamed into
place at the end; on any error (Ctrl-C included) the temporary file is removed. Output is
identical for any number of workers.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loongtrain.data.encode import DocumentEncoder, PrepareError, decode, location, pack_documents, parse_json_line
from loongtrain.data.inputs import JsonLines, Task, TextPiece, discover, tasks
from loongtrain.data.tokenizer import make_tokenizer
from loongtrain.data.tokens import DOC_START, TARGET, TokenWriter

ERRORS = ("strict", "replace")


@dataclass
class Result:
    """One task's tokens: ids (uint32), flags (uint8), skipped empty records, input bytes."""

    ids: np.ndarray
    flags: np.ndarray
    empty: int
    nbytes: int


def encode_task(encoder: DocumentEncoder, errors: str, task: Task) -> Result:
    """Decode, parse, validate and tokenize one task."""
    if isinstance(task, TextPiece):
        text = decode(task.data, errors, task.label, task.offset, task.line)
        if task.first:
            text = text.removeprefix("\ufeff")
            if not text and task.last:
                raise PrepareError(f"{task.label}: empty file")
        ids = encoder.text_piece(text, task.first, task.last).astype(np.uint32)
        flags = np.full(ids.size, TARGET, dtype=np.uint8)
        if task.first:
            flags[0] |= DOC_START
        return Result(ids, flags, 0, task.nbytes)
    docs, empty = [], 0
    if isinstance(task, JsonLines):
        offset = task.offset
        for k, raw in enumerate(task.lines):
            line = task.line + k
            record = parse_json_line(raw, errors, task.label, offset, line)
            offset += len(raw)
            if record is not None:
                doc = encoder.record(record, task.field, location(task.label, line=line))
                empty += doc is None
                if doc is not None:
                    docs.append(doc)
    else:
        names = list(task.columns)
        for k in range(len(task.columns[names[0]])):
            record = {name: task.columns[name][k] for name in names}
            doc = encoder.record(record, task.field, location(task.label, row=task.row + k))
            empty += doc is None
            if doc is not None:
                docs.append(doc)
    ids, flags = pack_documents(docs)
    return Result(ids, flags, empty, task.nbytes)


_worker: dict = {}  # this worker process's encoder and error mode (set by _init_worker)


def _init_worker(tokenizer: str | None, errors: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and stops the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _worker["encoder"], _worker["errors"] = DocumentEncoder(make_tokenizer(tokenizer)), errors


def _encode_in_worker(task: Task) -> Result:
    return encode_task(_worker["encoder"], _worker["errors"], task)


def ordered_map(fn: Callable, items: Iterable, executor: Executor, depth: int) -> Iterator:
    """``fn`` over ``items`` on ``executor``, results in input order, at most ``depth`` in
    flight (bounded memory). An error while producing items surfaces after the results (and
    errors) of the items before it, as it would in order; Ctrl-C stops at once."""
    pending: deque = deque()
    items = iter(items)
    while True:
        try:
            item = next(items)
        except StopIteration:
            break
        except Exception:
            while pending:
                yield pending.popleft().result()
            raise
        pending.append(executor.submit(fn, item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def run_tasks(
    items: Iterable[Task], encoder: DocumentEncoder, tokenizer: str | None, errors: str, workers: int
) -> Iterator[Result]:
    """Results of every task in order: in this process, or on ``workers`` processes."""
    if workers == 1:
        for task in items:
            yield encode_task(encoder, errors, task)
        return
    context = multiprocessing.get_context("spawn")  # fork is unsafe once tokenizers started its threads
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(tokenizer, errors))
    try:
        yield from ordered_map(_encode_in_worker, items, pool, 2 * workers)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class LengthStats:
    """Exact document length distribution in bounded memory: counts of lengths below 2**16,
    and the (few) longer lengths themselves."""

    SMALL = 1 << 16

    def __init__(self) -> None:
        self.counts = np.zeros(self.SMALL, dtype=np.int64)
        self.large: list[int] = []

    def add(self, lengths: np.ndarray) -> None:
        small = lengths[lengths < self.SMALL]
        self.counts += np.bincount(small, minlength=self.SMALL)
        self.large += lengths[lengths >= self.SMALL].tolist()

    @property
    def documents(self) -> int:
        return int(self.counts.sum()) + len(self.large)

    def quantile(self, q: float) -> int:
        """Smallest length with at least a fraction ``q`` of the documents no longer (nearest rank)."""
        n = self.documents
        if n == 0:
            return 0
        rank = max(1, int(np.ceil(q * n)))
        cum = np.cumsum(self.counts)
        if cum[-1] >= rank:
            return int(np.searchsorted(cum, rank))
        return int(sorted(self.large)[rank - int(cum[-1]) - 1])

    @property
    def max(self) -> int:
        if self.large:
            return max(self.large)
        nonzero = np.flatnonzero(self.counts)
        return int(nonzero[-1]) if nonzero.size else 0

    def longer_than(self, n: int) -> tuple[int, int]:
        """(documents, tokens) of the documents longer than ``n`` tokens."""
        lengths = np.arange(self.SMALL)
        tail = self.counts[n + 1 :] if n + 1 < self.SMALL else self.counts[:0]
        docs = int(tail.sum()) + sum(1 for x in self.large if x > n)
        tokens = int((tail * lengths[n + 1 :]).sum()) + sum(x for x in self.large if x > n)
        return docs, tokens


@dataclass
class Stats:
    """Running totals of what was written."""

    tokens: int = 0
    targets: int = 0
    empty: int = 0
    nbytes: int = 0
    lengths: LengthStats = field(default_factory=LengthStats)
    _open: int | None = None  # start of the document still being written

    def add(self, r: Result) -> None:
        starts = np.flatnonzero(r.flags & DOC_START) + self.tokens
        if starts.size:
            bounds = starts if self._open is None else np.concatenate([[self._open], starts])
            self.lengths.add(np.diff(bounds))
            self._open = int(starts[-1])
        self.tokens += r.ids.size
        self.targets += int(np.count_nonzero(r.flags & TARGET))
        self.empty += r.empty
        self.nbytes += r.nbytes

    def finish(self) -> None:
        if self._open is not None:
            self.lengths.add(np.array([self.tokens - self._open]))
            self._open = None


class Progress:
    """Bytes read / total and tokens/s on stderr: one updating line on a terminal, else a
    plain line every 10% (and at most every 30 s)."""

    def __init__(self, total: int, enabled: bool, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.enabled = max(total, 1), enabled
        self.tty = enabled and self.stream.isatty()
        self.start = self.last = time.perf_counter()
        self.next_tenth = 1

    def update(self, done: int, tokens: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = min(done / self.total, 1.0)
        if self.tty:
            if now - self.last < 0.2:
                return
        elif frac * 10 < self.next_tenth and now - self.last < 30:
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        text = (
            f"prepare: {100 * frac:5.1f}% of {self.total / 1e6:,.1f} MB read, {tokens:,} tokens, {rate:,.0f} tokens/s"
        )
        if self.tty:
            self.stream.write("\r" + text)
        else:
            self.next_tenth = int(frac * 10) + 1
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


WORKER_BYTES = 8 << 20  # input per worker that pays for its start-up (~3 s to import and load a tokenizer)


def default_workers(total_bytes: int | None = None) -> int:
    """min(4, cores), and no more than one worker per ``WORKER_BYTES`` of input."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(1, min(4, cores))
    return workers if total_bytes is None else max(1, min(workers, total_bytes // WORKER_BYTES))


def prepare(
    inputs: list[str],
    output: str,
    tokenizer: str | None = None,
    *,
    field: str | None = None,
    errors: str = "strict",
    workers: int | None = 1,
    seq_len: int | None = None,
    progress: bool = False,
) -> dict:
    """Tokenize ``inputs`` into the token file ``output``; returns a summary. Raises
    :class:`PrepareError` (one line naming the file and line or row) on bad input and leaves
    no file behind. ``field``: the records' field (``text``, ``messages``, ``prompt+completion``,
    another name; None: detected); ``errors="replace"`` reads non-UTF-8 and binary input;
    ``workers``: tokenizer processes (1: this one; None: :func:`default_workers` for the input size)."""
    if errors not in ERRORS:
        raise ValueError(f"errors={errors!r}: use one of {', '.join(ERRORS)}")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers {workers}: need at least 1")
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"--seq-len {seq_len}: need at least 1")
    tok = make_tokenizer(tokenizer)
    encoder = DocumentEncoder(tok)
    found = discover(inputs)
    if workers is None:
        workers = default_workers(sum(i.size for i in found))
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    stats, bar = Stats(), Progress(sum(i.size for i in found), progress)
    with TokenWriter(out, tok.vocab_size, tok.eos, tok.fingerprint) as writer:
        for result in run_tasks(tasks(found, field, errors, tok), encoder, tokenizer, errors, workers):
            writer.write(result.ids, result.flags)
            stats.add(result)
            bar.update(stats.nbytes, stats.tokens)
        stats.finish()
        if stats.lengths.documents == 0:
            raise PrepareError(f"no documents in {', '.join(map(str, inputs))} (every record is empty)")
    bar.close()
    seconds = time.perf_counter() - start
    lengths = stats.lengths
    info = {
        "output": str(output),
        "files": len(found),
        "documents": lengths.documents,
        "tokens": stats.tokens,
        "targets": stats.targets,
        "empty_skipped": stats.empty,
        "vocab_size": tok.vocab_size,
        "eos": tok.eos,
        "fingerprint": tok.fingerprint,
        "tokenizer": tok.name,
        "seconds": seconds,
        "tokens_per_s": stats.tokens / max(seconds, 1e-9),
        "length_max": lengths.max,
        "length_p50": lengths.quantile(0.5),
        "length_p99": lengths.quantile(0.99),
        "workers": workers,
    }
    if seq_len is not None:
        info["seq_len"] = seq_len
        info["longer_documents"], info["longer_tokens"] = lengths.longer_than(seq_len)
    return info


def summary(info: dict) -> str:
    """The lines `loongtrain prepare` prints at the end."""
    share = 100 * info["targets"] / max(info["tokens"], 1)
    lines = [
        f"wrote {info['tokens']:,} tokens ({info['targets']:,} targets, {share:.1f}%) in {info['documents']:,} "
        f"documents from {info['files']} input(s) to {info['output']} in {info['seconds']:.1f} s: "
        f"{info['tokens_per_s']:,.0f} tokens/s with {info['workers']} worker(s)",
        f"tokenizer {info['tokenizer']}: vocabulary {info['vocab_size']}, eos {info['eos']}, "
        f"fingerprint {info['fingerprint']:016x}",
        f"document length (tokens): max {info['length_max']:,}, p50 {info['length_p50']:,}, p99 {info['length_p99']:,}",
    ]
    if info["empty_skipped"]:
        lines.append(f"skipped {info['empty_skipped']:,} record(s) with an empty text")
    if "seq_len" in info:
        lines.append(
            f"{info['longer_documents']:,} document(s) ({info['longer_tokens']:,} tokens) are longer than "
            f"--seq-len {info['seq_len']}: data.long_documents = split continues them in the next window, "
            f"drop leaves them out"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="+",
        help="text files (one document each), .jsonl / .parquet files (one document per record), datasets "
        "save_to_disk folders, or folders searched recursively for them",
    )
    parser.add_argument("-o", "--output", required=True, help="token file to write")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer.json file, or a local Hugging Face tokenizer folder or cached name "
        "(never downloaded; default: UTF-8 bytes)",
    )
    parser.add_argument(
        "--field",
        default=None,
        help="the records' document: text (a string), messages (chat, rendered by the tokenizer's chat template; "
        "assistant turns are the targets), prompt+completion (the completion is the target), or another field "
        "name (A+B for a prompt A and completion B); default: detected from each file's first record",
    )
    parser.add_argument(
        "--errors",
        choices=ERRORS,
        default="strict",
        help="strict: refuse binary and non-UTF-8 input; replace: decode it with U+FFFD (default: strict)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"tokenizer processes (default: min(4, cores) = {default_workers()}, at most one per "
        f"{WORKER_BYTES >> 20} MB of input); the output is the same for any number",
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="report how many documents are longer than this training length"
    )


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> None:
    signal.signal(signal.SIGTERM, _terminate)  # clean up the temporary file on kill too
    try:
        info = prepare(
            args.inputs,
            args.output,
            args.tokenizer,
            field=args.field,
            errors=args.errors,
            workers=args.workers,
            seq_len=args.seq_len,
            progress=True,
        )
    except (OSError, RuntimeError, ValueError) as e:
        print(f"loongtrain prepare: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"loongtrain prepare: interrupted; {args.output} was not written", file=sys.stderr)
        raise SystemExit(130) from None
    print(summary(info))
