"""A local Hugging Face model folder: ``config.json`` and the tensor table of its
``*.safetensors`` files (one file, or shards listed by ``model.safetensors.index.json``).

Only the file headers are read here (8-byte length + JSON), with no dependency, so a
folder can be checked completely, before any process group or training run exists.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from loongtrain.config import ConfigError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# files that travel with the model: generation defaults and the tokenizer
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
# safetensors dtype names -> torch dtype names
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


class HFFormatError(ConfigError):
    """A Hugging Face folder or export that cannot be used; the message says why and the fix."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file, shape and torch dtype name."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def read_config(folder: str | Path) -> dict:
    """The parsed ``config.json`` of ``folder``; raises HFFormatError naming what is wrong."""
    folder = Path(folder)
    if folder.is_file():
        raise HFFormatError(
            f"Hugging Face model folder {str(folder)!r} is a file, not a folder; give the folder that holds "
            f"config.json and the *.safetensors (e.g. {str(folder.parent)!r})"
        )
    if not folder.is_dir():
        raise HFFormatError(f"Hugging Face model folder {str(folder)!r} does not exist")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise HFFormatError(
            f"{str(folder)!r} has no config.json: point model.init_from at a folder written by "
            "transformers' save_pretrained (config.json + *.safetensors)"
        )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFFormatError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise HFFormatError(f"{path} must hold a JSON object")
    return config


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensor table of one safetensors file (its header only)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", raw)
            if length > path.stat().st_size - 8:
                raise ValueError(f"header length {length} exceeds the file size")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as e:
        raise HFFormatError(f"{path} is not a readable safetensors file: {e}") from None
    entries = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"), str(info.get("dtype")))
        entries[name] = TensorEntry(file=path, shape=tuple(info["shape"]), dtype=dtype)
        data_end = max(data_end, int(info.get("data_offsets", (0, 0))[1]))
    size, needed = path.stat().st_size, 8 + length + data_end
    if size < needed:
        raise HFFormatError(
            f"{path} is truncated: its header describes {needed} bytes but the file has {size} (an interrupted "
            "copy or download?); copy the file again"
        )
    return entries


def read_tensor_table(folder: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of the folder's safetensors weights, with its file, shape and dtype."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise HFFormatError(f"{index_path} is not a safetensors index (needs a 'weight_map'): {e}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise HFFormatError(
                f"{str(folder)!r}: shard file(s) {missing} listed in {INDEX_FILE} are missing; copy the complete "
                "model folder"
            )
        table: dict[str, TensorEntry] = {}
        for file in files:
            table.update(read_header(folder / file))
        for name, file in weight_map.items():
            entry = table.get(name)
            if entry is None or entry.file.name != Path(file).name:
                raise HFFormatError(f"{index_path}: tensor {name!r} is listed in {file} but that file does not hold it")
        return {name: table[name] for name in weight_map}
    if (folder / SINGLE_FILE).is_file():
        return read_header(folder / SINGLE_FILE)
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if len(found) == 1:
        return read_header(folder / found[0])
    if found:
        raise HFFormatError(f"{str(folder)!r} has several .safetensors files {found} but no {INDEX_FILE}")
    legacy = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {legacy}: re-save with save_pretrained, which writes safetensors)" if legacy else ""
    raise HFFormatError(f"{str(folder)!r} has no *.safetensors weights{hint}")
