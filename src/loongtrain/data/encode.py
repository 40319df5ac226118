"""Records -> documents of token ids with a loss-target mask, for `loongtrain prepare`.

A record is one document, taken from one field (or two):

- ``text``: a plain document. The tokenizer's own post-processor adds its special tokens
  (BOS, sometimes EOS); an EOS ends the document unless it already does. Every token is a
  target.
- ``messages``: a chat conversation ``[{"role": ..., "content": str}, ...]`` rendered by the
  tokenizer's chat template. Only the assistant turns are targets: each turn's content and
  its end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ...), not its role header nor the
  whitespace after the turn. A turn's span is found by rendering the conversation up to it
  twice, with and without the turn: the template itself says where the turn starts (its
  generation prompt) and ends. A template with ``{% generation %}`` marks says it directly.
  Every token that overlaps a span is a target.
- ``prompt`` + ``completion``: tokenized separately (the completion's tokens are those a
  model generates after the prompt's), wrapped by the post-processor, ended with EOS; the
  completion and what follows it are targets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from loongtrain.data.tokens import DOC_START, TARGET

ROLES = ("system", "user", "assistant", "tool")


class PrepareError(ValueError):
    """Bad input for `loongtrain prepare`; the message is one line naming the file and record."""


@dataclass(frozen=True)
class Field:
    """Where a record's document is: ``kind`` (text, messages, prompt) and its field names
    (one; two for prompt + completion)."""

    kind: str
    names: tuple[str, ...]


def type_name(value: Any) -> str:
    """``a string``, ``a list``, ... (JSON's names) for messages."""
    names = {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean"}
    names |= {int: "a number", float: "a number"}
    return names.get(type(value), f"a {type(value).__name__}")


def resolve_field(arg: str | None, keys: list[str], value_kind, where: str) -> Field:
    """The field of a file's records from ``--field`` (``None``: detect from ``keys``, the
    first record's fields or the table's columns). ``value_kind(name)`` says whether a field
    holds ``"text"`` or ``"messages"`` (None: neither) for a ``--field NAME`` of another name."""
    have = ", ".join(keys) if keys else "none"
    if arg is None:
        if "messages" in keys:
            return Field("messages", ("messages",))
        if "prompt" in keys and "completion" in keys:
            return Field("prompt", ("prompt", "completion"))
        if "text" in keys:
            return Field("text", ("text",))
        raise PrepareError(
            f"{where}: no 'text', 'messages' or 'prompt'+'completion' field (it has: {have}); name one with --field"
        )
    names = tuple(arg.split("+"))
    if len(names) > 2 or not all(names):
        raise PrepareError(f"--field {arg!r}: give one field name, or two joined by '+' (prompt+completion)")
    for name in names:
        if name not in keys:
            raise PrepareError(f"{where}: no field {name!r} (it has: {have})")
    if len(names) == 2:
        return Field("prompt", names)
    kind = value_kind(names[0])
    if kind is None:
        raise PrepareError(
            f"{where}: field {names[0]!r} holds neither text (a string) nor chat messages (a list); "
            f"choose another with --field"
        )
    return Field(kind, names)


def json_kind(value: Any) -> str | None:
    """Document kind of a JSON value (a string: text, a list: messages)."""
    return "text" if isinstance(value, str) else "messages" if isinstance(value, list) else None


def location(label: str, line: int | None = None, row: int | None = None) -> str:
    """``file line N`` (1-based lines) or ``file row N`` (0-based rows)."""
    return f"{label} line {line}" if line is not None else f"{label} row {row}" if row is not None else label


def decode(data: bytes, errors: str, label: str, offset: int, line: int) -> str:
    """``data`` (bytes at ``offset`` of ``label``, starting on ``line``) as text: refuses binary
    data (a NUL byte) and invalid UTF-8 unless ``errors == "replace"``."""
    if errors == "replace":
        return data.decode("utf-8", errors="replace")
    nul = data.find(b"\0")
    if nul >= 0:
        at = line + data.count(b"\n", 0, nul)
        raise PrepareError(
            f"{label}: binary data (a NUL byte at byte offset {offset + nul}, line {at}), not text; "
            f"--errors replace reads it anyway"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line + data.count(b"\n", 0, e.start)
        raise PrepareError(
            f"{label}: not UTF-8 at byte offset {offset + e.start} (line {at}): {e.reason}; "
            f"--errors replace decodes it with U+FFFD"
        ) from None


def parse_json_line(data: bytes, errors: str, label: str, offset: int, line: int) -> Any:
    """One JSONL line as a Python object (None for a blank line)."""
    text = decode(data, errors, label, offset, line)
    if line == 1:
        text = text.removeprefix("\ufeff")
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PrepareError(f"{label} line {line}: malformed JSON: {e.msg} at column {e.colno}") from None


def check_messages(messages: Any, name: str, where: str) -> list[dict]:
    """Validate a conversation; returns it."""
    if not isinstance(messages, list):
        raise PrepareError(f"{where}: field {name!r} is {type_name(messages)}, not a list of messages")
    if not messages:
        raise PrepareError(f"{where}: empty conversation (field {name!r} is [])")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PrepareError(f"{where}: {name}[{i}] is {type_name(m)}, not a message object")
        role = m.get("role")
        if role not in ROLES:
            got = "no role" if "role" not in m else f"role {role!r}"
            raise PrepareError(f"{where}: {name}[{i}] has {got}; expected one of {', '.join(ROLES)}")
        if "content" not in m:
            raise PrepareError(f"{where}: {name}[{i}] ({role}) has no 'content'")
        if not isinstance(m["content"], str):
            raise PrepareError(f"{where}: {name}[{i}] ({role}) content is {type_name(m['content'])}, not a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise PrepareError(f"{where}: the conversation has no assistant message (nothing to train on)")
    return messages


def _string(record: dict, name: str, where: str) -> str:
    if name not in record:
        raise PrepareError(f"{where}: no field {name!r} (it has: {', '.join(record) or 'none'})")
    value = record[name]
    if not isinstance(value, str):
        raise PrepareError(f"{where}: field {name!r} is {type_name(value)}, not a string")
    return value


class DocumentEncoder:
    """Turns text, prompt/completion pairs and chat conversations into ``(ids, targets)``
    with ``tokenizer`` (see the module docstring for the rules)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        prefix, suffix = tokenizer.wrap()
        self.prefix, self.suffix = np.asarray(prefix, dtype=np.int64), np.asarray(suffix, dtype=np.int64)
        self.eos = tokenizer.eos

    def _ended(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` ending with EOS (appended unless already there; not when there is none)."""
        if self.eos is None or (ids.size and ids[-1] == self.eos):
            return ids
        return np.append(ids, np.int64(self.eos))

    def text(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """A plain document: every token a target."""
        ids = self.text_piece(text, first=True, last=True)
        return ids, np.ones(ids.size, dtype=bool)

    def text_piece(self, text: str, first: bool, last: bool) -> np.ndarray:
        """Ids of one piece of a plain document (the first gets the prefix, the last the suffix and EOS)."""
        parts = [self.prefix] if first else []
        parts.append(self.tok.encode(text))
        if last:
            parts.append(self.suffix)
        ids = np.concatenate(parts)
        return self._ended(ids) if last else ids

    def prompt_completion(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        """Prompt then completion; the completion, the suffix and the EOS are targets."""
        head = np.concatenate([self.prefix, self.tok.encode(prompt)])
        ids = self._ended(np.concatenate([head, self.tok.encode(completion), self.suffix]))
        targets = np.zeros(ids.size, dtype=bool)
        targets[head.size :] = True
        return ids, targets

    def chat(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        """A conversation as the chat template renders it; the assistant turns are targets."""
        tok = self.tok
        if not getattr(tok, "chat_template", None):
            raise PrepareError(no_chat_template(tok, where))
        try:
            if tok.generation_marks:
                return tok.chat_with_generation_mask(messages)
            text = tok.render_chat(messages)
            spans = []
            for i, m in enumerate(messages):
                if m["role"] == "assistant":
                    spans.append(self._turn_span(messages, i, text, where))
        except PrepareError:
            raise
        except Exception as e:  # noqa: BLE001 - templates raise anything (raise_exception, jinja errors)
            message = str(e).replace("\n", " ")
            raise PrepareError(f"{where}: the chat template failed: {type(e).__name__}: {message}") from None
        ids, offsets = tok.encode_offsets(text)
        targets = np.zeros(ids.size, dtype=bool)
        for a, b in spans:  # every token that overlaps a span
            targets |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
        return ids, targets

    def _turn_span(self, messages: list[dict], i: int, text: str, where: str) -> tuple[int, int]:
        """Characters of assistant turn ``i`` in ``text``: from the end of its header (the
        template's generation prompt) to the end of the turn, without trailing whitespace."""
        if i == 0:
            raise PrepareError(
                f"{where}: the conversation starts with an assistant message; the chat template's turn header "
                f"cannot be located (start with a system or user message)"
            )
        before = self.tok.render_chat(messages[:i], add_generation_prompt=True)
        through = self.tok.render_chat(messages[: i + 1])
        if not (text.startswith(before) and text.startswith(through) and through.startswith(before)):
            raise PrepareError(
                f"{where}: the chat template renders messages[:{i}] differently alone than inside the whole "
                f"conversation, so assistant turn {i} cannot be located; mark assistant output in the template "
                f"with {{% generation %}}"
            )
        start = len(before)
        return start, start + len(through[start:].rstrip())

    def record(self, record: Any, field: Field, where: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The document of one record (None: an empty text, skipped and counted)."""
        if not isinstance(record, dict):
            raise PrepareError(f"{where}: the record is {type_name(record)}, not an object with fields")
        if field.kind == "text":
            text = _string(record, field.names[0], where)
            return self.text(text) if text else None
        if field.kind == "prompt":
            prompt, completion = (_string(record, name, where) for name in field.names)
            if not completion:
                raise PrepareError(f"{where}: empty completion (field {field.names[1]!r} is ''): nothing to train on")
            return self.prompt_completion(prompt, completion)
        name = field.names[0]
        if name not in record:
            raise PrepareError(f"{where}: no field {name!r} (it has: {', '.join(record) or 'none'})")
        return self.chat(check_messages(record[name], name, where), where)


def no_chat_template(tok, where: str) -> str:
    kind = "the byte tokenizer" if tok.name == "bytes" else f"tokenizer {tok.name}"
    hint = (
        "pass the tokenizer's folder, not its tokenizer.json"
        if str(tok.name).endswith(".json")
        else "use a Hugging Face tokenizer folder with chat_template in tokenizer_config.json or chat_template.jinja"
    )
    return f"{where}: chat messages need a chat template, and {kind} has none; {hint}"


def pack_documents(docs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents into ids (uint32) and flags (``TARGET`` | ``DOC_START``)."""
    docs = [(d, t) for d, t in docs if d.size]
    if not docs:
        return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.uint8)
    ids = np.concatenate([d for d, _ in docs]).astype(np.uint32)
    flags = np.concatenate([t for _, t in docs]).astype(np.uint8) * np.uint8(TARGET)
    starts = np.cumsum([0] + [d.size for d, _ in docs[:-1]])
    flags[starts] |= DOC_START
    return ids, flags
