"""Tokenizers for `loongtrain prepare`: bytes (no download), or a local Hugging Face one
(a ``tokenizer.json`` file through the ``tokenizers`` package, or a tokenizer folder or
cached name through ``transformers``; never downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, and an end-of-document token 256."""

    vocab_size = 257
    eos = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class TokenizerJson:
    """A ``tokenizer.json`` file (Hugging Face ``tokenizers`` format)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise RuntimeError(f"reading {path!r} needs the `tokenizers` package (pip install tokenizers)") from e
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos = next(
            (self._tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
             if self._tok.token_to_id(t) is not None),
            None,
        )  # fmt: skip

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class HFTokenizer:
    """A tokenizer from a local Hugging Face folder or cached name (no download)."""

    def __init__(self, name_or_path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise RuntimeError(
                "--tokenizer needs the `transformers` package (pip install transformers); "
                "or use the built-in byte tokenizer (omit --tokenizer)"
            ) from e
        try:
            self._tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise RuntimeError(
                f"could not load a local Hugging Face tokenizer from {name_or_path!r} (no download is attempted): {e}"
            ) from e
        self.vocab_size = len(self._tok)
        self.eos = self._tok.eos_token_id if self._tok.eos_token_id is not None else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def make_tokenizer(name: str | None):
    """``None`` or ``"bytes"``: the byte tokenizer; a ``.json`` file: ``tokenizers``; else a
    local Hugging Face tokenizer folder or cached name (``transformers``)."""
    if name in (None, "", "bytes"):
        return ByteTokenizer()
    if Path(name).is_file() and name.endswith(".json"):
        return TokenizerJson(name)
    return HFTokenizer(name)
