"""The token file: a 64-byte header, then the token ids, little-endian.

Header: magic ``b"LOONGTOK"``, format version (u32), bytes per token (u32: 2 = uint16,
4 = uint32), token count (u64), vocabulary size of the tokenizer (u64, 0 = unknown),
end-of-document token id + 1 (u64, 0 = unknown; files written before it existed read as
unknown), zero padding. A 128K vocabulary needs uint32; ``write_tokens`` picks the smallest.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MAGIC = b"LOONGTOK"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQQ")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class TokenFileError(ValueError):
    """A token file that cannot be used; the message says what is wrong."""


def write_tokens(path: str | Path, tokens: np.ndarray, vocab_size: int, eos: int | None = None) -> None:
    """Write ``tokens`` (ints in ``[0, vocab_size)``) to ``path`` atomically; ``eos`` is the
    token that ends each document (recorded for packing)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got [{tokens.min()}, {tokens.max()}]")
    width = 2 if vocab_size <= 2**16 else 4
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        eos_field = 0 if eos is None else eos + 1
        f.write(_HEADER.pack(MAGIC, VERSION, width, tokens.size, vocab_size, eos_field).ljust(HEADER_BYTES, b"\0"))
        f.write(tokens.astype(_DTYPES[width]).tobytes())
    tmp.replace(path)


class TokenFile:
    """A validated, memory-mapped token file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise TokenFileError(f"token file {str(self.path)!r} does not exist")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(HEADER_BYTES)
        if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
            raise TokenFileError(
                f"{self.path}: not a loongtrain token file (bad header); make one with `loongtrain prepare`"
            )
        _, version, width, count, vocab, eos_field = _HEADER.unpack(raw[: _HEADER.size])
        if version != VERSION:
            raise TokenFileError(f"{self.path}: format version {version}, this loongtrain reads version {VERSION}")
        if width not in _DTYPES:
            raise TokenFileError(f"{self.path}: {width} bytes per token is not supported (2 or 4)")
        expected = HEADER_BYTES + count * width
        if size != expected:
            what = "truncated" if size < expected else "longer than its header says"
            raise TokenFileError(
                f"{self.path}: file is {what}: header says {count} tokens x {width} bytes = {expected} bytes "
                f"with the header, the file has {size}; re-create it with `loongtrain prepare`"
            )
        self.count, self.vocab_size, self.width = count, vocab, width
        self.eos: int | None = eos_field - 1 if eos_field else None  # end-of-document token, if recorded
        self.tokens = np.memmap(self.path, dtype=_DTYPES[width], mode="r", offset=HEADER_BYTES, shape=(count,))

    def max_token(self, chunk: int = 1 << 24) -> int:
        """Largest token id in the file (scanned in chunks)."""
        return max((int(self.tokens[i : i + chunk].max()) for i in range(0, self.count, chunk)), default=-1)

    def check_vocab(self, model_vocab: int) -> None:
        """Raise if any token id is not below ``model_vocab``."""
        largest = self.max_token()
        if largest >= model_vocab:
            raise TokenFileError(
                f"{self.path}: token id {largest} is beyond the model's vocabulary of {model_vocab} "
                f"(tokenizer vocabulary {self.vocab_size}); set model.vocab_size >= {largest + 1}"
            )
