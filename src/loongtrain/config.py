"""Training configuration: typed dataclass sections, a TOML file, ``--section.key value``
overrides, validation with clear errors, and a resolved copy saved in the run folder.

Every field carries a one-line help text (``loongtrain train --help-config`` prints them).
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from loongtrain.model.config import ROPE_SCALINGS, RopeScaling
from loongtrain.options import (
    ATTENTION_KERNELS,
    AUTO_CHECKPOINT,
    LAYOUT_MODES,
    LONG_DOCUMENTS,
    ZERO_SCOPES,
    Float8Options,
    GuardOptions,
    MemoryOptions,
    bound_error,
    check_compile,
    check_float8_memory,
    option,
)
from loongtrain.parallel.config import ParallelConfig


def _key_type(hint: Any) -> type:
    """The plain type a config key holds for an option field's type: a Literal is a str, an
    optional field holds its type (its ``none_as`` value standing for None)."""
    if typing.get_origin(hint) is Literal:
        return str
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _key_type(inner)
    return hint


def option_keys(option_cls: type, *, prefix: str = "", skip: tuple[str, ...] = (), defaults: dict | None = None):
    """A dataclass of config keys made from the fields of the option dataclass ``option_cls``
    (its help, choices and bound carried over, the key named ``prefix + field``), to derive a
    config section from: each option is declared once, on the library's own object.
    ``defaults`` replaces a field's default where the trainer's differs (each says why)."""
    hints = typing.get_type_hints(option_cls)
    keys = []
    for f in fields(option_cls):
        if f.name in skip:
            continue
        default = (defaults or {}).get(f.name, f.default)
        if default is None:
            default = f.metadata["none_as"]
        if default is dataclasses.MISSING:
            raise TypeError(f"option_keys({option_cls.__name__}): {f.name} needs a config default")
        metadata = {**f.metadata, "option": (option_cls, f.name)}
        keys.append((prefix + f.name, _key_type(hints[f.name]), field(default=default, metadata=metadata)))
    return dataclasses.make_dataclass(f"{option_cls.__name__}Keys", keys)


def option_values(section: object, option_cls: type) -> dict[str, Any]:
    """The fields of ``option_cls`` that ``section`` holds keys for, as keyword arguments
    (a key's ``none_as`` value becomes None)."""
    out = {}
    for f in fields(section):  # type: ignore[arg-type]
        owner, name = f.metadata.get("option", (None, None))
        if owner is option_cls:
            value = getattr(section, f.name)
            out[name] = None if "none_as" in f.metadata and value == f.metadata["none_as"] else value
    return out


@dataclass
class RunSection:
    output_dir: str = option("runs/debug", "run folder: resolved config, metrics, plots and checkpoints go here")
    steps: int = option(200, "optimizer steps to train (a resumed run continues up to this step)", bound="positive")
    seed: int = option(0, "seed of the initial weights (data has its own seed)")
    log_every: int = option(
        10, "print metrics every this many steps (every step goes to metrics.jsonl)", bound="positive"
    )
    eval_every: int = option(
        0, "evaluate on held-out batches every this many steps (0: only at the end)", bound="non_negative"
    )
    eval_batches: int = option(4, "held-out global batches per evaluation", bound="positive")
    device: str = option("auto", "auto (cuda when available, else cpu), cpu or cuda", choices=("auto", "cpu", "cuda"))
    progress: str = option(
        "auto", "progress bar: auto (when stdout is a terminal), on or off", choices=("auto", "on", "off")
    )
    tensorboard: bool = option(True, "also write TensorBoard logs when the tensorboard package is installed")
    peak_tflops: float = option(
        0.0, "peak dense TFLOP/s per device for MFU; 0 looks the GPU up in a table", bound="non_negative"
    )
    compile: bool = option(
        False,
        "torch.compile each transformer block (the distributed attention stays opaque); the first steps "
        "take longer while it compiles (raise run.timeout_s if that exceeds it)",
    )
    timeout_s: float = option(
        300.0,
        "a rank that makes no progress for this many seconds ends the job with a message naming it "
        "(collectives give up later, as a backstop); raise it if one step or checkpoint takes longer",
        bound="positive",
    )


@dataclass
class _ModelShapeKeys:
    preset: str = option("debug", "model preset: debug, 7b-mha, 7b-gqa, 13b, llama3-8b")
    vocab_size: int = option(0, "override the preset's vocabulary size (0: keep)", bound="non_negative")
    dim: int = option(0, "override the hidden size (0: keep)", bound="non_negative")
    n_layers: int = option(0, "override the number of layers (0: keep)", bound="non_negative")
    n_heads: int = option(0, "override the number of query heads (0: keep)", bound="non_negative")
    n_kv_heads: int = option(0, "override the number of key/value heads (0: keep)", bound="non_negative")
    ffn_dim: int = option(0, "override the SwiGLU hidden size (0: keep)", bound="non_negative")
    tie_embeddings: str = option(
        "preset", "tie input and output embeddings: preset, true or false", choices=("preset", "true", "false")
    )
    init_from: str = option(
        "", "local Hugging Face model folder (config.json + *.safetensors) to start from; replaces preset and shape"
    )
    rope_theta: float = option(
        0.0, "override the RoPE base (0: keep the preset's or the imported model's)", bound="non_negative"
    )
    rope_scaling: str = option(
        "keep",
        "RoPE scaling for a longer context: keep (the model's), none, linear, llama3 or yarn (as transformers); "
        "the rope_* keys below are its fields",
        choices=("keep", "none", *ROPE_SCALINGS),
    )


#: the trainer's defaults where they differ from the option object's (each with its reason)
ROPE_KEY_DEFAULTS = {"factor": 1.0}  # RopeScaling has no default factor; 1.0 goes with rope_scaling = "keep"


@dataclass
class ModelSection(
    option_keys(RopeScaling, prefix="rope_", skip=("kind",), defaults=ROPE_KEY_DEFAULTS),
    _ModelShapeKeys,
):
    """``[model]``: a preset and its shape overrides (or an HF folder), then the RoPE: the
    ``rope_*`` keys are the fields of :class:`RopeScaling` (``rope_scaling`` its kind)."""

    max_positions: int = option(
        0,
        "context length written as max_position_embeddings on export (0: original x factor, or the model's)",
        bound="non_negative",
    )
    sliding_window: int = option(
        0,
        "sliding-window attention: token i sees j only if i - j < this (0: keep the preset's or imported model's)",
        bound="non_negative",
    )
    layer_types: str = option(
        "",
        "each layer's attention as a comma-separated pattern repeated over the layers: full or sliding (the "
        "window is model.sliding_window or the model's), e.g. 'sliding,sliding,sliding,full' (OLMo 3's 3:1); "
        "'' keeps the preset's or imported model's layer kinds",
    )
    nope_every: int = option(
        0, "every this-many-th layer applies no RoPE (SmolLM3, Llama 4: 4); 0 keeps the model's", bound="non_negative"
    )
    allow_longer_context: bool = option(
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

    def rope(self) -> dict[str, Any]:
        """The ``rope_*`` keys as :class:`RopeScaling` keyword arguments (its ``kind`` is
        ``rope_scaling``), for :func:`loongtrain.model.config.extend_context`."""
        return option_values(self, RopeScaling)


@dataclass
class ParallelSection(option_keys(ParallelConfig)):
    """``[parallel]``: the fields of :class:`ParallelConfig`, then how the run uses them."""

    layout: str = option(
        "fixed",
        "fixed: every microbatch on hp x cp; per_batch: each microbatch on the hp x cp split of the same ranks "
        "its documents run fastest on (process groups for each built at start; eager only)",
        choices=LAYOUT_MODES,
    )
    zero: str = option("dp_sp", "ZeRO sharding scope of model states", choices=ZERO_SCOPES)
    param_dtype: str = option(
        "float32", "compute dtype of parameters (fp32 master copy kept)", choices=("float32", "bfloat16")
    )
    reshard_after_forward: bool = option(True, "free gathered weights after forward (ZeRO-3); false: keep (ZeRO-2)")
    verify_inputs: bool = option(
        False,
        "also check with an all-gather in every attention call that the sp ranks agree on shapes and masks "
        "(a debugging aid: each step already checks the batch layout once)",
    )

    def config(self) -> ParallelConfig:
        """These keys as the :class:`ParallelConfig` that ``init_parallel`` takes."""
        return ParallelConfig(**option_values(self, ParallelConfig))


@dataclass
class Float8Section(option_keys(Float8Options)):
    """``[float8]``: the fields of :class:`Float8Options` (FP8 training of the blocks' linears,
    beside ``parallel.param_dtype``: the compute dtype of everything else)."""

    def options(self) -> Float8Options:
        """These keys as the :class:`Float8Options` that ``parallelize`` takes."""
        return Float8Options(**option_values(self, Float8Options))


#: the trainer checkpoints with sc++ unless told otherwise (a long-sequence trainer's choice);
#: MemoryOptions() itself is no checkpointing, what ``parallelize`` does when not asked
MEMORY_KEY_DEFAULTS = {"activation_checkpoint": "sc++"}


@dataclass
class MemorySection(option_keys(MemoryOptions, defaults=MEMORY_KEY_DEFAULTS)):
    """``[memory]``: the fields of :class:`MemoryOptions`."""

    def options(self) -> MemoryOptions:
        """These keys as the :class:`MemoryOptions` that ``parallelize`` takes."""
        return MemoryOptions(**option_values(self, MemoryOptions))


@dataclass
class GuardSection(option_keys(GuardOptions)):
    """``[guard]``: the fields of :class:`GuardOptions` (non-finite steps, loss spikes, replicas)."""

    def options(self) -> GuardOptions:
        """These keys as the :class:`GuardOptions` the trainer's guard takes."""
        return GuardOptions(**option_values(self, GuardOptions))


@dataclass
class DataSourceSection:
    """``[data.sources.NAME]``: one source of a mixture of token files."""

    path: str = option("", "token file of this source (made by loongtrain prepare)")
    weight: float = option(
        1.0,
        "share of the mix's tokens; weights are normalised (they need not sum to 1), so equal weights mix equally",
        bound="positive",
    )
    upsample_length: int = option(
        0,
        "documents of at least this many tokens are drawn more often, to supply upsample_share of this source's "
        "tokens (its share of the mix is unchanged; 0: no threshold)",
        bound="non_negative",
    )
    upsample_share: float = option(
        0.0,
        "share of this source's drawn tokens from documents of at least upsample_length tokens, in (0, 1) "
        "(0: documents as they come)",
        bound="non_negative",
    )
    long_documents: str = option(
        "",
        "this source's data.long_documents (split or drop; empty: data.long_documents)",
        choices=("", *LONG_DOCUMENTS),
    )


#: a source's name: a bare TOML key (its table is [data.sources.NAME])
SOURCE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass
class DataSection:
    source: str = option(
        "recall",
        "recall (synthetic associative recall) or tokens (a token file, or a mixture of them in [data.sources.NAME])",
        choices=("recall", "tokens"),
    )
    path: str = option("", "token file for source=tokens (made by loongtrain prepare); a mixture: [data.sources]")
    seq_len: int = option(256, "tokens per sequence; a multiple of 2*hp*cp", bound="positive")
    pack: bool = option(
        False,
        "packed documents: attention, RoPE positions and targets stop at document boundaries (tokens: documents "
        "end after data.eos_id; recall: the packed variant with conflicting facts across documents)",
    )
    eos_id: int = option(-1, "pack with source=tokens: end-of-document token id (-1: the one the token file records)")
    document_masks: bool = option(
        True, "pack: mask attention at document boundaries (false: an ablation, positions only)"
    )
    long_documents: str = option(
        "split",
        "source=tokens: a document longer than seq_len is split (continued in the next sequence) or drop (left "
        "out; the start-up line counts what was dropped)",
        choices=LONG_DOCUMENTS,
    )
    group_by_length: int = option(
        0,
        "pack with source=tokens: within windows of this many steps, give each step sequences whose longest "
        "documents are alike (a layout per microbatch then skips the ring for short ones; 0: off)",
        bound="non_negative",
    )
    doc_len: int = option(
        64, "pack with source=recall: mean document length (documents of doc_len/2 to 3*doc_len/2)", bound="positive"
    )
    global_batch: int = option(8, "sequences per optimizer step over all data-parallel replicas", bound="positive")
    micro_batches: int = option(1, "gradient accumulation: microbatches per step per replica", bound="positive")
    seed: int = option(1234, "seed of the data order / synthetic samples")
    recall_keys: int = option(8, "recall: distinct keys", bound="positive")
    recall_values: int = option(8, "recall: distinct values (chance accuracy = 1/recall_values)", bound="positive")
    recall_facts: int = option(4, "recall: key-value facts spread over each sequence", bound="positive")
    recall_queries: int = option(
        32, "recall: queries at the end of each sequence (or document when packed), scored", bound="positive"
    )
    recall_filler: int = option(16, "recall: distinct filler tokens between the facts", bound="positive")
    sources: dict[str, DataSourceSection] = field(
        default_factory=dict,
        metadata={
            "help": "source=tokens: a mixture of token files, one [data.sources.NAME] table each (keys below), "
            "mixed by token share; instead of data.path"
        },
    )


@dataclass
class OptimSection:
    lr: float = option(3e-3, "peak learning rate (AdamW)", bound="positive")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of lr (cosine decay)", bound="non_negative")
    warmup_steps: int = option(20, "linear warm-up steps", bound="non_negative")
    weight_decay: float = option(0.0, "AdamW weight decay", bound="non_negative")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    eps: float = option(1e-8, "AdamW epsilon", bound="positive")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: no clipping)", bound="non_negative")


#: The largest float32 (``torch.finfo(torch.float32).max``): AdamW's parameters and states are
#: float32 (``param_dtype = "bfloat16"`` keeps a float32 master copy).
FLOAT32_MAX = 3.4028234663852886e38
#: The longest ``run.timeout_s`` (``datetime.timedelta`` holds up to 999,999,999 days; the
#: collectives' backstop is twice the timeout): a billion seconds.
MAX_TIMEOUT_S = 1e9
#: The smallest normal float32 (``torch.finfo(torch.float32).tiny``).
FLOAT32_TINY = 1.1754943508222875e-38


def _at_most(limit: float) -> str:
    """``limit`` in 4 significant digits, rounded down (the printed value itself is allowed)."""
    unit = 10.0 ** (math.floor(math.log10(limit)) - 3)
    return f"{math.floor(limit / unit) * unit:.4g}"


def optimizer_range_error(o: OptimSection) -> str | None:
    """Why an ``[optim]`` float does not fit AdamW's float32 parameters and states (naming the
    key and the largest value allowed), or None. The floats that reach a float32 tensor: ``lr``
    (AdamW's first step moves each weight by up to lr / (1 - beta1), larger than any later
    step's, and weight decay scales it by 1 - lr * weight_decay), ``weight_decay`` (in that
    product), ``eps`` (added to the second moment's root) and ``grad_clip`` (divided by the
    gradient norm). Beyond float32 torch either stops at the step ("value cannot be converted to
    type float without overflow") or turns the value into inf (eps, weight decay, clipping)."""
    why = "does not fit float32, the dtype of AdamW's parameters and states:"
    for key in ("eps", "grad_clip"):
        value = getattr(o, key)
        if value > FLOAT32_MAX:
            return f"optim.{key}={value:g} {why} at most {_at_most(FLOAT32_MAX)}"
    if 0 < o.eps < FLOAT32_TINY:  # 1e-50 is 0 in float32: AdamW then divides 0 by 0 where a gradient is 0
        return (
            f"optim.eps={o.eps:g} is below float32's smallest normal number ({FLOAT32_TINY:.4g}), the dtype of "
            f"AdamW's states: it rounds to (nearly) 0, and AdamW divides 0 by 0 wherever a gradient is 0 (rows of "
            f"the embedding no token reached); use at least {FLOAT32_TINY:.4g} (1e-8 is usual)"
        )
    first_step = FLOAT32_MAX * (1 - o.beta1)
    if o.lr > first_step:
        return (
            f"optim.lr={o.lr:g} {why} AdamW's first step moves a weight by up to lr / (1 - beta1) = "
            f"{o.lr / (1 - o.beta1):.4g}; with optim.beta1={o.beta1:g}, optim.lr at most {_at_most(first_step)}"
        )
    if o.lr * o.weight_decay > FLOAT32_MAX:
        return (
            f"optim.weight_decay={o.weight_decay:g} {why} AdamW scales the weights by 1 - lr * weight_decay = "
            f"{1 - o.lr * o.weight_decay:.4g}; with optim.lr={o.lr:g}, optim.weight_decay at most "
            f"{_at_most(FLOAT32_MAX / o.lr)}"
        )
    return None


@dataclass
class CheckpointSection:
    every: int = option(0, "save a checkpoint every this many steps (0: only at the end)", bound="non_negative")
    keep: int = option(2, "keep the newest k complete checkpoints", bound="positive")
    resume: bool = option(True, "resume from the newest complete checkpoint in the run folder")
    save_final: bool = option(True, "save a checkpoint after the last step")
    on_damaged: str = option(
        "fallback",
        "a damaged or incomplete newest checkpoint: fallback (resume from the newest intact one) or stop",
        choices=("fallback", "stop"),
    )
    init_from: str = option(
        "",
        "start a new stage from another run: its run folder (the newest intact checkpoint) or one step-N folder; "
        "its weights (and with init_optimizer its optimizer state) are loaded, the steps, schedule and data start "
        "afresh, and length, layout, mixture and RoPE (model.rope_*) may change; the model's shape may not",
    )
    init_optimizer: bool = option(
        False, "init_from: also load the optimizer state (AdamW's moments and step count); false: a fresh AdamW"
    )
    allow_data_change: bool = option(
        False,
        "resume even if the data (token files, mixture, seq_len, seed) differs from what the checkpoint was "
        "written with; the samples from the resumed step on then come from the new data",
    )


EVAL_TASKS = ("auto", "recall", "text")


@dataclass
class EvalSection:
    every: int = option(
        0,
        "run the long-context evaluation (needle grid, loss by position) every this many steps (0: never)",
        bound="non_negative",
    )
    lengths: str = option(
        "", "needle context lengths, comma-separated, K = 1024 (e.g. '1K,2K,4K'); empty: max_len/8, /4, /2 and max_len"
    )
    depths: int = option(5, "needle depths per length, evenly spaced from 0% to 100% of the filler", bound="positive")
    needles: int = option(4, "needles per context (distinct keys), each asked at the end and scored", bound="positive")
    samples: int = option(1, "contexts per (length, depth) cell, with other keys, values and filler", bound="positive")
    max_len: int = option(
        0,
        "longest context evaluated (0: the model's context length when it records one, else data.seq_len)",
        bound="non_negative",
    )
    task: str = option(
        "auto",
        "needle format: recall (the synthetic recall task's tokens), text (tokenized sentences) or auto "
        "(recall for a model trained on data.source=recall, else text)",
        choices=EVAL_TASKS,
    )
    tokens: str = option(
        "",
        "token file (made by loongtrain prepare) of real text: the needles' filler and the loss by position; empty: "
        "the run's data.path or its mixture's first source (held-out windows for the loss), else synthetic filler",
    )
    tokenizer: str = option(
        "", "text needles: tokenizer (HF folder or tokenizer.json); empty: model.init_from's or the run's imported one"
    )
    chat: str = option(
        "auto", "text needles: wrap the prompt in the tokenizer's chat template", choices=("auto", "on", "off")
    )
    position_buckets: int = option(
        14, "buckets of the loss-by-position curve: position 0, then log-spaced up to the end", bound="positive"
    )
    loss_windows: int = option(4, "held-out windows in the loss by position (0: skip it)", bound="non_negative")
    loss_len: int = option(
        0,
        "tokens per loss-by-position window (0: the longest needle length; data.seq_len for held-out windows)",
        bound="non_negative",
    )
    seed: int = option(0, "seed of the needles (keys, values) and of where the filler is taken")
    generated: str = option(
        "",
        "tasks answered by free generation beside the teacher-forced grid, comma-separated (RULER's niah_single, "
        "niah_multikey, niah_multivalue, vt) or all; empty: none",
    )
    generated_tokens: int = option(
        0, "new tokens per generated answer, within each context length (0: 32 for niah, 64 multivalue, 48 vt)",
        bound="non_negative",
    )  # fmt: skip


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
class MetricsSection:
    """Where rank 0 also sends what ``metrics.jsonl`` holds: Weights & Biases and MLflow (each
    optional; their own environment variables, e.g. WANDB_MODE, WANDB_ENTITY, WANDB_API_KEY,
    MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN, keep working)."""

    wandb: bool = option(False, "log to Weights & Biases (pip install 'loongtrain[wandb]'); WANDB_MODE=offline works")
    wandb_project: str = option("", "W&B project (empty: WANDB_PROJECT, else 'loongtrain')")
    mlflow: bool = option(False, "log to MLflow (pip install 'loongtrain[mlflow]')")
    mlflow_tracking_uri: str = option(
        "", "MLflow tracking server or store (empty: MLFLOW_TRACKING_URI, else sqlite:///<run>/mlflow.db)"
    )
    mlflow_experiment: str = option("", "MLflow experiment (empty: MLFLOW_EXPERIMENT_NAME, else 'loongtrain')")
    run_name: str = option("", "the tracked run's name in W&B and MLflow (empty: the run folder's name)")
    tags: str = option("", "tags of the tracked run, comma-separated")
    connect_timeout_s: float = option(
        15.0,
        "the longest wait for W&B or MLflow at start-up; a service that does not answer by then is left out with "
        "one warning and training goes on (the metrics are still in metrics.jsonl)",
        bound="positive",
    )


@dataclass
class AttentionSection:
    kernel: str = option(
        "auto",
        "block-attention kernel: auto (by device: cuDNN for dense blocks on Hopper/Blackwell with FlashAttention-2's "
        "variable-length calls for documents, FlashAttention-2 on other GPUs, the CPU kernel on CPU), cudnn, flash, "
        "sdpa, flash-attn (the package, where installed) or cpu; fp32 on CUDA always runs sdpa's kernels",
        choices=ATTENTION_KERNELS,
    )


@dataclass
class TrainConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    float8: Float8Section = field(default_factory=Float8Section)
    attention: AttentionSection = field(default_factory=AttentionSection)
    memory: MemorySection = field(default_factory=MemorySection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    guard: GuardSection = field(default_factory=GuardSection)
    eval: EvalSection = field(default_factory=EvalSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)


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


def _set_source(cfg: TrainConfig, dotted: str, value, where: str, from_text: bool) -> None:
    """``sources.NAME.key`` of ``[data]`` (or ``sources`` = a table of source tables, from TOML)."""
    parts = dotted.split(".")
    if parts == ["sources"] and isinstance(value, dict):
        for name, table in value.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{where}.{name}: must be a [data.sources.{name}] table of keys (path, weight, ...)")
            for key, item in table.items():
                _set_source(cfg, f"sources.{name}.{key}", item, f"{where}.{name}.{key}", from_text)
        return
    if len(parts) != 3:
        raise ConfigError(f"{where}: a source's key is data.sources.NAME.KEY (e.g. data.sources.code.weight)")
    _, name, key = parts
    if not SOURCE_NAME.match(name):
        raise ConfigError(f"{where}: source name {name!r} may hold only letters, digits, '_' and '-'")
    source = cfg.data.sources.setdefault(name, DataSourceSection())
    names = [f.name for f in fields(DataSourceSection)]
    if key not in names:
        raise ConfigError(f"{where}: unknown key data.sources.{name}.{key}; keys of a source are {names}")
    setattr(source, key, _coerce(value, _field_type(DataSourceSection, key), where, from_text))


def _set(cfg: TrainConfig, section: str, key: str, value, where: str, from_text: bool = False) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{where}: unknown section [{section}]; sections are {list(SECTIONS)}")
    if section == "data" and key.split(".")[0] == "sources":
        _set_source(cfg, key, value, where, from_text)
        return
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
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a folder, not a TOML file; give the file (see configs/)")
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


def _check_field(sec_name: str, section: object, f: dataclasses.Field) -> None:
    """A key's declared choices, finiteness and bound (its ``none_as`` value passes)."""
    value = getattr(section, f.name)
    where = f"{sec_name}.{f.name}"
    if "choices" in f.metadata and value not in f.metadata["choices"]:
        raise ConfigError(f"{where}={value!r}; choose one of {list(f.metadata['choices'])}")
    if "none_as" in f.metadata and value == f.metadata["none_as"]:
        return
    if "bound" in f.metadata:
        error = bound_error(where, value, f.metadata["bound"])
        if error is not None:
            raise ConfigError(error)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}={value} must be finite")


def _option_object(sec_name: str, build: typing.Callable[[], object]) -> None:
    """Build a section's option object, its cross-field checks refused as a ConfigError."""
    try:
        build()
    except ValueError as exc:
        raise ConfigError(f"[{sec_name}] {exc}") from None


def validate(cfg: TrainConfig) -> None:
    """Every key against its declared choices and bound, the option objects' own checks, then
    what spans sections (the world-size-dependent checks happen at start-up)."""
    for sec_name in SECTIONS:
        section = getattr(cfg, sec_name)
        for f in fields(section):
            _check_field(sec_name, section, f)
    for name, source in cfg.data.sources.items():
        for f in fields(source):
            _check_field(f"data.sources.{name}", source, f)
    for name in ("beta1", "beta2"):
        value = getattr(cfg.optim, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"optim.{name}={value} must be in [0, 1) (AdamW's moving-average factor; e.g. 0.9)")
    for key in ("timeout_s",):  # the process group's timeout and the watchdog hold it as a timedelta
        value = getattr(cfg.run, key)
        if value > MAX_TIMEOUT_S:
            raise ConfigError(
                f"run.{key}={value:g} is longer than a timer can hold here; at most {MAX_TIMEOUT_S:g} s (about 31 "
                f"years): use a large value, not an infinite one"
            )
    range_error = optimizer_range_error(cfg.optim)
    if range_error is not None:
        raise ConfigError(range_error)
    if cfg.model.rope_theta > FLOAT32_MAX:  # the base of the float32 RoPE frequencies: inf turns them to 0
        raise ConfigError(
            f"model.rope_theta={cfg.model.rope_theta:g} does not fit float32, the dtype of the RoPE frequencies: at "
            f"most {_at_most(FLOAT32_MAX)}"
        )
    if cfg.optim.min_lr_ratio > 1:
        raise ConfigError(
            f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be at most 1 (the final lr is this fraction of lr)"
        )
    _option_object("memory", cfg.memory.options)
    _option_object("guard", cfg.guard.options)
    _option_object("parallel", cfg.parallel.config)
    _option_object("float8", cfg.float8.options)
    try:
        check_float8_memory(cfg.memory.options(), cfg.float8.options())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.run.compile:
        try:
            check_compile(cfg.memory.options(), cfg.parallel.layout == "per_batch")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.memory.activation_checkpoint == AUTO_CHECKPOINT and cfg.parallel.layout == "per_batch":
        raise ConfigError(
            "memory.activation_checkpoint='auto' fits the configured hp x cp layout to the device, and "
            "parallel.layout='per_batch' runs microbatches on other splits whose memory differs: name full, sc++ or "
            "none, or set parallel.layout='fixed'"
        )
    _validate_sources(cfg.data)
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
    if cfg.checkpoint.init_from and cfg.model.init_from:
        raise ConfigError(
            f"checkpoint.init_from={cfg.checkpoint.init_from!r} (a run's checkpoint) and model.init_from="
            f"{cfg.model.init_from!r} (a Hugging Face folder) both give the initial weights: keep one"
        )
    if cfg.checkpoint.init_optimizer and not cfg.checkpoint.init_from:
        raise ConfigError("checkpoint.init_optimizer=true loads the optimizer of checkpoint.init_from: set that too")
    if cfg.eval.lengths:
        parse_lengths(cfg.eval.lengths)
    if cfg.data.recall_facts > cfg.data.recall_keys:
        raise ConfigError(
            f"data.recall_facts={cfg.data.recall_facts} exceeds data.recall_keys={cfg.data.recall_keys}: "
            "keys of one sequence must be distinct"
        )


def _validate_sources(d: DataSection) -> None:
    """The token-file keys: one file (data.path) or a mixture ([data.sources.NAME]), and each
    source's path, weight and upsampling (the files themselves are checked at start-up)."""
    if d.source != "tokens":
        if d.sources:
            raise ConfigError(
                f"[data.sources] mixes token files, but data.source={d.source!r}: set data.source='tokens' or "
                f"remove the [data.sources.*] tables"
            )
        return
    if d.path and d.sources:
        raise ConfigError(
            f"data.path={d.path!r} and [data.sources.*] ({', '.join(d.sources)}) are both set: give one file in "
            f"data.path or a mixture in [data.sources.NAME] tables (move the file into one), not both"
        )
    if not d.path and not d.sources:
        raise ConfigError(
            "data.source='tokens' needs data.path (a token file from `loongtrain prepare`) or [data.sources.NAME] "
            "tables (a mixture)"
        )
    if d.sources and d.group_by_length:
        raise ConfigError(
            f"data.group_by_length={d.group_by_length} orders the sequences of one token file; a mixture "
            f"([data.sources]) is not grouped: set data.group_by_length=0"
        )
    for name, s in d.sources.items():
        where = f"data.sources.{name}"
        if not s.path:
            raise ConfigError(f"{where}.path is empty: set it to the source's token file (from `loongtrain prepare`)")
        if s.upsample_share and not 0.0 < s.upsample_share < 1.0:
            raise ConfigError(
                f"{where}.upsample_share={s.upsample_share} must be in (0, 1): the share of the source's tokens "
                f"from its long documents (0: documents as they come)"
            )
        if s.upsample_share and not s.upsample_length:
            raise ConfigError(
                f"{where}.upsample_share={s.upsample_share} needs {where}.upsample_length: the document length "
                f"(tokens) from which a document counts as long"
            )
        policy = s.long_documents or d.long_documents
        if s.upsample_share and policy == "drop" and s.upsample_length > d.seq_len:
            raise ConfigError(
                f"{where}.upsample_length={s.upsample_length} exceeds data.seq_len={d.seq_len}, and long_documents="
                f"'drop' leaves out every document longer than a sequence: no document that long is kept; lower "
                f"upsample_length or set {where}.long_documents='split'"
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
        return
    rope = m.rope()
    # original_max_positions 0 is the imported model's, known when the model is read (extend_context)
    rope["original_max_positions"] = rope["original_max_positions"] or 1
    _option_object("model", lambda: RopeScaling(m.rope_scaling, **rope))


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _tables(value) -> bool:
    """Whether a key holds named subtables (``data.sources``) rather than a value."""
    return isinstance(value, dict)


def to_toml(cfg: TrainConfig) -> str:
    """The full resolved configuration as TOML (every key, with its help as a comment; the
    sources of a mixture as ``[data.sources.NAME]`` tables after ``[data]``'s keys)."""
    lines = []
    for sec_name in SECTIONS:
        sec = getattr(cfg, sec_name)
        lines.append(f"[{sec_name}]")
        tables = []
        for f in fields(sec):
            value = getattr(sec, f.name)
            if _tables(value):
                tables += [(f"{sec_name}.{f.name}.{name}", table) for name, table in value.items()]
                continue
            lines.append(f"{f.name} = {_toml_value(value)}  # {f.metadata['help']}")
        for header, table in tables:
            lines.append(f"\n[{header}]")
            for f in fields(table):
                lines.append(f"{f.name} = {_toml_value(getattr(table, f.name))}  # {f.metadata['help']}")
        lines.append("")
    return "\n".join(lines)


def describe() -> str:
    """Every section and key with its default and help (for --help-config); a key of named
    subtables (``data.sources``) is followed by the keys of one such table."""
    lines = []
    for sec_name, cls in SECTIONS.items():
        lines.append(f"[{sec_name}]")
        for f in fields(cls):
            if f.default_factory is dict:
                lines.append(f"  [{sec_name}.{f.name}.NAME]\n      {f.metadata['help']}")
                for g in fields(typing.get_args(_field_type(cls, f.name))[1]):
                    lines.append(f"    {g.name} = {_toml_value(g.default)}\n        {g.metadata['help']}")
                continue
            default = f.default if f.default is not dataclasses.MISSING else None
            lines.append(f"  {f.name} = {_toml_value(default)}\n      {f.metadata['help']}")
    return "\n".join(lines)
