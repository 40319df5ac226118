"""``loongtrain export <run> -o folder`` (or ``<run>/checkpoints/step-N``): a training
checkpoint as a Hugging Face folder that ``transformers`` loads with ``from_pretrained``
(no custom code). A run folder exports its newest intact checkpoint; every checkpoint is
verified against its ``checksums.json`` first, as a resume does, and a damaged one is
named and refused (a run folder falls back to an older one, saying so).

Written: ``config.json`` (the imported model's config with the trained shape and RoPE,
``max_position_embeddings`` = the context the model was trained at: the larger of the run's
``data.seq_len`` and the model's own, which with RoPE scaling is original x factor; a
change of family, such as a Llama trained with a sliding window written as Mistral, is
said on stderr), the weights as safetensors (one file,
or shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``), and the
generation config and tokenizer files the run imported with the model. One process; the
checkpoint is read one output shard at a time with ``torch.distributed.checkpoint``
(resharded from whatever layout trained it), so memory holds one shard, not the model.

Everything is written into a hidden sibling folder that is renamed to the target only
when complete; on any error it is removed, so no partial output folder is left. A
checkpoint holding a NaN or an infinity is refused, naming the tensor (``--allow-nonfinite``
writes it anyway, for debugging).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tomllib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from loongtrain.hf.families import export_family, hf_config_dict, require_transformers
from loongtrain.hf.folder import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, HFFormatError
from loongtrain.hf.weights import parameter_map, to_hf_tensor
from loongtrain.model.config import ModelConfig, config_of_shape
from loongtrain.train.checkpoint import (
    CHECKSUM_FILE,
    STATE_FILE,
    CheckpointManager,
    checkpoint_problem,
)
from loongtrain.train.model_setup import SOURCE_DIR

MODEL_PREFIX = "model."  # the checkpoint holds {"model": ..., "optim": ...}
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _say(message: str) -> None:
    """One line on stderr."""
    print(f"loongtrain export: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    files: list[str]
    tensors: int
    dtype: str
    checkpoint: Path  # the checkpoint folder that was exported


def model_config_of_checkpoint(step_dir: Path) -> ModelConfig:
    """The ``ModelConfig`` a checkpoint was trained with (its ``model_shape``)."""
    try:
        shape = json.loads((step_dir / STATE_FILE).read_text())["model_shape"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise HFFormatError(
            f"{step_dir} is not a complete loongtrain checkpoint ({STATE_FILE} with model_shape: {e}); pass "
            "<run>/checkpoints/step-N"
        ) from None
    return config_of_shape(shape)


def _run_seq_len(run_dir: Path) -> int:
    try:
        return int(tomllib.loads((run_dir / "config.toml").read_text())["data"]["seq_len"])
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError):
        return 0


def _shards(names: list[str], nbytes: dict[str, int], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        if groups[-1] and size + nbytes[name] > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes[name]
    return groups


def _checkpoint_tensors(step_dir: Path) -> dict:
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    return {k[len(MODEL_PREFIX) :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(MODEL_PREFIX)}


def _load_checkpoint_tensors(step_dir: Path, state: dict[str, torch.Tensor]) -> None:
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=str(step_dir), no_dist=True)
    except (CheckpointException, OSError, RuntimeError, EOFError) as e:
        detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise HFFormatError(
            f"{step_dir}: reading the checkpoint's weights failed ({detail}); the checkpoint is damaged or "
            "incomplete, export another step-N"
        ) from None


def resolve_checkpoint(path: str | Path, say: Callable[[str], None] = _say) -> Path:
    """The verified checkpoint to export: ``path`` itself when it is a checkpoint folder
    (``step-N``), or the newest intact ``checkpoints/step-N`` of the run folder ``path``
    (``say`` tells of each damaged newer one). Raises HFFormatError naming the damaged file."""
    path = Path(path)
    if not path.is_dir():
        raise HFFormatError(
            f"checkpoint folder {str(path)!r} does not exist; pass <run>/checkpoints/step-N (or the run folder)"
        )
    if not (path / "checkpoints").is_dir():  # a checkpoint folder
        if not (path / STATE_FILE).is_file() and not (path / CHECKSUM_FILE).is_file():
            raise HFFormatError(
                f"{path} is neither a run folder (with checkpoints/) nor a checkpoint folder (<run>/checkpoints/step-N "
                f"with {STATE_FILE}); pass one of them"
            )
        trouble = checkpoint_problem(path)
        if trouble is not None:
            raise HFFormatError(
                f"checkpoint {path} is damaged: {trouble}; export another checkpoint, or the run folder (its newest "
                "intact one)"
            )
        return path
    steps = CheckpointManager(path / "checkpoints", keep=1).steps()
    if not steps:
        raise HFFormatError(
            f"run folder {path} has no checkpoint in checkpoints/ (a run saves one at its end with "
            "checkpoint.save_final = true, and every checkpoint.every steps)"
        )
    damaged = []
    for _, step_dir in reversed(steps):
        trouble = checkpoint_problem(step_dir)
        if trouble is None:
            return step_dir
        damaged.append(f"{step_dir.name}: {trouble}")
        say(f"checkpoint {step_dir} is damaged ({trouble}); trying an older one")
    raise HFFormatError(f"every checkpoint of {path} is damaged ({'; '.join(damaged)}); nothing to export")


def _nonfinite_values(tensor: torch.Tensor) -> int:
    """How many of ``tensor``'s values are NaN or infinite."""
    return 0 if bool(torch.isfinite(tensor).all()) else int((~torch.isfinite(tensor)).sum())


def export_checkpoint(
    step_dir: str | Path,
    out: str | Path,
    dtype: str = "source",
    max_shard_bytes: int = 5 * 2**30,
    say: Callable[[str], None] = _say,
    allow_nonfinite: bool = False,
) -> ExportResult:
    """Write the checkpoint ``step_dir`` (or the newest intact one of a run folder) as a
    Hugging Face folder ``out`` (must not exist); ``say`` prints one-line notices.

    ``dtype``: ``source`` (the imported model's dtype; float32 for a run that did not
    import one), ``float32``, ``bfloat16`` or ``float16``. A checkpoint holding a NaN or an
    infinity is refused naming the tensor (nothing is written), unless ``allow_nonfinite``
    (for debugging: written, each such tensor named by ``say``).
    """
    out = Path(out)
    if out.exists():
        raise HFFormatError(f"export target {str(out)!r} already exists; choose a new folder (nothing was written)")
    step_dir = resolve_checkpoint(step_dir, say)
    cfg = model_config_of_checkpoint(step_dir)
    source_dir = step_dir.parent.parent / SOURCE_DIR
    source = json.loads((source_dir / CONFIG_FILE).read_text()) if (source_dir / CONFIG_FILE).is_file() else None
    if dtype == "source":
        declared = (source or {}).get("dtype", (source or {}).get("torch_dtype"))
        dtype = declared if declared in EXPORT_DTYPES else "float32"
    if dtype not in EXPORT_DTYPES:
        raise HFFormatError(f"export dtype {dtype!r}; choose one of {['source', *EXPORT_DTYPES]}")
    max_positions = max(cfg.max_positions, _run_seq_len(step_dir.parent.parent)) or 2048  # the trained context
    config = hf_config_dict(cfg, source, dtype, max_positions)
    if source is not None:
        _, why = export_family(cfg, source["model_type"])
        if why is not None:
            say(f'writing "model_type": "{config["model_type"]}" (the source is "{source["model_type"]}"): {why}')

    mapping = parameter_map(cfg)
    saved = _checkpoint_tensors(step_dir)
    missing = sorted(set(mapping) - set(saved))
    if missing:
        raise HFFormatError(f"{step_dir}: the checkpoint lacks model tensors {missing[:4]} of its model_shape")
    torch_dtype = EXPORT_DTYPES[dtype]
    names = list(mapping)
    nbytes = {n: saved[n].size.numel() * torch_dtype.itemsize for n in names}
    groups = _shards(names, nbytes, max_shard_bytes)
    files = [SINGLE_FILE] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))
    ]  # fmt: skip

    transformers = require_transformers()
    from safetensors.torch import save_file

    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        hf_config = transformers.AutoConfig.for_model(**config)
        hf_config.save_pretrained(tmp)
        weight_map = {}
        for file, group in zip(files, groups):
            state = {n: torch.empty(saved[n].size, dtype=saved[n].properties.dtype) for n in group}
            _load_checkpoint_tensors(step_dir, state)
            tensors = {}
            for name in group:
                tensor = state.pop(name)
                bad = _nonfinite_values(tensor)
                if bad:
                    found = f"checkpoint {step_dir} holds {bad} non-finite value(s) (NaN or infinity) in {name}"
                    if not allow_nonfinite:
                        raise HFFormatError(
                            f"{found}: every output of the exported model would be NaN; export an older checkpoint "
                            "(<run>/checkpoints/step-N), or pass --allow-nonfinite to write it anyway for debugging"
                        )
                    say(f"{found}; written anyway (--allow-nonfinite)")
                target = mapping[name]
                tensors[target.hf_name] = to_hf_tensor(cfg, target, tensor).to(torch_dtype).contiguous()
                weight_map[target.hf_name] = file
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if source_dir.is_dir():
            for path in sorted(source_dir.iterdir()):
                if path.is_file() and path.name != CONFIG_FILE:
                    shutil.copy2(path, tmp / path.name)
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(folder=out, files=files, tensors=len(names), dtype=dtype, checkpoint=step_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="a run folder (its newest intact checkpoint) or a checkpoint folder <run>/checkpoints/step-N"
    )
    parser.add_argument("-o", "--output", required=True, help="Hugging Face folder to write (must not exist)")
    parser.add_argument(
        "--dtype", default="source", choices=["source", *EXPORT_DTYPES],
        help="weights' dtype (source: the imported model's, else float32)",
    )  # fmt: skip
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    parser.add_argument(
        "--allow-nonfinite", action="store_true",
        help="write a checkpoint that holds NaN or infinite weights anyway (for debugging; refused otherwise)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> None:
    try:
        result = export_checkpoint(
            args.checkpoint, args.output, args.dtype, int(args.max_shard_gb * 2**30), _say, args.allow_nonfinite
        )
    except (HFFormatError, OSError) as e:
        print(f"loongtrain export: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(
        f"wrote {result.tensors} tensors ({result.dtype}) of {result.checkpoint} in {len(result.files)} file(s) to "
        f"{result.folder}; "
        "load it with transformers.AutoModelForCausalLM.from_pretrained"
    )
