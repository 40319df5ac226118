"""Tokenizers for `loongtrain prepare`: bytes (no download), or a local Hugging Face one
(a ``tokenizer.json`` file through the ``tokenizers`` package, or a tokenizer folder or
cached name through ``transformers``; never downloaded), and their identity.

Every tokenizer here offers ``encode`` (no special tokens), ``wrap`` (the special tokens its
own post-processor puts around a text: BOS, sometimes EOS), ``bos``/``eos``, and
``fingerprint``: a 64-bit hash of its vocabulary (token -> id), its added tokens (id,
content, special) and its BOS/EOS ids, recorded in token files so that a trainer can refuse
a file made with another tokenizer (:func:`check_same_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")  # guessed when nothing names the EOS
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def fingerprint_of(vocab: dict[str, int], added: list[tuple[int, str, bool]], bos: int | None, eos: int | None) -> int:
    """64-bit fingerprint of a vocabulary (token -> id), its added tokens ``(id, content,
    special)`` and the BOS/EOS ids (order of the inputs does not matter)."""
    h = hashlib.blake2b(digest_size=8, person=b"loongtok")
    parts = [b"vocab"]
    for token, i in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
        raw = token.encode("utf-8", "surrogatepass")
        parts += [struct.pack("<QI", i, len(raw)), raw]
    parts.append(b"added")
    for i, content, special in sorted(added):
        raw = content.encode("utf-8", "surrogatepass")
        parts += [struct.pack("<QBI", i, bool(special), len(raw)), raw]
    parts.append(struct.pack("<qq", -1 if bos is None else bos, -1 if eos is None else eos))
    h.update(b"".join(parts))
    return int.from_bytes(h.digest(), "little")


def _backend_parts(backend) -> tuple[dict[str, int], list[tuple[int, str, bool]]]:
    """Vocabulary and added tokens of a ``tokenizers.Tokenizer``."""
    added = [(i, t.content, bool(t.special)) for i, t in backend.get_added_tokens_decoder().items()]
    return backend.get_vocab(with_added_tokens=True), added


def _config_token(folder: Path, key: str) -> str | None:
    """The ``bos_token``/``eos_token`` named by a tokenizer folder's config files."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                return value
    return None


def _json_bos_eos(backend, folder: Path) -> tuple[int | None, int | None]:
    """BOS/EOS ids of a ``tokenizer.json``: named by the folder's config files when present,
    else the EOS guessed from common names (no BOS)."""
    bos_name, eos_name = _config_token(folder, "bos_token"), _config_token(folder, "eos_token")
    bos = backend.token_to_id(bos_name) if bos_name else None
    if eos_name:
        return bos, backend.token_to_id(eos_name)
    eos = next((backend.token_to_id(t) for t in EOS_NAMES if backend.token_to_id(t) is not None), None)
    return bos, eos


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, and an end-of-document token 256."""

    vocab_size = 257
    eos = 256
    bos = None
    name = "bytes"
    chat_template = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def wrap(self) -> tuple[list[int], list[int]]:
        return [], []

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    @cached_property
    def fingerprint(self) -> int:
        vocab = {f"<0x{i:02X}>": i for i in range(256)} | {"<eos>": 256}
        return fingerprint_of(vocab, [(256, "<eos>", True)], None, self.eos)


class _Wrapping:
    """``wrap`` from the tokenizer's own ``encode(text, add_special_tokens=True)``."""

    name: str

    def encode(self, text: str) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError

    def encode_special(self, text: str) -> list[int]:  # pragma: no cover - overridden
        raise NotImplementedError

    def wrap(self) -> tuple[list[int], list[int]]:
        """(prefix, suffix): the special tokens the post-processor adds around any text."""
        if not hasattr(self, "_wrap"):
            found = set()
            for probe in ("a", "Hello world. 12"):
                plain, full = self.encode(probe).tolist(), list(self.encode_special(probe))
                at = next((k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain), None)
                if at is None or not plain:
                    raise RuntimeError(
                        f"the post-processor of tokenizer {self.name} does not wrap a text as prefix + text + "
                        f"suffix; loongtrain cannot add its special tokens"
                    )
                found.add((tuple(full[:at]), tuple(full[at + len(plain) :])))
            if len(found) != 1:
                raise RuntimeError(f"the special tokens of tokenizer {self.name} depend on the text: {sorted(found)}")
            prefix, suffix = found.pop()
            self._wrap = (list(prefix), list(suffix))
        return self._wrap


class TokenizerJson(_Wrapping):
    """A ``tokenizer.json`` file (Hugging Face ``tokenizers`` format); BOS/EOS as the config
    files next to it name them (else the EOS is guessed from common names)."""

    chat_template = None

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise RuntimeError(f"reading {path!r} needs the `tokenizers` package (pip install tokenizers)") from e
        self.name = path
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos, self.eos = _json_bos_eos(self._tok, Path(path).parent)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_special(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    @cached_property
    def fingerprint(self) -> int:
        return fingerprint_of(*_backend_parts(self._tok), self.bos, self.eos)


class HFTokenizer(_Wrapping):
    """A tokenizer from a local Hugging Face folder or cached name (no download); renders
    chat conversations with its own chat template."""

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
            message = str(e).replace("\n", " ")
            raise RuntimeError(
                f"could not load a local Hugging Face tokenizer from {name_or_path!r} (no download is attempted): "
                f"{message}"
            ) from e
        self.name = name_or_path
        self.vocab_size = len(self._tok)
        self.bos, self.eos = self._tok.bos_token_id, self._tok.eos_token_id
        self._backend = getattr(self._tok, "backend_tokenizer", None) if self._tok.is_fast else None
        self.chat_template: str | None = getattr(self._tok, "chat_template", None) or None
        self.generation_marks = bool(self.chat_template and _GENERATION_TAG.search(self.chat_template))

    def encode(self, text: str) -> np.ndarray:
        if self._backend is not None:
            return np.asarray(self._backend.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.int64)

    def encode_special(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Ids (no special tokens added) and their character spans [n, 2] in ``text``."""
        if self._backend is None:
            raise RuntimeError(f"tokenizer {self.name} is not a fast tokenizer: no character offsets for chat masks")
        enc = self._backend.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as the chat template writes it (text, nothing tokenized)."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def chat_with_generation_mask(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """Ids and the template's ``{% generation %}`` mask (templates that mark assistant output)."""
        out = self._tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return np.asarray(out["input_ids"], dtype=np.int64), np.asarray(out["assistant_masks"], dtype=bool)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    @cached_property
    def fingerprint(self) -> int:
        if self._backend is not None:
            vocab, added = _backend_parts(self._backend)
        else:
            vocab = self._tok.get_vocab()
            added = [(i, t.content, bool(t.special)) for i, t in self._tok.added_tokens_decoder.items()]
        return fingerprint_of(vocab, added, self.bos, self.eos)


Tokenizer = ByteTokenizer | TokenizerJson | HFTokenizer


def make_tokenizer(name: str | None) -> Tokenizer:
    """``None`` or ``"bytes"``: the byte tokenizer; a ``.json`` file: ``tokenizers``; else a
    local Hugging Face tokenizer folder or cached name (``transformers``)."""
    if name in (None, "", "bytes"):
        return ByteTokenizer()
    if Path(name).is_file() and name.endswith(".json"):
        return TokenizerJson(name)
    return HFTokenizer(name)


@dataclass(frozen=True)
class TokenizerIdentity:
    """What a token file records of its tokenizer, and what a check compares."""

    fingerprint: int
    vocab_size: int
    eos: int | None

    def describe(self) -> str:
        eos = "none" if self.eos is None else self.eos
        return f"fingerprint {self.fingerprint:016x}, vocabulary {self.vocab_size}, eos {eos}"


def tokenizer_identity(tokenizer: Any) -> TokenizerIdentity:
    """Fingerprint, vocabulary size and EOS of a tokenizer: one of this module's, a
    ``tokenizers.Tokenizer`` (no BOS/EOS known), or a ``transformers`` tokenizer."""
    if isinstance(tokenizer, ByteTokenizer | TokenizerJson | HFTokenizer):
        return TokenizerIdentity(tokenizer.fingerprint, tokenizer.vocab_size, tokenizer.eos)
    if hasattr(tokenizer, "get_added_tokens_decoder"):  # tokenizers.Tokenizer
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        return TokenizerIdentity(fingerprint_of(*_backend_parts(tokenizer), None, None), size, None)
    if hasattr(tokenizer, "added_tokens_decoder"):  # a transformers tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if backend is not None:
            vocab, added = _backend_parts(backend)
        else:
            vocab = tokenizer.get_vocab()
            added = [(i, t.content, bool(t.special)) for i, t in tokenizer.added_tokens_decoder.items()]
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        return TokenizerIdentity(fingerprint_of(vocab, added, bos, eos), len(tokenizer), eos)
    raise TypeError(f"cannot fingerprint a {type(tokenizer).__name__}")


def tokenizer_fingerprint(tokenizer: Any) -> int:
    """The 64-bit fingerprint of a tokenizer object (see :func:`tokenizer_identity`)."""
    return tokenizer_identity(tokenizer).fingerprint


def folder_tokenizer_identity(source: str | Path) -> TokenizerIdentity:
    """Identity of the tokenizer of a Hugging Face model folder (or a ``tokenizer.json`` file;
    ``"bytes"``: the byte tokenizer) without loading a model: a ``tokenizer.json`` is read with
    ``tokenizers`` alone (BOS/EOS from the folder's config files), other tokenizer files
    through ``transformers``. Its fingerprint equals the one ``prepare --tokenizer`` records."""
    if str(source) in ("", "bytes"):
        return tokenizer_identity(ByteTokenizer())
    path = Path(source)
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.is_file() and file.suffix == ".json":
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return tokenizer_identity(HFTokenizer(str(path)))
        backend = Tokenizer.from_file(str(file))
        bos, eos = _json_bos_eos(backend, file.parent)
        size = backend.get_vocab_size(with_added_tokens=True)
        return TokenizerIdentity(fingerprint_of(*_backend_parts(backend), bos, eos), size, eos)
    return tokenizer_identity(HFTokenizer(str(path)))


def folder_tokenizer_fingerprint(source: str | Path) -> int:
    """The fingerprint of a model folder's tokenizer (see :func:`folder_tokenizer_identity`)."""
    return folder_tokenizer_identity(source).fingerprint


def check_same_tokenizer(token_file, tokenizer_source) -> None:
    """Raise :class:`~loongtrain.data.tokens.TokenFileError` unless ``token_file`` (a
    :class:`~loongtrain.data.tokens.TokenFile` or its path) was made with the tokenizer of
    ``tokenizer_source``: a Hugging Face model or tokenizer folder, a ``tokenizer.json``,
    ``"bytes"``, or a tokenizer object. The message names both tokenizers (fingerprint,
    vocabulary, EOS). A file that records no fingerprint (format version 1) cannot be
    checked and passes: ``TokenFile.tokenizer_fingerprint is None`` tells the caller so."""
    from loongtrain.data.tokens import TokenFile, TokenFileError

    file = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
    if file.tokenizer_fingerprint is None:
        return
    if isinstance(tokenizer_source, str | Path):
        name = str(tokenizer_source)
        try:
            theirs = folder_tokenizer_identity(tokenizer_source)
        except (OSError, RuntimeError, ValueError) as e:
            raise TokenFileError(f"cannot read the tokenizer of {name} to check {file.path} against it: {e}") from e
    else:
        name = getattr(tokenizer_source, "name", None) or getattr(tokenizer_source, "name_or_path", None)
        name = str(name or type(tokenizer_source).__name__)
        theirs = tokenizer_identity(tokenizer_source)
    if theirs.fingerprint != file.tokenizer_fingerprint:
        ours = TokenizerIdentity(file.tokenizer_fingerprint, file.vocab_size, file.eos)
        raise TokenFileError(
            f"{file.path} was made with another tokenizer than {name}: the file's has {ours.describe()}, "
            f"{name}'s has {theirs.describe()}; re-create the file with `loongtrain prepare --tokenizer {name}`"
        )
