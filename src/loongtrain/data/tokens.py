"""The token file: a 64-byte header, the token ids, then (version 2) one flag byte per token.

Header, little-endian: magic ``b"LOONGTOK"`` (8 bytes), format version (u32), bytes per token
(u32: 2 = uint16, 4 = uint32), token count N (u64), vocabulary size of the tokenizer (u64,
0 = unknown), end-of-document token id + 1 (u64, 0 = unknown). Version 2 adds the tokenizer
fingerprint (u64, see :func:`loongtrain.data.tokenizer.tokenizer_fingerprint`) and a features
word (u32: bit 0 = the file holds per-token flags, bit 1 = the fingerprint is recorded); the
rest of the 64 bytes is zero. The ids follow at byte 64 (N x width bytes), then, when bit 0
is set, N flag bytes: bit 0 (``TARGET``) = the token is a loss target (a label may predict
it), bit 1 (``DOC_START``) = the token starts a document.

Version 1 files (no fingerprint, no flags) still read: every token is a target and documents
end after the recorded end-of-document token. A 128K vocabulary needs uint32;
:class:`TokenWriter` picks the smallest width.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from pathlib import Path

import numpy as np

MAGIC = b"LOONGTOK"
VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER_BYTES = 64
_HEADER_V1 = struct.Struct("<8sIIQQQ")  # magic, version, width, count, vocab, eos + 1
_HEADER = struct.Struct("<8sIIQQQQI")  # ... + tokenizer fingerprint, features
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
HAS_FLAGS, HAS_FINGERPRINT = 1, 2  # header features bits
TARGET, DOC_START = 1, 2  # per-token flag bits
SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning a whole file
COPY_CHUNK = 1 << 20  # bytes per read when appending the flags to the ids
IDENTITY_SAMPLE = 1 << 16  # bytes read at the start, middle and end of a file for its identity


class TokenFileError(ValueError):
    """A token file that cannot be used; the message says what is wrong."""


def token_width(vocab_size: int) -> int:
    """Bytes per token id for a vocabulary of ``vocab_size``."""
    return 2 if vocab_size <= 2**16 else 4


class TokenWriter:
    """Streams ids (and flags) into a temporary file next to ``path``; :meth:`commit` patches
    the header and renames it into place, :meth:`abort` (or leaving a ``with`` block on an
    exception, Ctrl-C included) removes every temporary file. Nothing half-written is ever
    found at ``path``; an existing file there is replaced only by a complete one."""

    def __init__(
        self,
        path: str | Path,
        vocab_size: int,
        eos: int | None = None,
        fingerprint: int | None = None,
        flags: bool = True,
    ) -> None:
        self.path = Path(path)
        self.vocab_size, self.eos, self.fingerprint, self.has_flags = vocab_size, eos, fingerprint, flags
        self.width = token_width(vocab_size)
        self.count = 0
        stem = f".{self.path.name}.{os.getpid()}"
        self._tmp = self.path.with_name(stem + ".tmp")
        self._tmp_flags = self.path.with_name(stem + ".flags.tmp") if flags else None
        self._ids = self._flags = None
        try:
            self._ids = open(self._tmp, "wb")
            self._ids.write(b"\0" * HEADER_BYTES)  # patched by commit()
            if self._tmp_flags is not None:
                self._flags = open(self._tmp_flags, "wb")
        except BaseException:
            self.abort()
            raise

    def write(self, ids: np.ndarray, flags: np.ndarray | None = None) -> None:
        """Append ``ids`` (ints in ``[0, vocab_size)``) and, when the file has flags, their flags."""
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got [{ids.min()}, {ids.max()}]")
        if (flags is None) != (self._flags is None):
            raise ValueError("flags must be given exactly when the file has flags")
        if flags is not None:
            flags = np.asarray(flags, dtype=np.uint8)
            if flags.shape != ids.shape:
                raise ValueError(f"flags {flags.shape} must match the ids {ids.shape}")
            self._flags.write(flags.tobytes())
        self._ids.write(ids.astype(_DTYPES[self.width]).tobytes())
        self.count += ids.size

    def header(self) -> bytes:
        features = (HAS_FLAGS if self.has_flags else 0) | (HAS_FINGERPRINT if self.fingerprint is not None else 0)
        eos_field = 0 if self.eos is None else self.eos + 1
        fields = (MAGIC, VERSION, self.width, self.count, self.vocab_size, eos_field, self.fingerprint or 0, features)
        return _HEADER.pack(*fields).ljust(HEADER_BYTES, b"\0")

    def commit(self) -> None:
        """Finish the file: header, flags after the ids, rename into place."""
        try:
            if self._flags is not None:
                self._flags.close()
                with open(self._tmp_flags, "rb") as src:
                    shutil.copyfileobj(src, self._ids, COPY_CHUNK)
                self._tmp_flags.unlink()
            self._ids.seek(0)
            self._ids.write(self.header())
            self._ids.close()
            self._tmp.replace(self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Close and remove the temporary files (safe to call more than once)."""
        for handle in (self._ids, self._flags):
            if handle is not None:
                handle.close()
        for tmp in (self._tmp, self._tmp_flags):
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def write_tokens(
    path: str | Path,
    tokens: np.ndarray,
    vocab_size: int,
    eos: int | None = None,
    flags: np.ndarray | None = None,
    fingerprint: int | None = None,
) -> None:
    """Write ``tokens`` (ints in ``[0, vocab_size)``) to ``path`` atomically; ``eos`` is the
    token that ends each document (recorded for packing); ``flags`` (uint8 per token,
    ``TARGET`` | ``DOC_START``) make targets and documents explicit; ``fingerprint`` is the
    tokenizer's. Without flags every token is a target and documents end at ``eos``."""
    tokens = np.asarray(tokens)
    with TokenWriter(path, vocab_size, eos, fingerprint, flags=flags is not None) as writer:
        writer.write(tokens, flags)


def _token_files_hint(folder: Path, most: int = 3) -> str:
    """What to give instead of ``folder``: the token files in it (by their header), if any."""
    found = []
    try:
        for entry in sorted(folder.iterdir())[:1000]:
            try:
                if entry.is_file():
                    with entry.open("rb") as f:
                        if f.read(len(MAGIC)) == MAGIC:
                            found.append(entry.name)
            except OSError:
                continue
    except OSError:
        pass
    if not found:
        return ", not a token file; give the file `loongtrain prepare` wrote"
    shown = ", ".join(found[:most]) + (f" and {len(found) - most} more" if len(found) > most else "")
    return f", not a token file; give one of the token files in it: {shown}"


class TokenFile:
    """A validated, memory-mapped token file (version 1 or 2).

    ``tokens``: the ids (memmap); ``flags``: the per-token flags (memmap) or None (every token
    a target, documents from ``eos``); ``tokenizer_fingerprint``: the tokenizer's 64-bit
    fingerprint, or None when not recorded (version 1 files).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise TokenFileError(f"token file {str(self.path)!r} is a folder{_token_files_hint(self.path)}")
        if not self.path.is_file():
            raise TokenFileError(f"token file {str(self.path)!r} does not exist")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(HEADER_BYTES)
        if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
            raise TokenFileError(
                f"{self.path}: not a loongtrain token file (bad header); make one with `loongtrain prepare`"
            )
        version = struct.unpack_from("<I", raw, 8)[0]
        if version not in READABLE_VERSIONS:
            raise TokenFileError(
                f"{self.path}: format version {version}, this loongtrain reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; re-create it with this loongtrain's `loongtrain prepare`"
            )
        if version == 1:
            _, _, width, count, vocab, eos_field = _HEADER_V1.unpack_from(raw)
            fingerprint, features = 0, 0
        else:
            _, _, width, count, vocab, eos_field, fingerprint, features = _HEADER.unpack_from(raw)
        if width not in _DTYPES:
            raise TokenFileError(f"{self.path}: {width} bytes per token is not supported (2 or 4)")
        has_flags = bool(features & HAS_FLAGS)
        per_token = width + (1 if has_flags else 0)
        expected = HEADER_BYTES + count * per_token
        if size != expected:
            what = "truncated" if size < expected else "longer than its header says"
            flags = " + 1 flag byte" if has_flags else ""
            raise TokenFileError(
                f"{self.path}: file is {what}: header says {count} tokens x {width} bytes{flags} = {expected} "
                f"bytes with the header, the file has {size}; re-create it with `loongtrain prepare`"
            )
        self.version, self.count, self.vocab_size, self.width = version, count, vocab, width
        self.eos: int | None = eos_field - 1 if eos_field else None  # end-of-document token, if recorded
        self.tokenizer_fingerprint: int | None = fingerprint if features & HAS_FINGERPRINT else None
        self.tokens = np.memmap(self.path, dtype=_DTYPES[width], mode="r", offset=HEADER_BYTES, shape=(count,))
        self.flags: np.ndarray | None = None
        if has_flags:
            offset = HEADER_BYTES + count * width
            self.flags = np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=(count,))

    def __reduce__(self):
        # to another process as its path (opened and checked again there), never its tokens:
        # a memmap would be pickled as a copy of the whole array
        return (TokenFile, (self.path,))

    def identity(self, sample_bytes: int = IDENTITY_SAMPLE) -> dict:
        """What identifies the file's content without reading all of it: its header fields and
        the SHA-256 of ``sample_bytes`` read at its start, middle and end (not its path or
        modification time: a copy of the file on another machine matches)."""
        size = self.path.stat().st_size
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - sample_bytes // 2), max(0, size - sample_bytes)}):
                f.seek(offset)
                digest.update(f.read(sample_bytes))
        return {
            "version": self.version, "count": self.count, "width": self.width, "vocab_size": self.vocab_size,
            "eos": self.eos, "tokenizer": self.tokenizer_fingerprint, "flags": self.flags is not None,
            "size": size, "sample_sha256": digest.hexdigest(),
        }  # fmt: skip

    def max_token(self, chunk: int = SCAN_CHUNK) -> int:
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

    @property
    def knows_documents(self) -> bool:
        """Whether document boundaries are known (flags, or a recorded end-of-document token)."""
        return self.flags is not None or self.eos is not None

    def document_starts(self, eos: int | None = None, chunk: int = SCAN_CHUNK) -> np.ndarray:
        """Sorted int64 start offsets of every document (the first is 0 for a non-empty file):
        from the flags when present, else a document starts after each ``eos`` token (default:
        the recorded one). Scans the file in chunks; memory is one int64 per document."""
        parts = [np.zeros(1, dtype=np.int64)] if self.count else []
        if self.flags is not None:
            for i in range(0, self.count, chunk):
                found = np.flatnonzero(self.flags[i : i + chunk] & DOC_START).astype(np.int64) + i
                parts.append(found[found > 0])
        else:
            eos = self.eos if eos is None else eos
            if eos is None:
                raise TokenFileError(
                    f"{self.path}: the file records no document boundaries (no flags, no end-of-document token); "
                    f"set data.eos_id or re-create it with `loongtrain prepare`"
                )
            for i in range(0, self.count, chunk):
                found = np.flatnonzero(self.tokens[i : i + chunk] == eos).astype(np.int64) + i + 1
                parts.append(found[found < self.count])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
