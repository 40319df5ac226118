"""The names of loongtrain's options, and their checks. A leaf module: no torch, no imports
from the rest of the package, so the training config, the parallel layout, the
parallelize functions and the planner all read the same names from here.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, get_args

Placement = Literal["head_first", "context_first"]
ContextOrder = Literal["contiguous", "interleaved"]
ActivationCheckpoint = Literal["none", "full", "sc++"]
ZeroScope = Literal["none", "dp", "sp", "dp_sp"]
Balance = Literal["zigzag", "documents", "locality"]

#: ``head_first``: a head group on consecutive ranks; ``context_first``: a context group.
PLACEMENTS: tuple[str, ...] = get_args(Placement)
#: ``contiguous``: ring windows of consecutive context-group members; ``interleaved``: strided.
CONTEXT_ORDERS: tuple[str, ...] = get_args(ContextOrder)
#: activation checkpointing per block: nothing, the whole block, or the block minus the attention.
ACTIVATION_CHECKPOINT_MODES: tuple[str, ...] = get_args(ActivationCheckpoint)
#: ``auto``: the planner's memory model picks the mode and how many layers it covers
#: (:func:`loongtrain.planner.policy.choose_checkpoint_policy`); resolved before ``parallelize``
AUTO_CHECKPOINT = "auto"
#: what a training config's ``memory.activation_checkpoint`` takes
ACTIVATION_CHECKPOINT_CHOICES: tuple[str, ...] = (*ACTIVATION_CHECKPOINT_MODES, AUTO_CHECKPOINT)
#: where model states are sharded: nowhere, across dp, within the sp group, over every rank.
ZERO_SCOPES: tuple[str, ...] = get_args(ZeroScope)
#: how sequence chunks are assigned to context ranks (see ``loongtrain.attention.balance``).
BALANCES: tuple[str, ...] = get_args(Balance)
#: what the token-file loader does with a document longer than a sequence (data.long_documents)
LONG_DOCUMENTS: tuple[str, ...] = ("split", "drop")
#: ``fixed``: every microbatch on the configured hp x cp; ``per_batch``: each microbatch on the
#: hp x cp split of the same ranks that ``loongtrain.attention.choose`` prices fastest.
LAYOUT_MODES: tuple[str, ...] = ("fixed", "per_batch")
#: block-attention kernels (``[attention] kernel``; ``loongtrain.attention.backends``)
ATTENTION_KERNELS: tuple[str, ...] = ("auto", "cudnn", "flash", "sdpa", "flash-attn", "cpu")
#: the kernels that run on CUDA only
CUDA_KERNELS: tuple[str, ...] = ("cudnn", "flash", "sdpa", "flash-attn")


def check_kernel_device(kernel: str, device: str) -> None:
    """Raise ValueError if attention ``kernel`` cannot run on ``device`` (``cpu`` or ``cuda``: what
    ``run.device`` resolves to, ``loongtrain.launch.resolve_device``)."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention.kernel={kernel!r}; choose one of {list(ATTENTION_KERNELS)}")
    if device == "cpu" and kernel in CUDA_KERNELS:
        raise ValueError(f"attention.kernel={kernel!r} runs on CUDA, but run.device=cpu; use attention.kernel=auto")
    if device == "cuda" and kernel == "cpu":
        raise ValueError("attention.kernel='cpu' runs on the CPU, but run.device=cuda; use attention.kernel=auto")


#: the bounds an option may declare (``bound=`` of :func:`option`)
BOUNDS = ("positive", "non_negative")


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    choices: tuple[str, ...] | None = None,
    bound: str | None = None,
    none_as: Any = None,
) -> Any:
    """A dataclass field with what the training config needs to know of it, declared once:
    its one-line ``help``, its ``choices`` or its ``bound`` (``"positive"`` or
    ``"non_negative"``), and for an optional field the config value that stands for None
    (``none_as``: a config key holds a plain str/int/float/bool). The config sections are
    made from these fields (``loongtrain.config``) and validated from this metadata."""
    if bound is not None and bound not in BOUNDS:
        raise ValueError(f"option bound {bound!r}; choose one of {list(BOUNDS)}")
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if bound is not None:
        meta["bound"] = bound
    if none_as is not None:
        meta["none_as"] = none_as
    return field(default=default, metadata=meta)


def bound_error(name: str, value: object, bound: str) -> str | None:
    """Why ``value`` breaks ``bound`` (a sentence naming ``name``), or None if it keeps it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r} must be a number"
    if not math.isfinite(value):
        return f"{name}={value} must be finite"
    if bound == "positive" and not value > 0:
        return f"{name}={value} must be positive"
    if bound == "non_negative" and value < 0:
        return f"{name}={value} must not be negative"
    return None


def check_bounds(obj: object) -> None:
    """Raise ValueError for the first field of the dataclass ``obj`` that breaks its declared
    choices or bound (None is allowed where the field declares ``none_as``)."""
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if value is None and "none_as" in f.metadata:
            continue
        where = f"{type(obj).__name__}: {f.name}"
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            raise ValueError(f"{where}={value!r}; choose one of {list(f.metadata['choices'])}")
        if "bound" in f.metadata:
            error = bound_error(f.name, value, f.metadata["bound"])
            if error is not None:
                raise ValueError(f"{type(obj).__name__}: {error}")


def check_activation_checkpoint(mode: str, every: int = 1, span: int = 1, layers: int = 0) -> None:
    """Raise ValueError unless ``mode`` is an activation checkpoint mode (or ``auto``), ``every``
    and ``span`` positive integers, ``span > 1`` only with ``full`` on every layer, and ``layers``
    (the first this many layers; 0: all that ``every`` selects) a count beside ``every = 1``."""
    if mode not in ACTIVATION_CHECKPOINT_CHOICES:
        raise ValueError(
            f"unknown activation checkpoint mode {mode!r}; choose one of {list(ACTIVATION_CHECKPOINT_CHOICES)}"
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"activation checkpoint every={every!r} must be a positive integer (1 = every layer)")
    if isinstance(span, bool) or not isinstance(span, int) or span < 1:
        raise ValueError(f"activation checkpoint span={span!r} must be a positive integer (1 = each layer its own)")
    if span > 1 and (mode != "full" or every != 1):
        raise ValueError(
            f"activation_checkpoint_span={span} keeps one input per span of layers and recomputes the span, each "
            f"layer again checkpointed: it needs activation_checkpoint='full' with activation_checkpoint_every=1 "
            f"(got {mode!r}, every={every})"
        )
    if mode == AUTO_CHECKPOINT and every != 1:
        raise ValueError(
            f"activation_checkpoint='auto' chooses which layers to checkpoint itself; set "
            f"activation_checkpoint_every=1 (got {every}) or choose full or sc++"
        )
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ValueError(
            f"activation_checkpoint_layers={layers!r} must be 0 (every layer) or a positive number of layers"
        )
    if layers and (mode in ("none", AUTO_CHECKPOINT) or every != 1 or span != 1):
        raise ValueError(
            f"activation_checkpoint_layers={layers} checkpoints the first {layers} layers with one mode: it needs "
            f"activation_checkpoint 'full' or 'sc++' with activation_checkpoint_every=1 and "
            f"activation_checkpoint_span=1 (got {mode!r}, every={every}, span={span}); "
            f"set activation_checkpoint_layers=0 or change the others"
        )


def checkpoint_label(memory: MemoryOptions, n_layers: int) -> str:
    """The checkpointing in words: ``sc++``, ``sc++ on the first 6 of 16 layers``, ``full on one layer in 2``."""
    mode, layers, every = (
        memory.activation_checkpoint,
        memory.activation_checkpoint_layers,
        memory.activation_checkpoint_every,
    )
    if layers and mode != "none":
        return f"{mode} on the first {layers} of {n_layers} layers"
    if every > 1 and mode != "none":
        return f"{mode} on one layer in {every}"
    return mode


def checkpointed_count(memory: MemoryOptions, n_layers: int) -> int:
    """How many of ``n_layers`` layers ``memory`` checkpoints: the first
    ``activation_checkpoint_layers``, else every ``activation_checkpoint_every``-th (0 without
    checkpointing). ValueError for ``auto`` (resolve it first) or more layers than the model has."""
    mode, layers = memory.activation_checkpoint, memory.activation_checkpoint_layers
    if mode == AUTO_CHECKPOINT:
        raise ValueError(
            "activation_checkpoint='auto' is chosen per run by loongtrain.planner.choose_checkpoint_policy; "
            "resolve it before pricing or applying the memory options"
        )
    if layers > n_layers:
        raise ValueError(
            f"activation_checkpoint_layers={layers} but the model has {n_layers} layers; use at most {n_layers} "
            f"(or 0: every layer)"
        )
    if mode == "none":
        return 0
    return layers or math.ceil(n_layers / memory.activation_checkpoint_every)


def check_zero_scope(scope: str) -> None:
    """Raise ValueError unless ``scope`` is a ZeRO scope."""
    if scope not in ZERO_SCOPES:
        raise ValueError(f"unknown ZeRO scope {scope!r}; choose one of {list(ZERO_SCOPES)}")


@dataclass(frozen=True)
class MemoryOptions:
    """How a run trades recomputation and host transfers for device memory: the ``[memory]``
    keys of a training config (made from these fields) and what the planner prices. Each
    field's help says what it does; ``offload_activations`` needs ``full`` or ``sc++``."""

    activation_checkpoint: str = option(
        "none",
        "activation checkpointing per block: none, full (recompute the block, attention included), sc++ "
        "(Selective Checkpoint++: recompute the block but keep the distributed attention's results) or auto "
        "(the planner's memory model picks the mode and how many layers, the least recompute that fits the "
        "device: memory.device_memory_gib)",
        choices=ACTIVATION_CHECKPOINT_CHOICES,
    )
    activation_checkpoint_every: int = option(1, "activation-checkpoint every k-th layer", bound="positive")
    activation_checkpoint_layers: int = option(
        0,
        "checkpoint only the first this many layers (the rest keep their activations, no recompute); "
        "0: every layer activation_checkpoint_every selects",
        bound="non_negative",
    )
    device_memory_gib: float = option(
        0.0,
        "activation_checkpoint=auto: the device memory (GiB) the plan may fill; 0: 90% of the device's own "
        "(a GPU's total; on CPU set it)",
        bound="non_negative",
    )
    activation_checkpoint_span: int = option(
        1,
        "under full checkpointing, keep one input per span of this many layers and recompute the span in "
        "backward (each layer again checkpointed inside it): 1/span of the kept inputs, one more forward",
        bound="positive",
    )
    loss_chunk: int = option(
        1024,
        "tokens of logits at a time in the loss (output layer + cross entropy); 0: the whole shard at once",
        bound="non_negative",
    )
    mlp_tile: int = option(
        0, "run the MLP over sequence tiles of this many tokens, recomputed per tile (0: off)", bound="non_negative"
    )
    head_groups: int = option(
        1,
        "run each layer's attention (q/k/v projections, RoPE, the kernel or ring, the output projection) over "
        "this many groups of heads, one group at a time in forward and backward (1: every head at once)",
        bound="positive",
    )
    offload_activations: bool = option(
        False, "keep what activation checkpointing saves per layer in host memory between forward and backward"
    )
    offload_states: bool = option(
        False, "keep parameters, gradients and optimizer states in host memory (FSDP2 CPU offload; CPU optimizer)"
    )

    def __post_init__(self) -> None:
        check_activation_checkpoint(
            self.activation_checkpoint,
            self.activation_checkpoint_every,
            self.activation_checkpoint_span,
            self.activation_checkpoint_layers,
        )
        for name in ("loss_chunk", "mlp_tile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryOptions: {name}={value!r} must be 0 (off) or a positive number of tokens")
        if isinstance(self.head_groups, bool) or not isinstance(self.head_groups, int) or self.head_groups < 1:
            raise ValueError(f"MemoryOptions: head_groups={self.head_groups!r} must be a positive integer (1: off)")
        for name in ("offload_activations", "offload_states"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MemoryOptions: {name}={getattr(self, name)!r} must be true or false")
        if self.device_memory_gib and self.activation_checkpoint != AUTO_CHECKPOINT:
            raise ValueError(
                f"MemoryOptions: device_memory_gib={self.device_memory_gib} is the budget of "
                f"activation_checkpoint='auto', but activation_checkpoint={self.activation_checkpoint!r}; set "
                f"activation_checkpoint='auto' or device_memory_gib=0"
            )
        if self.offload_activations and self.activation_checkpoint == "none":
            raise ValueError(
                "MemoryOptions: offload_activations moves what activation checkpointing keeps, and "
                "activation_checkpoint='none' keeps nothing to move; use 'full' or 'sc++'"
            )


def check_compile(memory: MemoryOptions, per_batch: bool = False) -> None:
    """Raise ValueError if blocks compiled with ``torch.compile`` cannot run with ``memory``
    (host copies and per-tile recompute run outside a compiled graph) or with a layout per
    microbatch (``per_batch``: the blocks are compiled for one layout)."""
    on = [name for name in ("offload_activations", "mlp_tile") if getattr(memory, name)]
    if memory.head_groups > 1:
        on.append("head_groups")
    if memory.activation_checkpoint_span > 1:
        on.append("activation_checkpoint_span")
    if on:
        raise ValueError(
            f"compiled blocks (run.compile=true) cannot run with memory.{on[0]} (host copies, per-tile, "
            f"per-head-group and per-span recompute run outside a compiled graph); turn one of them off"
        )
    if per_batch:
        raise ValueError(
            "compiled blocks (run.compile=true) are compiled for one layout, and parallel.layout='per_batch' "
            "changes it per microbatch: set parallel.layout='fixed' or run.compile=false"
        )


#: torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``): ``tensorwise`` (one
#: scale per tensor: fastest, but under sequence parallelism a rank's activation scales come from its
#: shard), ``rowwise`` (a scale per token / weight row) and ``rowwise_with_gw_hp`` (rowwise, the weight
#: gradient in high precision: every scale is per token or per weight row, so the result does not
#: depend on the layout)
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: the compute capability from which a GPU has FP8 matmul units (Ada 8.9, Hopper 9.0, Blackwell)
FLOAT8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Float8Options:
    """FP8 training of the transformer blocks' linears with torchao (``loongtrain.apply.float8``):
    the ``[float8]`` keys of a training config (torchtitan's names). The output layer, the
    embedding, attention, norms, the ring and the loss stay in the compute dtype."""

    enabled: bool = option(False, "train the blocks' linear layers in float8 (torchao; pip install -e '.[fp8]')")
    recipe_name: str = option(
        "tensorwise",
        "torchao recipe: tensorwise (one scale per tensor, fastest; scales follow each rank's shard of the "
        "tokens), rowwise (per token / weight row) or rowwise_with_gw_hp (rowwise, weight gradient in high "
        "precision: the result does not depend on the parallel layout)",
        choices=FLOAT8_RECIPES,
    )
    filter_fqns: str = option(
        "",
        "comma-separated name fragments of linears kept in high precision (e.g. 'wq,wk'); the output layer and "
        "linears whose dims are not multiples of 16 are always kept",
    )
    auto_filter_small_kn: bool = option(
        False,
        "also keep the linears torchao's size heuristics (measured on H100) expect no speed-up from in high precision",
    )
    emulate: bool = option(
        False, "emulate the float8 matmuls in high precision (same numerics; for GPUs below compute capability 8.9)"
    )
    enable_fsdp_float8_all_gather: bool = option(
        False, "ZeRO gathers the blocks' weights as float8 (half of bf16's bytes); tensorwise only"
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = option(
        False, "with the float8 all-gather: compute every weight's scale in one op after each optimizer step"
    )

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.enable_fsdp_float8_all_gather and self.recipe_name != "tensorwise":
            raise ValueError(
                f"Float8Options: enable_fsdp_float8_all_gather sends each weight with one scale per tensor, so it "
                f"needs recipe_name='tensorwise' (got {self.recipe_name!r}); turn it off or use tensorwise"
            )
        if self.precompute_float8_dynamic_scale_for_fsdp and not self.enable_fsdp_float8_all_gather:
            raise ValueError(
                "Float8Options: precompute_float8_dynamic_scale_for_fsdp computes the scales of the float8 "
                "all-gather: set enable_fsdp_float8_all_gather=true too, or turn it off"
            )

    def fqn_filters(self) -> tuple[str, ...]:
        """``filter_fqns`` as its non-empty, stripped fragments."""
        return tuple(part.strip() for part in self.filter_fqns.split(",") if part.strip())


def check_float8_device(device: str, capability: tuple[int, int] | None, gpu_name: str, float8: Float8Options) -> None:
    """Raise ValueError if ``float8`` cannot run on ``device`` (``cpu`` or ``cuda``; a GPU's
    ``capability`` and ``gpu_name``): float8 matmuls need FP8 units (compute capability >= 8.9)
    unless emulated (the CPU runs ``torch._scaled_mm`` itself)."""
    if not float8.enabled:
        return
    if device == "cuda" and not float8.emulate and capability is not None and capability < FLOAT8_MIN_CAPABILITY:
        raise ValueError(
            f"float8.enabled needs FP8 matmul units (compute capability >= 8.9: Ada, Hopper, Blackwell), and "
            f"{gpu_name} has {capability[0]}.{capability[1]}: set float8.emulate=true (same numerics, no speed-up) "
            f"or float8.enabled=false"
        )


def check_float8_memory(memory: MemoryOptions, float8: Float8Options) -> None:
    """Raise ValueError for a memory option that would bypass the float8 linears: the tiled MLP
    and the attention over head groups compute their projections from the weight tensors
    themselves (in their own backward), not through the linear modules torchao swapped in."""
    if not float8.enabled:
        return
    on = [name for name in ("mlp_tile",) if getattr(memory, name)]
    if memory.head_groups > 1:
        on.append("head_groups")
    if on:
        raise ValueError(
            f"float8.enabled runs the blocks' linears as torchao's float8 modules, and memory.{on[0]} computes its "
            f"projections from the weight tensors directly (bypassing them): turn memory.{on[0]} off or "
            f"float8.enabled=false"
        )


#: what the trainer does with a step whose loss or gradients are not finite (``guard.nonfinite``)
NONFINITE_POLICIES: tuple[str, ...] = ("stop", "skip")
#: what the trainer does with a loss spike (``guard.spike``)
SPIKE_POLICIES: tuple[str, ...] = ("off", "warn", "skip", "rollback")
#: what ``guard.stalled`` does with a run that stopped learning
STALL_POLICIES: tuple[str, ...] = ("off", "warn", "stop")


@dataclass(frozen=True)
class GuardOptions:
    """What keeps a run from training on bad numbers: the ``[guard]`` keys of a training config
    (made from these fields; ``loongtrain.train.guard`` applies them). A loss spike is a finite
    loss above ``mean + max(spike_sigma * std, 2% of the mean)`` of the last ``spike_window``
    applied steps' losses, judged once ``spike_min_history`` of them are known (a fresh run's
    first steps are never spikes; the history travels with the checkpoints, so a resume is judged
    from its first step)."""

    nonfinite: str = option(
        "stop",
        "a step whose loss or gradient norm is NaN or infinite: stop (nothing applied, nothing saved from it; the "
        "job ends naming the step, the first parameter with a non-finite gradient, the microbatch and its "
        "samples, and how to resume) or skip (the update is not applied, the data moves on)",
        choices=NONFINITE_POLICIES,
    )
    max_skips: int = option(
        3, "consecutive skipped steps (non-finite or spike) after which the job stops as under stop", bound="positive"
    )
    spike: str = option(
        "warn",
        "a loss spike (see spike_window, spike_sigma): off, warn (say it, train on), skip (do not apply the step) "
        "or rollback (reload the newest checkpoint at least rollback_back steps before it and move the data past "
        "the spike)",
        choices=SPIKE_POLICIES,
    )
    spike_window: int = option(128, "loss spikes: the recent applied steps whose losses are compared", bound="positive")
    spike_sigma: float = option(
        6.0, "loss spikes: a loss above the window's mean plus this many standard deviations", bound="positive"
    )
    spike_min_history: int = option(
        16, "loss spikes: steps of history needed before a loss can be a spike", bound="positive"
    )
    rollback_back: int = option(
        1, "spike=rollback: the checkpoint reloaded is at least this many steps before the spike", bound="positive"
    )
    rollback_skip_steps: int = option(
        0, "spike=rollback: global batches skipped after the spike's own (PaLM skipped 200-500)", bound="non_negative"
    )
    max_rollbacks: int = option(3, "spike=rollback: rollbacks per run before the job stops", bound="non_negative")
    stalled: str = option(
        "warn",
        "a run that stopped learning (a gradient norm of exactly 0, or a loss at the uniform distribution's value "
        "ln(vocab_size), for stalled_steps steps in a row): off, warn (once, on the progress line and in "
        "metrics.jsonl, naming the step it began) or stop",
        choices=STALL_POLICIES,
    )
    stalled_steps: int = option(
        10,
        "stalled: steps in a row with a zero gradient norm or a uniform loss (counted after optim.warmup_steps for "
        "the loss) before the run is called stalled",
        bound="positive",
    )
    replica_check_every: int = option(
        0,
        "every this many steps (and at the start) ranks that should hold identical model-state shards (data-"
        "parallel replicas) compare a digest of each parameter; a mismatch stops the job naming them (0: off)",
        bound="non_negative",
    )

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.spike_min_history > self.spike_window:
            raise ValueError(
                f"GuardOptions: spike_min_history={self.spike_min_history} exceeds spike_window={self.spike_window}; "
                f"a spike is judged against at most spike_window steps"
            )
