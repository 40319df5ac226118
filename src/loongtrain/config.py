"""Training configuration: typed dataclass sections, a TOML file, ``--section.key value``
overrides, validation with clear errors, and a resolved copy saved in the run folder.

Every field carries a one-line help text (``loongtrain train --help-config`` prints them).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from loongtrain.options import (
    ACTIVATION_CHECKPOINT_MODES,
    BALANCES,
    CONTEXT_ORDERS,
    LAYOUT_MODES,
    LONG_DOCUMENTS,
    PLACEMENTS,
    ZERO_SCOPES,
    MemoryOptions,
)


def _f(default, help: str, choices: tuple | None = None):
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


@dataclass
class RunSection:
    output_dir: str = _f("runs/debug", "run folder: resolved config, metrics, plots and checkpoints go here")
    steps: int = _f(200, "optimizer steps to train (a resumed run continues up to this step)")
    seed: int = _f(0, "seed of the initial weights (data has its own seed)")
    log_every: int = _f(10, "print metrics every this many steps (every step goes to metrics.jsonl)")
    eval_every: int = _f(0, "evaluate on held-out batches every this many steps (0: only at the end)")
    eval_batches: int = _f(4, "held-out global batches per evaluation")
    device: str = _f("auto", "auto (cuda when available, else cpu), cpu or cuda", ("auto", "cpu", "cuda"))
    progress: str = _f("auto", "progress bar: auto (when stdout is a terminal), on or off", ("auto", "on", "off"))
    tensorboard: bool = _f(True, "also write TensorBoard logs when the tensorboard package is installed")
    peak_tflops: float = _f(0.0, "peak dense TFLOP/s per device for MFU; 0 looks the GPU up in a table")
    compile: bool = _f(
        False,
        "torch.compile each transformer block (the distributed attention stays opaque); the first steps "
        "take longer while it compiles (raise run.timeout_s if that exceeds it)",
    )
    timeout_s: float = _f(
        300.0,
        "a rank that makes no progress for this many seconds ends the job with a message naming it "
        "(collectives give up later, as a backstop); raise it if one step or checkpoint takes longer",
    )


@dataclass
class ModelSection:
    preset: str = _f("debug", "model preset: debug, 7b-mha, 7b-gqa, 13b, llama3-8b")
    vocab_size: int = _f(0, "override the preset's vocabulary size (0: keep)")
    dim: int = _f(0, "override the hidden size (0: keep)")
    n_layers: int = _f(0, "override the number of layers (0: keep)")
    n_heads: int = _f(0, "override the number of query heads (0: keep)")
    n_kv_heads: int = _f(0, "override the number of key/value heads (0: keep)")
    ffn_dim: int = _f(0, "override the SwiGLU hidden size (0: keep)")
    tie_embeddings: str = _f(
        "preset", "tie input and output embeddings: preset, true or false", ("preset", "true", "false")
    )
    init_from: str = _f(
        "", "local Hugging Face model folder (config.json + *.safetensors) to start from; replaces preset and shape"
    )
    rope_theta: float = _f(0.0, "override the RoPE base (0: keep the preset's or the imported model's)")
    rope_scaling: str = _f(
        "keep",
        "RoPE scaling for a longer context: keep (the model's), none, linear, llama3 or yarn (as transformers)",
        ("keep", "none", "linear", "llama3", "yarn"),
    )
    rope_factor: float = _f(1.0, "rope_scaling: context growth factor (e.g. 4 for 4x)")
    rope_original_max_positions: int = _f(
        0, "llama3/yarn: pretraining context length (0: the imported model's max_position_embeddings)"
    )
    rope_low_freq_factor: float = _f(1.0, "llama3: low_freq_factor")
    rope_high_freq_factor: float = _f(4.0, "llama3: high_freq_factor")
    rope_beta_fast: float = _f(32.0, "yarn: beta_fast")
    rope_beta_slow: float = _f(1.0, "yarn: beta_slow")
    rope_attention_factor: float = _f(0.0, "yarn: cos/sin multiplier (0: 0.1 * ln(factor) + 1)")
    max_positions: int = _f(
        0, "context length written as max_position_embeddings on export (0: original x factor, or the model's)"
    )
    sliding_window: int = _f(
        0, "sliding-window attention: token i sees j only if i - j < this (0: keep the preset's or imported model's)"
    )
    allow_longer_context: bool = _f(
        False,
        "init_from: train at a data.seq_len beyond the context the model's RoPE was pretrained (or scaled) for; "
        "false refuses it and names the rope_scaling/rope_factor that reach it",
    )

    def overrides(self) -> dict:
        out = {
            name: getattr(self, name)
            for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "sliding_window")
            if getattr(self, name)
        }
        if self.tie_embeddings != "preset":
            out["tie_embeddings"] = self.tie_embeddings == "true"
        return out


@dataclass
class ParallelSection:
    hp: int = _f(1, "head-parallel degree (Ulysses all-to-all group)")
    cp: int = _f(1, "context-parallel degree (ring group)")
    ring_window: int = _f(1, "Double-Ring-Attention inner ring size; divides cp (1 or cp: plain ring)")
    placement: str = _f("head_first", "rank placement", PLACEMENTS)
    context_order: str = _f("contiguous", "ring window membership in the context group", CONTEXT_ORDERS)
    balance: str = _f(
        "zigzag",
        "sequence layout over the sp group: zigzag (balanced for one document), documents (from each packed "
        "batch) or locality (documents whole or on runs of adjacent ranks: the ring carries only what they need)",
        BALANCES,
    )
    layout: str = _f(
        "fixed",
        "fixed: every microbatch on hp x cp; per_batch: each microbatch on the hp x cp split of the same ranks "
        "its documents run fastest on (process groups for each built at start; eager only)",
        LAYOUT_MODES,
    )
    dp: int = _f(0, "data-parallel degree (0: world size // (hp*cp))")
    zero: str = _f("dp_sp", "ZeRO sharding scope of model states", ZERO_SCOPES)
    param_dtype: str = _f("float32", "compute dtype of parameters (fp32 master copy kept)", ("float32", "bfloat16"))
    reshard_after_forward: bool = _f(True, "free gathered weights after forward (ZeRO-3); false: keep (ZeRO-2)")
    verify_inputs: bool = _f(
        False,
        "also check with an all-gather in every attention call that the sp ranks agree on shapes and masks "
        "(a debugging aid: each step already checks the batch layout once)",
    )


@dataclass
class MemorySection:
    activation_checkpoint: str = _f(
        "sc++",
        "activation checkpointing per block: none, full (recompute the block, attention included) or sc++ "
        "(Selective Checkpoint++: recompute the block but keep the distributed attention's results)",
        ACTIVATION_CHECKPOINT_MODES,
    )
    activation_checkpoint_every: int = _f(1, "activation-checkpoint every k-th layer")
    loss_chunk: int = _f(
        1024, "tokens of logits at a time in the loss (output layer + cross entropy); 0: the whole shard at once"
    )
    mlp_tile: int = _f(0, "run the MLP over sequence tiles of this many tokens, recomputed per tile (0: off)")
    offload_activations: bool = _f(
        False, "keep what activation checkpointing saves per layer in host memory between forward and backward"
    )
    offload_states: bool = _f(
        False, "keep parameters, gradients and optimizer states in host memory (FSDP2 CPU offload; CPU optimizer)"
    )

    def options(self) -> MemoryOptions:
        """These keys as the :class:`MemoryOptions` that ``parallelize`` takes."""
        return MemoryOptions(
            activation_checkpoint=self.activation_checkpoint,  # type: ignore[arg-type]  # checked by validate
            activation_checkpoint_every=self.activation_checkpoint_every,
            loss_chunk=self.loss_chunk,
            mlp_tile=self.mlp_tile,
            offload_activations=self.offload_activations,
            offload_states=self.offload_states,
        )


@dataclass
class DataSection:
    source: str = _f("recall", "recall (synthetic associative recall) or tokens (a token file)", ("recall", "tokens"))
    path: str = _f("", "token file for source=tokens (made by `loongtrain prepare`)")
    seq_len: int = _f(256, "tokens per sequence; a multiple of 2*hp*cp")
    pack: bool = _f(
        False,
        "packed documents: attention, RoPE positions and targets stop at document boundaries (tokens: documents "
        "end after data.eos_id; recall: the packed variant with conflicting facts across documents)",
    )
    eos_id: int = _f(-1, "pack with source=tokens: end-of-document token id (-1: the one the token file records)")
    document_masks: bool = _f(True, "pack: mask attention at document boundaries (false: an ablation, positions only)")
    long_documents: str = _f(
        "split",
        "source=tokens: a document longer than seq_len is split (continued in the next sequence) or drop (left "
        "out; the start-up line counts what was dropped)",
        LONG_DOCUMENTS,
    )
    group_by_length: int = _f(
        0,
        "pack with source=tokens: within windows of this many steps, give each step sequences whose longest "
        "documents are alike (a layout per microbatch then skips the ring for short ones; 0: off)",
    )
    doc_len: int = _f(64, "pack with source=recall: mean document length (documents of doc_len/2 to 3*doc_len/2)")
    global_batch: int = _f(8, "sequences per optimizer step over all data-parallel replicas")
    micro_batches: int = _f(1, "gradient accumulation: microbatches per step per replica")
    seed: int = _f(1234, "seed of the data order / synthetic samples")
    recall_keys: int = _f(8, "recall: distinct keys")
    recall_values: int = _f(8, "recall: distinct values (chance accuracy = 1/recall_values)")
    recall_facts: int = _f(4, "recall: key-value facts spread over each sequence")
    recall_queries: int = _f(32, "recall: queries at the end of each sequence (or document when packed), scored")
    recall_filler: int = _f(16, "recall: distinct filler tokens between the facts")


@dataclass
class OptimSection:
    lr: float = _f(3e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr (cosine decay)")
    warmup_steps: int = _f(20, "linear warm-up steps")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: no clipping)")


@dataclass
class CheckpointSection:
    every: int = _f(0, "save a checkpoint every this many steps (0: only at the end)")
    keep: int = _f(2, "keep the newest k complete checkpoints")
    resume: bool = _f(True, "resume from the newest complete checkpoint in the run folder")
    save_final: bool = _f(True, "save a checkpoint after the last step")
    on_damaged: str = _f(
        "fallback",
        "a damaged or incomplete newest checkpoint: fallback (resume from the newest intact one) or stop",
        ("fallback", "stop"),
    )


EVAL_TASKS = ("auto", "recall", "text")


@dataclass
class EvalSection:
    every: int = _f(
        0, "run the long-context evaluation (needle grid, loss by position) every this many steps (0: never)"
    )
    lengths: str = _f(
        "", "needle context lengths, comma-separated, K = 1024 (e.g. '1K,2K,4K'); empty: max_len/8, /4, /2 and max_len"
    )
    depths: int = _f(5, "needle depths per length, evenly spaced from 0% to 100% of the filler")
    needles: int = _f(4, "needles per context (distinct keys), each asked at the end and scored")
    samples: int = _f(1, "contexts per (length, depth) cell, with other keys, values and filler")
    max_len: int = _f(
        0, "longest context evaluated (0: the model's context length when it records one, else data.seq_len)"
    )
    task: str = _f(
        "auto",
        "needle format: recall (the synthetic recall task's tokens), text (tokenized sentences) or auto "
        "(recall for a model trained on data.source=recall, else text)",
        EVAL_TASKS,
    )
    tokens: str = _f(
        "",
        "token file (`loongtrain prepare`) of real text: the needles' filler and the loss by position; empty: "
        "the run's data.path (its held-out windows for the loss) or synthetic filler",
    )
    tokenizer: str = _f(
        "", "text needles: tokenizer (HF folder or tokenizer.json); empty: model.init_from's or the run's imported one"
    )
    chat: str = _f("auto", "text needles: wrap the prompt in the tokenizer's chat template", ("auto", "on", "off"))
    position_buckets: int = _f(14, "buckets of the loss-by-position curve: position 0, then log-spaced up to the end")
    loss_windows: int = _f(4, "held-out windows in the loss by position (0: skip it)")
    loss_len: int = _f(
        0, "tokens per loss-by-position window (0: the longest needle length; data.seq_len for held-out windows)"
    )
    seed: int = _f(0, "seed of the needles (keys, values) and of where the filler is taken")


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"1K,2048, 4k"`` -> ``(1024, 2048, 4096)`` (K = 1024, M = 1024**2); raises ConfigError."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        scale = {"k": 1024, "m": 1024**2}.get(item[-1:].lower(), 1)
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) < 1:
            raise ConfigError(f"eval.lengths={text!r}: {item!r} is not a positive length (e.g. 4096, 4K, 1M)")
        out.append(int(digits) * scale)
    if len(set(out)) != len(out):
        raise ConfigError(f"eval.lengths={text!r} names a length twice")
    return tuple(sorted(out))


@dataclass
class TrainConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(TrainConfig)}


class ConfigError(ValueError):
    """A configuration file or override that cannot be used; the message says why."""


#: Keys that were renamed (one name per idea): an old key is refused with its new name, never aliased.
RENAMED_KEYS: dict[str, tuple[str, str]] = {
    "parallel.window": ("parallel.ring_window", "the Double-Ring-Attention inner ring size"),
    "parallel.checkpoint": (
        "memory.activation_checkpoint",
        "activation checkpointing; [checkpoint] is checkpoint files",
    ),
    "parallel.checkpoint_every": ("memory.activation_checkpoint_every", "activation checkpointing of every k-th layer"),
}


def _field_type(section_cls: type, name: str) -> type:
    return typing.get_type_hints(section_cls)[name]


def _coerce(value, typ: type, where: str, from_text: bool):
    """Check a TOML value against the field type, or parse a command-line string."""
    if from_text and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                if text.lower() in ("true", "1", "yes", "on"):
                    return True
                if text.lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if typ is int:
                return int(text)
            if typ is float:
                return float(text)
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not a valid {typ.__name__}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise ConfigError(f"{where}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


def _set(cfg: TrainConfig, section: str, key: str, value, where: str, from_text: bool = False) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{where}: unknown section [{section}]; sections are {list(SECTIONS)}")
    sec = getattr(cfg, section)
    names = [f.name for f in fields(sec)]
    renamed = RENAMED_KEYS.get(f"{section}.{key}")
    if renamed is not None:
        raise ConfigError(f"{where}: {section}.{key} was renamed to {renamed[0]} ({renamed[1]}); use {renamed[0]}")
    if key not in names:
        raise ConfigError(f"{where}: unknown key {section}.{key}; keys of [{section}] are {names}")
    setattr(sec, key, _coerce(value, _field_type(type(sec), key), where, from_text))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then ``section.key=value`` overrides; validated."""
    cfg = TrainConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
            for key, value in table.items():
                _set(cfg, section, key, value, f"{path} [{section}] {key}")
    for item in overrides or []:
        spec = item[2:] if item.startswith("--") else item
        if "=" not in spec or "." not in spec.split("=", 1)[0]:
            raise ConfigError(f"override {item!r} must look like section.key=value (or --section.key value)")
        dotted, value = spec.split("=", 1)
        section, key = dotted.split(".", 1)
        _set(cfg, section, key, value, f"override {item!r}", from_text=True)
    validate(cfg)
    return cfg


def _check_choice(section: object, name: str) -> None:
    meta = {f.name: f.metadata for f in fields(section)}[name]
    value = getattr(section, name)
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(
            f"{type(section).__name__.removesuffix('Section').lower()}.{name}={value!r}; "
            f"choose one of {list(meta['choices'])}"
        )


def validate(cfg: TrainConfig) -> None:
    """Field-level checks (the world-size-dependent ones happen at start-up)."""
    for sec_name in SECTIONS:
        sec = getattr(cfg, sec_name)
        for f in fields(sec):
            _check_choice(sec, f.name)
            value = getattr(sec, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{sec_name}.{f.name}={value} must be finite")
    positive = {
        "run": ("steps", "log_every", "eval_batches", "timeout_s"),
        "parallel": ("hp", "cp", "ring_window"),
        "memory": ("activation_checkpoint_every",),
        "data": (
            "seq_len",
            "global_batch",
            "micro_batches",
            "recall_keys",
            "recall_values",
            "recall_facts",
            "recall_queries",
            "recall_filler",
            "doc_len",
        ),
        "checkpoint": ("keep",),
        "optim": ("lr", "eps"),
        "eval": ("depths", "needles", "samples", "position_buckets"),
    }
    for sec_name, names in positive.items():
        for name in names:
            value = getattr(getattr(cfg, sec_name), name)
            if value <= 0:
                raise ConfigError(f"{sec_name}.{name}={value} must be positive")
    non_negative = {
        "model": (
            "sliding_window",
            "rope_theta",
            "rope_original_max_positions",
            "rope_attention_factor",
            "max_positions",
        ),  # fmt: skip
        "run": ("eval_every", "peak_tflops"),
        "parallel": ("dp",),
        "memory": ("loss_chunk", "mlp_tile"),
        "optim": ("warmup_steps", "weight_decay", "grad_clip", "min_lr_ratio"),
        "checkpoint": ("every",),
        "data": ("group_by_length",),
        "eval": ("every", "max_len", "loss_windows", "loss_len"),
    }
    for sec_name, names in non_negative.items():
        for name in names:
            value = getattr(getattr(cfg, sec_name), name)
            if value < 0:
                raise ConfigError(f"{sec_name}.{name}={value} must not be negative")
    for name in ("beta1", "beta2"):
        value = getattr(cfg.optim, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"optim.{name}={value} must be in [0, 1) (AdamW's moving-average factor; e.g. 0.9)")
    if cfg.optim.min_lr_ratio > 1:
        raise ConfigError(
            f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be at most 1 (the final lr is this fraction of lr)"
        )
    try:
        cfg.memory.options()
    except ValueError as exc:
        raise ConfigError(f"[memory] {exc}") from None
    if cfg.parallel.cp % cfg.parallel.ring_window:
        raise ConfigError(
            f"parallel.cp={cfg.parallel.cp} is not divisible by parallel.ring_window={cfg.parallel.ring_window}"
        )
    if cfg.run.compile and cfg.parallel.layout == "per_batch":
        raise ConfigError(
            "run.compile=true compiles the blocks for one layout; parallel.layout='per_batch' changes it per "
            "microbatch: set parallel.layout='fixed' or run.compile=false"
        )
    if cfg.run.compile and (cfg.memory.offload_activations or cfg.memory.mlp_tile):
        on = "memory.offload_activations" if cfg.memory.offload_activations else "memory.mlp_tile"
        raise ConfigError(
            f"run.compile=true cannot compile blocks with {on} (host copies and per-tile recompute run outside "
            f"a compiled graph); turn one of them off"
        )
    if cfg.data.source == "tokens" and not cfg.data.path:
        raise ConfigError("data.source='tokens' needs data.path (a token file from `loongtrain prepare`)")
    if cfg.data.source != "tokens" and cfg.data.long_documents != "split":
        raise ConfigError(
            f"data.long_documents={cfg.data.long_documents!r} applies to token files; data.source="
            f"{cfg.data.source!r} makes sequences of seq_len itself: remove data.long_documents"
        )
    if cfg.data.group_by_length and not (cfg.data.source == "tokens" and cfg.data.pack):
        raise ConfigError(
            f"data.group_by_length={cfg.data.group_by_length} groups a token file's packed sequences by their "
            f"documents: set data.source='tokens' and data.pack=true, or data.group_by_length=0"
        )
    _validate_model_section(cfg.model)
    if cfg.eval.lengths:
        parse_lengths(cfg.eval.lengths)
    if cfg.data.recall_facts > cfg.data.recall_keys:
        raise ConfigError(
            f"data.recall_facts={cfg.data.recall_facts} exceeds data.recall_keys={cfg.data.recall_keys}: "
            "keys of one sequence must be distinct"
        )


def _validate_model_section(m: ModelSection) -> None:
    """The [model] checks: shape overrides vs init_from, and the context-extension keys."""
    if m.init_from:
        # a sliding window may be set on an imported model (it changes the attention, not the shapes)
        changed = sorted(k for k in m.overrides() if k != "sliding_window")
        changed += ["preset"] if m.preset != ModelSection.preset else []
        if changed:
            raise ConfigError(
                f"model.init_from={m.init_from!r} takes the model's shape from its config.json; remove "
                f"model.{', model.'.join(changed)}"
            )
    if m.rope_scaling in ("keep", "none"):
        if m.rope_factor != 1.0:
            raise ConfigError(
                f"model.rope_factor={m.rope_factor} has no effect with model.rope_scaling={m.rope_scaling!r}; "
                "set model.rope_scaling to linear, llama3 or yarn"
            )
    elif m.rope_factor < 1.0:
        raise ConfigError(f"model.rope_factor={m.rope_factor} must be >= 1 (the context grows by this factor)")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(
            f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
            f"model.rope_low_freq_factor={m.rope_low_freq_factor} (llama3 scaling interpolates between them)"
        )


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(cfg: TrainConfig) -> str:
    """The full resolved configuration as TOML (every key, with its help as a comment)."""
    lines = []
    for sec_name in SECTIONS:
        sec = getattr(cfg, sec_name)
        lines.append(f"[{sec_name}]")
        for f in fields(sec):
            lines.append(f"{f.name} = {_toml_value(getattr(sec, f.name))}  # {f.metadata['help']}")
        lines.append("")
    return "\n".join(lines)


def describe() -> str:
    """Every section and key with its default and help (for --help-config)."""
    lines = []
    for sec_name, cls in SECTIONS.items():
        lines.append(f"[{sec_name}]")
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            lines.append(f"  {f.name} = {_toml_value(default)}\n      {f.metadata['help']}")
    return "\n".join(lines)
