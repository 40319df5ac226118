"""Inputs of `loongtrain prepare`: finding them, and cutting them into tasks for the workers.

Text files (one document each), JSONL (one JSON object per line), Parquet (read in record
batches with ``pyarrow``) and folders written by Hugging Face ``datasets.save_to_disk``. The
main process only reads bytes and rows and resolves each file's field; the workers decode,
parse, validate and tokenize. Tasks are small (about a MiB), so memory stays bounded
whatever the input size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loongtrain.data.encode import (
    Field,
    PrepareError,
    json_kind,
    no_chat_template,
    parse_json_line,
    resolve_field,
    type_name,
)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".tex")
TASK_BYTES = 1 << 20  # input bytes per task (JSONL lines, rows)
TASK_RECORDS = 4096  # at most this many records per task
TEXT_PIECE = 4 << 20  # a text file is tokenized in pieces of 4-8 MiB (files up to 8 MiB whole)
TEXT_PIECE_MAX = 64 << 20  # a piece with no clean line break is cut here anyway
_SPACE = frozenset(b" \t\r\n\x0b\x0c")


@dataclass(frozen=True)
class Input:
    path: Path
    kind: str  # text, jsonl, parquet, dataset
    size: int  # bytes on disk (progress)

    @property
    def label(self) -> str:
        return str(self.path)


def is_dataset_folder(path: Path) -> bool:
    """A folder written by ``datasets`` ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def discover(inputs: list[str]) -> list[Input]:
    """Every input, in a deterministic order: named files as they are (``.jsonl``, ``.parquet``,
    else text), datasets folders, and folders searched recursively for those and text files."""
    found: list[Input] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and is_dataset_folder(path):
            found.append(Input(path, "dataset", _folder_size(path)))
        elif path.is_dir():
            inside = []
            for root, dirs, files in os.walk(path):
                here = Path(root)
                for d in list(dirs):
                    if is_dataset_folder(here / d):
                        inside.append(Input(here / d, "dataset", _folder_size(here / d)))
                        dirs.remove(d)
                for name in files:
                    p = here / name
                    if p.suffix.lower() in TEXT_SUFFIXES + (".jsonl", ".parquet") and p.is_file():
                        inside.append(Input(p, _kind(p), p.stat().st_size))
            found += sorted(inside, key=lambda i: i.path)
        elif path.is_file():
            found.append(Input(path, _kind(path), path.stat().st_size))
        else:
            raise FileNotFoundError(f"input {item!r} is neither a file nor a folder")
    if not found:
        suffixes = ", ".join(TEXT_SUFFIXES)
        raise FileNotFoundError(f"no inputs (.jsonl, .parquet, datasets folders, text: {suffixes}) found in {inputs}")
    return found


@dataclass
class TextPiece:
    """Bytes of a text file starting at ``offset`` (on ``line``); ``first``/``last`` piece of it."""

    label: str
    offset: int
    line: int
    data: bytes
    first: bool
    last: bool

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass
class JsonLines:
    """Raw lines of a JSONL file, the first being ``line`` at byte ``offset``."""

    label: str
    field: Field
    line: int
    offset: int
    lines: list[bytes]

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.lines))


@dataclass
class Rows:
    """Column values of consecutive rows of a table, the first being ``row``."""

    label: str
    field: Field
    row: int
    columns: dict[str, list]
    nbytes: int


Task = TextPiece | JsonLines | Rows


def _clean_cut(buf: bytes) -> int | None:
    """Index just after the last line break of ``buf`` that has a non-space byte on both sides
    (so the tokenizer's pre-tokenizer splits there anyway), or None."""
    end = len(buf) - 1
    for window in (1 << 16, 1 << 20, len(buf)):
        i, lo = end, max(1, end - window)
        while True:
            i = buf.rfind(b"\n", lo, i)
            if i < 0:
                break
            if buf[i - 1] not in _SPACE and buf[i + 1] not in _SPACE:
                return i + 1
        if lo == 1:
            return None
    return None


def _forced_cut(buf: bytes) -> int:
    """A cut for a huge piece without a clean line break: after its last line break, else at
    its last UTF-8 character boundary."""
    i = buf.rfind(b"\n", 0, len(buf) - 1)
    if i >= 0:
        return i + 1
    i = len(buf) - 1
    while i > 0 and buf[i] & 0xC0 == 0x80:
        i -= 1
    return i


def text_tasks(item: Input) -> Iterator[TextPiece]:
    """A text file in pieces (see ``TEXT_PIECE``)."""
    with open(item.path, "rb") as f:
        pending, offset, line, first = b"", 0, 1, True
        while True:
            data = f.read(TEXT_PIECE)
            if not data:
                break
            pending += data
            while len(pending) >= 2 * TEXT_PIECE:
                cut = _clean_cut(pending)
                if cut is None:
                    if len(pending) < TEXT_PIECE_MAX:
                        break
                    cut = _forced_cut(pending)
                piece, pending = pending[:cut], pending[cut:]
                yield TextPiece(item.label, offset, line, piece, first, False)
                offset, line, first = offset + len(piece), line + piece.count(b"\n"), False
        if first and not pending:
            raise PrepareError(f"{item.label}: empty file")
        yield TextPiece(item.label, offset, line, pending, first, True)


def jsonl_tasks(item: Input, field_arg: str | None, errors: str, tokenizer) -> Iterator[JsonLines]:
    """A JSONL file in batches of lines; its field is resolved from its first record."""
    field = None
    with open(item.path, "rb") as f:
        batch, start_line, start_offset, size = [], 1, 0, 0
        line, offset = 0, 0
        for raw in f:
            line += 1
            if field is None:
                record = parse_json_line(raw, errors, item.label, offset, line)
                if record is not None:
                    where = f"{item.label} line {line}"
                    if not isinstance(record, dict):
                        raise PrepareError(f"{where}: the record is {type_name(record)}, not an object with fields")
                    field = resolve_field(field_arg, list(record), lambda n, r=record: json_kind(r[n]), where)
                    check_tokenizer(field, tokenizer, item.label)
            batch.append(raw)
            size += len(raw)
            offset += len(raw)
            if size >= TASK_BYTES or len(batch) >= TASK_RECORDS:
                if field is not None:
                    yield JsonLines(item.label, field, start_line, start_offset, batch)
                    batch, start_line, start_offset, size = [], line + 1, offset, 0
        if field is None:
            raise PrepareError(f"{item.label}: no records (the file is empty)")
        if batch:
            yield JsonLines(item.label, field, start_line, start_offset, batch)


def check_tokenizer(field: Field, tokenizer, label: str) -> None:
    """Chat records need a tokenizer with a chat template."""
    if field.kind == "messages" and not getattr(tokenizer, "chat_template", None):
        raise PrepareError(no_chat_template(tokenizer, label))


def _arrow_kind(arrow_type) -> str | None:
    import pyarrow as pa

    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "text"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return "messages"
    return None


def parquet_tasks(item: Input, field_arg: str | None, tokenizer) -> Iterator[Rows]:
    """A Parquet file in record batches of its field's columns."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{item.label}: reading Parquet needs the `pyarrow` package (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(item.path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
        raise PrepareError(f"{item.label}: not a readable Parquet file: {e}") from None
    schema = table.schema_arrow
    field = resolve_field(field_arg, schema.names, lambda n: _arrow_kind(schema.field(n).type), item.label)
    check_tokenizer(field, tokenizer, item.label)
    rows = table.metadata.num_rows
    if rows == 0:
        raise PrepareError(f"{item.label}: no rows (the table is empty)")
    row = 0
    batch_rows = max(1, min(TASK_RECORDS, int(rows * TASK_BYTES / max(item.size, 1))))
    for batch in table.iter_batches(batch_size=batch_rows, columns=list(dict.fromkeys(field.names))):
        n = batch.num_rows
        yield Rows(item.label, field, row, batch.to_pydict(), item.size * n // rows)
        row += n


def dataset_tasks(item: Input, field_arg: str | None, tokenizer) -> Iterator[Rows]:
    """A ``datasets`` ``save_to_disk`` folder (one Dataset; a DatasetDict names its splits)."""
    try:
        import datasets
    except ImportError:
        raise PrepareError(
            f"{item.label} is a Hugging Face datasets folder; reading it needs the `datasets` package "
            f"(pip install datasets)"
        ) from None
    if (item.path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in item.path.iterdir() if p.is_dir() and is_dataset_folder(p))
        raise PrepareError(
            f"{item.label} holds several splits ({', '.join(splits)}); pass one split's folder, e.g. "
            f"{item.path / (splits[0] if splits else 'train')}"
        )
    try:
        ds = datasets.load_from_disk(str(item.path))
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds
        raise PrepareError(f"{item.label}: not a readable datasets folder: {e}") from None
    rows = len(ds)
    if rows == 0:
        raise PrepareError(f"{item.label}: no rows (the dataset is empty)")
    first = ds[0]
    field = resolve_field(field_arg, list(ds.column_names), lambda n: json_kind(first[n]), item.label)
    check_tokenizer(field, tokenizer, item.label)
    batch_rows = max(1, min(TASK_RECORDS, int(rows * TASK_BYTES / max(item.size, 1))))
    row = 0
    for batch in ds.select_columns(list(dict.fromkeys(field.names))).iter(batch_size=batch_rows):
        n = len(batch[field.names[0]])
        yield Rows(item.label, field, row, batch, item.size * n // rows)
        row += n


def tasks(found: list[Input], field_arg: str | None, errors: str, tokenizer) -> Iterator[Task]:
    """The tasks of every input, in order."""
    for item in found:
        if item.kind == "text":
            if field_arg is not None:
                raise PrepareError(
                    f"{item.label}: a text file is one document with no fields; --field applies to "
                    f".jsonl, .parquet and datasets inputs"
                )
            yield from text_tasks(item)
        elif item.kind == "jsonl":
            yield from jsonl_tasks(item, field_arg, errors, tokenizer)
        elif item.kind == "parquet":
            yield from parquet_tasks(item, field_arg, tokenizer)
        else:
            yield from dataset_tasks(item, field_arg, tokenizer)
