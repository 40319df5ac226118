"""Three token files shaped like a long-context recipe's sources, for the CPU miniature of
ProLong's two stages (docs/stages.md): ``code.tok`` and ``books.tok`` of long documents,
``short.tok`` of short ones. No download, no tokenizer.

Every document is associative recall in the synthetic recall task's token ids
(:mod:`loongtrain.data.recall`, its defaults: 16 filler ids, 8 keys, 8 values): ``facts``
key-value fact tokens at random places among filler, then ``pairs`` question-answer pairs at
its end (a query token naming one of its keys, then the answer token of that key's value; one
pair per 32 tokens, at least 8). Only
the answers are loss targets (per-token flags), so a document is learned only by reaching back
from its end to facts anywhere in it: a long document teaches long-range retrieval, a short one
the skill at short range. Document lengths are lognormal (code: median 700 tokens, 256-3000;
books: median 1200, 512-4096; short: 40-128 uniform); documents start where the flags say, so
packing masks attention at their boundaries.

    .venv/bin/python scripts/make_mixture_data.py runs/mixture-data    # ~0.6M tokens a source, in seconds
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from loongtrain.data import write_tokens
from loongtrain.data.tokens import DOC_START, TARGET

FILLER, KEYS, VALUES = 16, 8, 8  # the recall task's defaults (data.recall_filler, _keys, _values)
QUERY0 = FILLER + KEYS * VALUES
ANSWER0 = QUERY0 + KEYS
VOCAB = ANSWER0 + VALUES
FACTS, PAIRS, TOKENS_PER_PAIR = 4, 8, 32


def document(rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
    """One recall document of ``length`` tokens and its flags: 8 question-answer pairs, or one
    per 32 tokens in a long document (as many targets per token as a short document has)."""
    pairs = max(PAIRS, length // TOKENS_PER_PAIR)
    body = length - 2 * pairs
    tokens = rng.integers(0, FILLER, length)
    keys = rng.permutation(KEYS)[:FACTS]
    values = rng.integers(0, VALUES, FACTS)
    tokens[rng.permutation(body)[:FACTS]] = FILLER + keys * VALUES + values
    asked = rng.integers(0, FACTS, pairs)
    tokens[body::2] = QUERY0 + keys[asked]
    tokens[body + 1 :: 2] = ANSWER0 + values[asked]
    flags = np.zeros(length, dtype=np.uint8)
    flags[0] = DOC_START
    flags[body + 1 :: 2] |= TARGET
    return tokens, flags


def lengths(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    if kind == "short":
        return rng.integers(40, 129, n)
    median, lo, hi = {"code": (400, 256, 768), "books": (600, 384, 1024)}[kind]
    return np.clip(rng.lognormal(np.log(median), 0.6, n), lo, hi).astype(np.int64)


def write_source(path: Path, kind: str, tokens: int, seed: int) -> int:
    """Documents of ``kind`` until ``tokens`` tokens; returns how many documents were written."""
    rng = np.random.default_rng(seed)
    ids, flags, total = [], [], 0
    while total < tokens:
        for length in lengths(rng, kind, 64):
            t, f = document(rng, int(length))
            ids.append(t)
            flags.append(f)
            total += int(length)
    write_tokens(path, np.concatenate(ids), vocab_size=VOCAB, flags=np.concatenate(flags))
    return len(ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for code.tok, books.tok and short.tok")
    parser.add_argument("--tokens", type=int, default=600_000, help="tokens per source (about)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, kind in enumerate(("code", "books", "short")):
        docs = write_source(out / f"{kind}.tok", kind, args.tokens, args.seed * 3 + i)
        print(f"{out / f'{kind}.tok'}: {docs:,} documents")


if __name__ == "__main__":
    main()
