"""Load a local Hugging Face folder into a loongtrain model, sharded or not.

How: a sharded safetensors read. Every rank works out which global rows of each
parameter its FSDP2 shard holds (``local_part`` of a row index, the same rule that
``materialize`` uses), maps them to the checkpoint's rows (the RoPE row order of q/k,
see :mod:`loongtrain.hf.weights`), and reads just that block from the memory-mapped
``*.safetensors`` file (``safe_open(...).get_slice``), converting the dtype on copy. No
rank holds more than its shard plus at most one head of rows, and loading needs no
communication at all.

Why not ``torch.distributed.checkpoint`` with torch's ``HuggingFaceStorageReader``: it
reads by tensor offsets, and the q/k row reordering moves rows across FSDP shard
boundaries, so it would load the unpermuted rows and then need a redistribution between
ranks; its load planning is also collective. The direct read is simpler, needs no process
group, and every check runs on the file headers before anything is read.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from loongtrain.apply.init import local_part
from loongtrain.hf.families import load_hf_config, model_config_from_hf
from loongtrain.hf.folder import (
    COMPANION_FILES,
    CONFIG_FILE,
    FLOAT_DTYPES,
    HFFormatError,
    TensorEntry,
    read_config,
    read_tensor_table,
)
from loongtrain.hf.weights import IGNORED_SUFFIXES, expected_shapes, parameter_map, rope_row_order
from loongtrain.model.config import ModelConfig


def declared_dtype(raw_config: dict) -> str | None:
    """The weights' dtype that config.json declares (``dtype`` or the older ``torch_dtype``)."""
    value = raw_config.get("dtype", raw_config.get("torch_dtype"))
    return value if isinstance(value, str) and value != "auto" else None


def check_tensors(folder: str | Path, table: dict[str, TensorEntry], cfg: ModelConfig, dtype: str | None) -> None:
    """Raise HFFormatError unless ``table`` holds exactly the tensors ``cfg`` needs, with
    their shapes, in one floating dtype (``dtype`` when config.json declares one)."""
    expected = expected_shapes(cfg)
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()  # some tied checkpoints still store it
    missing = sorted(set(expected) - set(table))
    if missing:
        raise HFFormatError(
            f"{folder}: {len(missing)} tensor(s) that config.json implies are missing from the safetensors files, "
            f"e.g. {missing[:4]}; the folder is incomplete or does not match its config.json"
        )
    extra = sorted(n for n in set(table) - set(expected) - optional if not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise HFFormatError(
            f"{folder}: the safetensors files hold {len(extra)} tensor(s) the config.json model does not have, "
            f"e.g. {extra[:4]}; config.json does not describe these weights"
        )
    for name, shape in expected.items():
        entry = table[name]
        if entry.shape != shape:
            raise HFFormatError(
                f"{folder}: tensor {name!r} in {entry.file.name} has shape {list(entry.shape)} but config.json "
                f"implies {list(shape)}; the weights do not match the config"
            )
        if entry.dtype not in FLOAT_DTYPES:
            raise HFFormatError(
                f"{folder}: tensor {name!r} has dtype {entry.dtype}; only unquantised float weights "
                f"({', '.join(FLOAT_DTYPES)}) can be loaded"
            )
        if dtype is not None and entry.dtype != dtype:
            raise HFFormatError(
                f"{folder}: tensor {name!r} in {entry.file.name} is {entry.dtype} but config.json declares dtype "
                f"{dtype!r}; fix config.json's dtype or re-save the model in one dtype"
            )


@dataclass(frozen=True)
class HFFolder:
    """A local Hugging Face folder, read and checked completely (no tensor data): its parsed
    ``config.json``, the loongtrain model it describes and its safetensors tensor table."""

    path: str
    raw_config: dict
    model: ModelConfig
    table: dict[str, TensorEntry]


@functools.lru_cache(maxsize=4)
def _read_folder(path: str, stamp: tuple) -> HFFolder:
    raw = read_config(path)
    cfg = model_config_from_hf(load_hf_config(path, raw))
    table = read_tensor_table(path)
    check_tensors(path, table, cfg, declared_dtype(raw))
    return HFFolder(path, raw, cfg, table)


def read_folder(folder: str | Path) -> HFFolder:
    """``folder`` read and checked once per process (again only if its files change); raises
    HFFormatError naming the file and the fix."""
    path = Path(folder)
    files = sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")) if path.is_dir() else []
    stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    return _read_folder(str(path), stamp)


def _read_rows(entry: TensorEntry, name: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (global indices) of tensor ``name``, read from its file alone."""
    from safetensors import safe_open

    with safe_open(str(entry.file), framework="pt") as f:
        if rows.numel() == 0:
            return torch.empty((0, *entry.shape[1:]), dtype=getattr(torch, entry.dtype))
        lo, hi = int(rows.min()), int(rows.max()) + 1
        block = f.get_slice(name)[lo:hi]
    return block if rows.numel() == hi - lo and bool((rows == torch.arange(lo, hi)).all()) else block[rows - lo]


#: rows read at a time by :func:`first_nonfinite_tensor` (bounds its memory for large matrices)
SCAN_ROWS = 4096


@torch.no_grad()
def first_nonfinite_tensor(folder: HFFolder) -> tuple[str, int] | None:
    """The first tensor (in file order) of ``folder``'s weights holding a NaN or an infinity, with
    how many such values it holds; None if every weight is finite. Reads each tensor once, a
    block of rows at a time from the memory-mapped files."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, entry in folder.table.items():
        if entry.dtype in FLOAT_DTYPES:
            by_file.setdefault(entry.file, []).append(name)
    for file in sorted(by_file):
        with safe_open(str(file), framework="pt") as f:
            for name in by_file[file]:
                rows = folder.table[name].shape[0] if folder.table[name].shape else 1
                tensor = f.get_slice(name)
                bad = 0
                for lo in range(0, rows, SCAN_ROWS):
                    block = tensor[lo : lo + SCAN_ROWS] if folder.table[name].shape else tensor[:]
                    bad += int((~torch.isfinite(block)).sum())
                if bad:
                    return name, bad
    return None


@torch.no_grad()
def load_weights(model: torch.nn.Module, folder: HFFolder) -> None:
    """Fill ``model`` (materialised, possibly FSDP-sharded) from the HF ``folder`` (from
    :func:`read_folder`, whose checks ran on the file headers before anything is read).

    Every rank reads only the rows of its own shards; no communication.
    """
    cfg: ModelConfig = model.config
    check_tensors(folder.path, folder.table, cfg, declared_dtype(folder.raw_config))
    table = folder.table
    mapping = parameter_map(cfg)
    for name, param in model.named_parameters():
        target_map = mapping[name]
        rows = local_part(torch.arange(param.shape[0]), param)
        if target_map.rope_heads:
            rows = rope_row_order(target_map.rope_heads, cfg.head_dim)[rows]
        data = _read_rows(table[target_map.hf_name], target_map.hf_name, rows)
        target = param.to_local() if isinstance(param, DTensor) else param
        target.copy_(data.to(device=target.device, dtype=target.dtype))


def keep_companion_files(folder: str | Path, dest: str | Path) -> None:
    """Copy config.json, the generation config and the tokenizer files of ``folder`` into
    ``dest`` (what ``loongtrain export`` writes back next to the trained weights)."""
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in (CONFIG_FILE, *COMPANION_FILES):
        src = Path(folder) / name
        if src.is_file():
            shutil.copy2(src, tmp / name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)
