"""``loongtrain prepare``: text files -> one token file (documents separated by EOS)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from loongtrain.data.tokenizer import make_tokenizer
from loongtrain.data.tokens import write_tokens

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".tex")


def _text_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {item!r} is neither a file nor a folder")
    if not files:
        raise FileNotFoundError(f"no text files ({', '.join(TEXT_SUFFIXES)}) found in {inputs}")
    return files


def prepare(inputs: list[str], output: str, tokenizer: str | None = None) -> dict:
    """Tokenize every text file of ``inputs`` into the token file ``output``."""
    tok = make_tokenizer(tokenizer)
    parts = []
    files = _text_files(inputs)
    for path in files:
        parts.append(tok.encode(path.read_text(encoding="utf-8", errors="replace")))
        if tok.eos is not None:
            parts.append(np.array([tok.eos], dtype=np.int64))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    write_tokens(output, tokens, tok.vocab_size, tok.eos)
    return {"files": len(files), "tokens": int(tokens.size), "vocab_size": tok.vocab_size, "output": output}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="text files or folders (searched recursively)")
    parser.add_argument("-o", "--output", required=True, help="token file to write")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer.json file, or a local Hugging Face tokenizer folder or cached name "
        "(never downloaded; default: UTF-8 bytes)",
    )


def main(args: argparse.Namespace) -> None:
    try:
        info = prepare(args.inputs, args.output, args.tokenizer)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"loongtrain prepare: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(
        f"wrote {info['tokens']} tokens from {info['files']} file(s) to {info['output']} "
        f"(vocabulary {info['vocab_size']})"
    )
