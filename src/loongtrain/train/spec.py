"""A training config turned into what a run is built from, for one world size: the parallel
layout, the model, the memory options, the compute dtype and the data source (made once per
process, here; a token file's source travels to the workers as its path and its index, not
its tokens). :func:`~loongtrain.train.preflight.preflight` makes it and checks it before any
process starts; :func:`~loongtrain.train.trainer.build_run` builds the run from it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from loongtrain.config import ConfigError, OptimSection, TrainConfig
from loongtrain.data import (
    LengthGroupedSource,
    MixtureSource,
    PackedRecallTask,
    RecallTask,
    TokenFile,
    TokenFileError,
    TokenFileSource,
)
from loongtrain.data.mixture import check_same_tokenizers, token_source
from loongtrain.model import ModelConfig
from loongtrain.options import Float8Options, MemoryOptions
from loongtrain.parallel import ParallelConfig
from loongtrain.train.model_setup import model_config_for

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Source = RecallTask | PackedRecallTask | TokenFileSource | LengthGroupedSource | MixtureSource


@dataclass(frozen=True)
class RunSpec:
    """What a config resolves to for one world size: what ``build_run`` builds the parallel
    model and its data from (the config's other sections are read as they are)."""

    parallel: ParallelConfig
    model: ModelConfig
    memory: MemoryOptions
    param_dtype: torch.dtype  # compute dtype of the parameters (fp32 master copy kept)
    init_from: str  # a Hugging Face folder the weights come from, or "" (random initial weights)
    source: Source | None  # the training data (None: a model evaluated, not trained)
    notices: tuple[str, ...] = ()  # one-line notices for the user (printed once by the launcher)
    float8: Float8Options = Float8Options()  # FP8 training of the blocks' linears ([float8]; off by default)

    @property
    def task(self) -> RecallTask | PackedRecallTask | None:
        """The synthetic task trained on, or None for a token file."""
        return self.source if isinstance(self.source, RecallTask | PackedRecallTask) else None


def model_spec(cfg: TrainConfig, source: Source | None = None) -> RunSpec:
    """The layout, model, memory options and dtype of ``cfg``, with ``source`` as its data;
    raises ValueError naming the problem (e.g. an unreadable model folder). The layout is
    checked against a world size where one is known (``ParallelConfig.resolve_dp``)."""
    return RunSpec(
        parallel=cfg.parallel.config(), model=model_config_for(cfg.model), memory=cfg.memory.options(),
        param_dtype=PARAM_DTYPES[cfg.parallel.param_dtype], init_from=cfg.model.init_from, source=source,
        float8=cfg.float8.options(),
    )  # fmt: skip


def make_source(cfg: TrainConfig) -> Source:
    """The configured data source (a token file is memory-mapped; its sequences are indexed
    once, here): the recall task, one token file (``data.path``) or a
    :class:`~loongtrain.data.mixture.MixtureSource` of the ``[data.sources.NAME]`` tables.
    Every source's sample ``i`` is ``source.sample(i)``; the loader draws step ``s`` from
    samples ``s * data.global_batch`` onwards."""
    d = cfg.data
    if d.source == "recall":
        recall = dict(
            seq_len=d.seq_len, keys=d.recall_keys, values=d.recall_values, facts=d.recall_facts,
            queries=d.recall_queries, filler=d.recall_filler, seed=d.seed,
        )  # fmt: skip
        return PackedRecallTask(doc_len=d.doc_len, **recall) if d.pack else RecallTask(**recall)
    if d.sources:
        return make_mixture(cfg)
    file = TokenFile(d.path)
    eos = d.eos_id if d.eos_id >= 0 else None  # None: the file's (documents come from its flags when it has them)
    missing = missing_boundaries(file, eos, "data.pack=true" if d.pack else "")
    if missing:
        raise ConfigError(missing)
    source = TokenFileSource(file, d.seq_len, d.seed, eos=eos, pack=d.pack, long_documents=d.long_documents)
    return LengthGroupedSource(source, d.group_by_length, d.global_batch) if d.group_by_length else source


def missing_boundaries(file: TokenFile, eos: int | None, needs: str) -> str | None:
    """Why ``needs`` (a setting that cuts at document boundaries; "" for none) cannot run on
    ``file``, which records no boundaries and is given no ``eos``; None when it can."""
    if not needs or file.flags is not None or eos is not None or file.eos is not None:
        return None
    return (
        f"{needs} needs document boundaries, but {file.path} has no per-token flags and records no end-of-document "
        f"token (written before loongtrain recorded them, or by a tokenizer without one); set data.eos_id or "
        f"re-create it with `loongtrain prepare`"
    )


def open_source_file(name: str, path: str) -> TokenFile:
    """Source ``name``'s token file, memory-mapped; a missing, unreadable or malformed file is
    one TokenFileError line naming the source."""
    try:
        return TokenFile(path)
    except TokenFileError as e:
        raise TokenFileError(f"data.sources.{name}.path: {e}") from None
    except OSError as e:
        raise TokenFileError(
            f"data.sources.{name}.path={path!r} cannot be read ({e.strerror or e}); fix the path or the file's "
            f"permissions"
        ) from None


def make_mixture(cfg: TrainConfig) -> MixtureSource:
    """The mixture of the ``[data.sources.NAME]`` tables: every file opened and checked (one
    tokenizer for all, document boundaries where packing, dropping or upsampling needs them,
    enough tokens for a sequence and a held-out one, upsampling targets a file can give);
    each source's order of sequences seeded by ``data.seed`` and its name."""
    d = cfg.data
    eos = d.eos_id if d.eos_id >= 0 else None
    files = {name: open_source_file(name, s.path) for name, s in d.sources.items()}
    check_same_tokenizers(files)
    parts = {}
    for name, s in d.sources.items():
        file, policy = files[name], s.long_documents or d.long_documents
        missing = missing_boundaries(
            file, eos, "data.pack=true" if d.pack else "long_documents='drop'" if policy == "drop" else ""
        )  # fmt: skip
        if missing:
            raise TokenFileError(f"data.sources.{name}: {missing}")
        try:
            parts[name] = token_source(
                file, d.seq_len, name=name, seed=d.seed, eos=eos, pack=d.pack, long_documents=policy,
                upsample_length=s.upsample_length, upsample_share=s.upsample_share,
            )  # fmt: skip
        except TokenFileError as e:
            text = str(e)
            raise TokenFileError(text if text.startswith("data.sources.") else f"data.sources.{name}: {text}") from None
    return MixtureSource(parts, {name: s.weight for name, s in d.sources.items()})


def source_fingerprint(source: object) -> str | None:
    """The fingerprint of what decides a source's samples (token files, mixture, seq_len, seed,
    a synthetic task's settings), which a checkpoint records; None for a source without one."""
    fingerprint = getattr(source, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else None


def source_identity(source: object) -> dict | None:
    """What :func:`source_fingerprint` digests, as a dict (a checkpoint records it, so a resume
    on changed data names what changed); None for a source without one."""
    identity = getattr(source, "identity", None)
    return identity() if callable(identity) else None


def model_shape(mcfg: ModelConfig) -> dict:
    """The model's shape as a checkpoint records it (``trainer_state["model_shape"]``)."""
    return json.loads(json.dumps(dataclasses.asdict(mcfg)))  # as JSON reads it back (layer kinds: lists)


#: devices whose parameters AdamW updates with its fused kernel (one launch per parameter group
#: and dtype instead of foreach's several per step of the update): the GPU path; elsewhere
#: (CPU, parameters offloaded to the host) PyTorch's default
FUSED_ADAMW_DEVICES = ("cuda",)


def fused_adamw(device_types: set[str]) -> bool | None:
    """``fused`` for AdamW over parameters on ``device_types``: True where every one is a
    :data:`FUSED_ADAMW_DEVICES` device, else None (PyTorch's default: foreach)."""
    return True if device_types and device_types <= set(FUSED_ADAMW_DEVICES) else None


def build_optimizer(params, o: OptimSection) -> torch.optim.AdamW:
    """AdamW with the ``[optim]`` values; fused on a GPU (as torchtitan runs it)."""
    params = list(params)
    fused = fused_adamw({p.device.type for p in params if isinstance(p, torch.Tensor)})
    return torch.optim.AdamW(
        params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=fused
    )
