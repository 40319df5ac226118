"""Cluster and model descriptions for the planner: ``ClusterSpec``, presets, cluster files.

A cluster file is TOML with one flat table of the :class:`ClusterSpec` fields (see
``clusters/local.toml``, written by ``loongtrain plan --calibrate``). Bandwidths are
achievable values in GB/s (1e9 bytes/s) per direction, latencies in microseconds,
FLOP/s in TFLOP/s (1e12) per device.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from loongtrain.model.config import PRESETS, LayerKind, ModelConfig


class PlanError(ValueError):
    """A request the planner cannot serve; the message names the values and the fix."""


@dataclass(frozen=True)
class ClusterSpec:
    """One kind of machine: nodes of identical devices joined by NICs.

    Compute: ``peak_tflops`` is the spec-sheet dense rate that MFU divides by; the
    ``*_tflops`` below it are what kernels achieve and what times are computed from.
    Communication: inside a node every device has a link of ``intra_bw_gbs`` to the
    fabric, which carries at most ``intra_node_bw_gbs`` at once (NVSwitch: non-blocking,
    ``devices_per_node * intra_bw_gbs``); between nodes a transfer goes through one NIC
    of ``nic_bw_gbs``, and the node's ``nics_per_node`` NICs are shared by the devices
    that send off the node at the same time.
    """

    name: str
    nodes: int  # nodes in the cluster: at most nodes * devices_per_node devices
    devices_per_node: int
    device_memory_gib: float
    usable_memory_fraction: float  # of device memory left for tensors (runtime, allocator slack)
    peak_tflops: float  # dense bf16 spec-sheet rate per device (MFU denominator)
    matmul_tflops: float  # achieved by the linear layers
    attn_fwd_tflops: float  # achieved by the attention kernel, forward
    attn_bwd_tflops: float  # achieved by the attention kernel, backward (2.5x forward FLOPs)
    kernel_overhead_us: float  # fixed time per forward block-kernel call (small blocks: lower efficiency)
    intra_bw_gbs: float  # point to point inside a node, per device and direction
    intra_node_bw_gbs: float  # all transfers inside one node together
    intra_latency_us: float
    a2a_bw_gbs: float  # all-to-all inside a node, per device (bytes sent to peers / time)
    a2a_latency_us: float  # per peer of an all-to-all
    nics_per_node: int
    nic_bw_gbs: float  # per NIC and direction
    inter_latency_us: float
    causal_tile: float = 128.0  # tokens: a causal diagonal block of S tokens costs (1 + tile/S) x its FLOPs
    overlap: float = 1.0  # fraction of a transfer that proceeds while the device computes
    kernel_bwd_overhead_us: float | None = None  # fixed time per backward block-kernel call (None: forward's)
    attn_wave_rows: float = 0.0  # rows x heads of one block kernel that fill the device once (0: not modelled)
    hbm_bw_gbs: float = 0.0  # device-memory bandwidth of the merges around each block (0: not modelled)
    hop_sync_us: float = 0.0  # per ring step and all-to-all: posting the transfer and waiting for the peer
    host_link_gbs: float = 0.0  # device <-> host per device and direction, every device at once (0: no offload)
    host_memory_gib: float = 0.0  # host memory per node usable for offload (pinned buffers; 0: none to spare)
    host_mem_bw_gbs: float = 0.0  # host memory bandwidth per node (the CPU optimizer step; 0: not known)
    # device time per token of a rank's shard per layer forward outside its matmuls and attention
    # kernels (norms, RoPE, SwiGLU, casts, launches; backward 2x, a recompute 1x), fitted from
    # measured steps (`loongtrain plan --calibrate-gpu`; 0: not modelled)
    layer_token_ns: float = 0.0
    # achieved dense FP8 matmul rate of the linear layers (float8 training; 0: no FP8 units)
    fp8_matmul_tflops: float = 0.0
    description: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "description"):
                if not isinstance(value, str):
                    raise PlanError(f"cluster {self.name!r}: {f.name} must be a string, got {value!r}")
                continue
            if value is None and f.name in _MAY_BE_NONE:
                continue
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise PlanError(f"cluster {self.name!r}: {f.name}={value!r} must be an integer")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise PlanError(f"cluster {self.name!r}: {f.name}={value!r} must be a finite number")
            if value < 0 or (value == 0 and f.name not in _MAY_BE_ZERO):
                raise PlanError(f"cluster {self.name!r}: {f.name}={value!r} must be positive")
        for name in ("usable_memory_fraction", "overlap"):
            if getattr(self, name) > 1:
                raise PlanError(f"cluster {self.name!r}: {name}={getattr(self, name)} must be in (0, 1]")
        if self.nics_per_node < 1 or self.devices_per_node < 1 or self.nodes < 1:
            raise PlanError(f"cluster {self.name!r}: nodes, devices_per_node and nics_per_node must be at least 1")

    @property
    def max_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory_bytes(self) -> float:
        return self.device_memory_gib * 2**30 * self.usable_memory_fraction

    @property
    def host_memory_bytes(self) -> float:
        return self.host_memory_gib * 2**30

    @property
    def host_copy_gbs(self) -> float:
        """Device <-> host GB/s per device and direction when every device of a node copies at
        once: ``host_link_gbs``, capped by the node's host memory bandwidth shared by its devices."""
        if self.host_mem_bw_gbs > 0:
            return min(self.host_link_gbs, self.host_mem_bw_gbs / self.devices_per_node)
        return self.host_link_gbs

    def offload_gap(self, what: str) -> str | None:
        """Why ``what`` (``"activations"`` or ``"states"``) cannot be offloaded on this cluster, or None."""
        missing = [name for name in ("host_link_gbs", "host_memory_gib") if getattr(self, name) <= 0]
        if what == "states" and self.host_mem_bw_gbs <= 0:
            missing.append("host_mem_bw_gbs")
        if not missing:
            return None
        return (
            f"cluster {self.name!r} has no host memory to spare for offloading {what} "
            f"({', '.join(f'{k}={getattr(self, k):g}' for k in missing)}); set them in a cluster file "
            f"(see docs/planner.md, 'Clusters'), or plan without offload"
        )

    @property
    def bwd_overhead_us(self) -> float:
        """Fixed time per backward block-kernel call (the forward's when not measured apart)."""
        return self.kernel_overhead_us if self.kernel_bwd_overhead_us is None else self.kernel_bwd_overhead_us


_MAY_BE_NONE = ("kernel_bwd_overhead_us",)
_MAY_BE_ZERO = ("attn_wave_rows", "hbm_bw_gbs", "hop_sync_us", "host_link_gbs", "host_memory_gib", "host_mem_bw_gbs",
                "layer_token_ns", "fp8_matmul_tflops")  # fmt: skip
CLUSTER_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ClusterSpec))
_OPTIONAL = ("name", "causal_tile", "overlap", "description", *_MAY_BE_NONE, *_MAY_BE_ZERO)
_REQUIRED = tuple(name for name in CLUSTER_FIELDS if name not in _OPTIONAL)

# GPU presets. Every constant is a spec-sheet number times an achievable fraction, or a
# fit to a published measurement; docs/planner.md ("Where the constants come from") gives
# each source. In short:
#   matmul: 75% of peak (A100) / 70% (Hopper), assumed for cuBLAS bf16 GEMMs of 7B shapes;
#   attention on A100: FlashAttention-2 at the rates that reproduce ring-flash-attention's
#     published single-GPU flash_attn step (one 8192-token causal call, 32 heads of 128:
#     373.4 it/s forward, 94.7 it/s forward + backward; tests/planner_anchors.py, flash_attention2_rates):
#     forward 215.6, backward 182.2 TFLOP/s; 20 us fixed per kernel call (assumed);
#   attention on Hopper: the cuDNN / FlashAttention-3 class kernel (PyTorch SDPA's cuDNN
#     backend), time = overhead + FLOPs / rate fitted to FA3's published H100 times
#     (tritonbench PR #1267, causal, B=4, H=48, d=128, S=1024..8192): forward 68 us +
#     FLOPs at 695 TFLOP/s, backward 478 us + FLOPs at 556 TFLOP/s;
#   block-size efficiency: a block kernel works on tiles of 128 query rows (key rows in
#     backward) per head, one per SM at head dim 128 (FlashAttention-2 paper, section 3.2),
#     so rows x heads = 128 x SMs fill the device once (A100: 108 SMs, Hopper: 132); a
#     block of R such rows runs at R / (R + wave/2) of the rate (half a wave lost on average);
#   device memory (merges around each block): 85% of the spec-sheet HBM bandwidth;
#   NVLink point to point 80% of the per-direction spec, all-to-all 70%; InfiniBand 90%
#   of line rate; NCCL latency 10 us inside a node, 15 us between nodes; 10 us per ring
#   hop to post the transfer and wait for it (kernel launch + stream sync, assumed);
#   causal diagonal blocks compute whole 128-token tiles on the diagonal;
#   host (offload): the PCIe link of each GPU at 80% of its spec per direction (Gen4 x16:
#     32 GB/s, Gen5 x16: 64 GB/s; DGX A100 puts two GPUs behind each PCIe switch, so they
#     share one x16 uplink), 80% of the node's DRAM usable for pinned offload buffers, and
#     60% of the CPUs' spec-sheet memory bandwidth for the CPU optimizer step.
#   nodes=128 (1024 devices) is a planning size, not a real machine's.
_GPU_COMMON = dict(nodes=128, devices_per_node=8, usable_memory_fraction=0.9, causal_tile=128.0, hop_sync_us=10.0)
HBM_FRACTION = 0.85


HOST_LINK_FRACTION = 0.8  # of the PCIe spec per direction
HOST_MEMORY_FRACTION = 0.8  # of the node's DRAM, for pinned offload buffers
HOST_BW_FRACTION = 0.6  # of the CPUs' spec-sheet DRAM bandwidth, for the CPU optimizer step
# DGX H100/H200 (and H800 nodes built like them): 2 x Xeon Platinum 8480C (8 channels of
# DDR5-4800 each: 2 x 307 GB/s), 2 TB DDR5, each GPU on PCIe Gen5 x16 (64 GB/s per direction)
_HOPPER_HOST = dict(
    host_link_gbs=HOST_LINK_FRACTION * 64.0,
    host_memory_gib=HOST_MEMORY_FRACTION * 2048.0,
    host_mem_bw_gbs=HOST_BW_FRACTION * 2 * 307.2,
)


def _hopper(name: str, memory_gib: float, hbm_gbs: float, nvlink_gbs: float, description: str) -> ClusterSpec:
    """An 8-GPU Hopper node (989 TFLOP/s bf16 dense) with 8 x 400 Gb/s NICs and a DGX H100
    host; ``hbm_gbs`` is the spec-sheet memory bandwidth and ``nvlink_gbs`` NVLink per direction."""
    return ClusterSpec(
        name=name,
        device_memory_gib=memory_gib,
        peak_tflops=989.0,
        matmul_tflops=0.70 * 989.0,
        fp8_matmul_tflops=0.70 * 1979.0,  # dense FP8: twice bf16's 989 (spec sheet), the same 70%
        attn_fwd_tflops=695.0,
        attn_bwd_tflops=556.0,
        kernel_overhead_us=68.0,
        kernel_bwd_overhead_us=478.0,
        attn_wave_rows=132 * 128,
        hbm_bw_gbs=HBM_FRACTION * hbm_gbs,
        intra_bw_gbs=0.8 * nvlink_gbs,
        intra_node_bw_gbs=8 * 0.8 * nvlink_gbs,
        intra_latency_us=10.0,
        a2a_bw_gbs=0.7 * nvlink_gbs,
        a2a_latency_us=10.0,
        nics_per_node=8,
        nic_bw_gbs=0.9 * 50.0,
        inter_latency_us=15.0,
        description=description,
        **_HOPPER_HOST,
        **_GPU_COMMON,
    )


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    # NVIDIA A100 SXM4 80GB spec sheet: 312 TFLOP/s bf16 dense, HBM2e 2039 GB/s, NVLink 3
    # 600 GB/s bidirectional (300 GB/s per direction); DGX-A100-like node with 4 x 200 Gb/s
    # HDR InfiniBand NICs (25 GB/s each): the LoongTrain paper's cluster.
    "a100": ClusterSpec(
        name="a100",
        device_memory_gib=80.0,
        peak_tflops=312.0,
        matmul_tflops=0.75 * 312.0,
        attn_fwd_tflops=215.6,  # 69% of peak
        attn_bwd_tflops=182.2,  # 58% of peak
        kernel_overhead_us=20.0,
        attn_wave_rows=108 * 128,
        hbm_bw_gbs=HBM_FRACTION * 2039.0,
        intra_bw_gbs=0.8 * 300.0,
        intra_node_bw_gbs=8 * 0.8 * 300.0,
        intra_latency_us=10.0,
        a2a_bw_gbs=0.7 * 300.0,
        a2a_latency_us=10.0,
        nics_per_node=4,
        nic_bw_gbs=0.9 * 25.0,
        inter_latency_us=15.0,
        # DGX A100: 2 x EPYC 7742 (8 channels of DDR4-3200 each: 2 x 204.8 GB/s), 1 TB DDR4
        # (2 TB optional), two GPUs per PCIe Gen4 switch sharing its x16 uplink (32 GB/s)
        host_link_gbs=HOST_LINK_FRACTION * 32.0 / 2,
        host_memory_gib=HOST_MEMORY_FRACTION * 1024.0,
        host_mem_bw_gbs=HOST_BW_FRACTION * 2 * 204.8,
        description="A100-80GB SXM, 8 per node, NVLink 600 GB/s, 4 x 200 Gb/s IB per node, FlashAttention-2",
        **_GPU_COMMON,
    ),
    # NVIDIA H100 SXM5 80GB: 989 TFLOP/s bf16 dense, HBM3 3350 GB/s; NVLink 4 900 GB/s
    # bidirectional (450 per direction); DGX-H100 node: 8 x 400 Gb/s NDR InfiniBand.
    "h100": _hopper(
        "h100", 80.0, 3350.0, 450.0, "H100-80GB SXM, 8 per node, NVLink 900 GB/s, 8 x 400 Gb/s IB per node, cuDNN/FA3"
    ),
    # NVIDIA H800 SXM5 80GB: H100 compute and memory with NVLink cut to 400 GB/s
    # bidirectional (200 per direction; DeepSeek-V3 report: ~160 GB/s achieved); 8 x 400 Gb/s
    # InfiniBand per node (DeepSeek-V3 report: 50 GB/s per GPU).
    "h800": _hopper(
        "h800", 80.0, 3350.0, 200.0, "H800-80GB SXM, 8 per node, NVLink 400 GB/s, 8 x 400 Gb/s IB per node, cuDNN/FA3"
    ),
    # NVIDIA H200 SXM 141GB (HBM3e 4800 GB/s; ~140 GiB usable by CUDA): H100 compute,
    # NVLink 4 900 GB/s bidirectional, 8 x 400 Gb/s InfiniBand per node.
    "h200": _hopper(
        "h200", 140.0, 4800.0, 450.0, "H200-141GB SXM, 8 per node, NVLink 900 GB/s, 8 x 400 Gb/s IB per node, cuDNN/FA3"
    ),
}

#: Where ``--cluster local`` is looked for (first hit wins): the working directory's
#: ``clusters/``, then the repository's.
LOCAL_NAME = "local"


def _local_candidates() -> list[Path]:
    repo = Path(__file__).resolve().parents[3]
    return [Path.cwd() / "clusters" / "local.toml", repo / "clusters" / "local.toml"]


def default_local_path() -> Path:
    """Where ``--calibrate`` writes the ``local`` cluster by default (the repository's ``clusters/``)."""
    return _local_candidates()[-1]


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError as exc:
            raise PlanError(f"reading {path} needs Python 3.11 (tomllib) or `pip install tomli`") from exc
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"cluster file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise PlanError(f"cannot read cluster file {path}: {exc.strerror}") from None


def cluster_from_dict(data: dict, source: str) -> ClusterSpec:
    """Build a :class:`ClusterSpec` from a file's table, naming unknown, missing and bad keys."""
    unknown = sorted(set(data) - set(CLUSTER_FIELDS))
    if unknown:
        raise PlanError(f"{source}: unknown key(s) {unknown}; known keys: {list(CLUSTER_FIELDS)}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise PlanError(f"{source}: missing key(s) {missing} (see docs/planner.md for their meaning)")
    values = dict(data)
    values.setdefault("name", Path(source).stem)
    try:
        return ClusterSpec(**values)
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from None


def load_cluster_file(path: str | Path) -> ClusterSpec:
    """Read and validate a TOML cluster file."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"cluster file {path} does not exist")
    return cluster_from_dict(_load_toml(path), str(path))


def cluster_spec(name_or_path: str) -> ClusterSpec:
    """A preset (``a100``, ``h100``, ``h800``, ``h200``), ``local`` (calibrated), or a TOML file."""
    if name_or_path in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[name_or_path]
    if name_or_path == LOCAL_NAME:
        for path in _local_candidates():
            if path.is_file():
                return load_cluster_file(path)
        raise PlanError(
            "the 'local' cluster has not been calibrated on this machine: run "
            "`loongtrain plan --calibrate` (it measures gloo and the CPU kernels and writes "
            f"{default_local_path()})"
        )
    if name_or_path.endswith(".toml") or "/" in name_or_path or Path(name_or_path).is_file():
        return load_cluster_file(name_or_path)
    raise PlanError(
        f"unknown cluster {name_or_path!r}; use a preset {sorted(CLUSTER_PRESETS)}, 'local' "
        "(after --calibrate), or the path of a TOML cluster file"
    )


def _toml_value(value) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(float(f"{value:.6g}"))  # six significant digits, always a TOML float
    return str(value)


def cluster_to_toml(spec: ClusterSpec, comments: dict[str, str] | None = None, header: str = "") -> str:
    """TOML text of ``spec``; ``comments`` adds a trailing comment to a key's line."""
    comments = comments or {}
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for key, value in asdict(spec).items():
        if value is None:  # an optional key at its default
            continue
        line = f"{key} = {_toml_value(value)}"
        if key in comments:
            line = f"{line:<40s} # {comments[key]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


#: Hugging Face ``model_type`` s whose shapes the planner reads (the families ``loongtrain.hf`` trains)
HF_MODEL_TYPES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "smollm3": {},
    "olmo3": {"qk_norm": True, "qk_norm_scope": "projection", "norm_placement": "post"},
    "gemma3_text": {"qk_norm": True, "norm_placement": "sandwich", "norm_offset": True, "activation": "gelu_tanh",
                    "embed_scale": True},
}  # fmt: skip


def model_from_folder(folder: str | Path) -> ModelConfig:
    """The shape of a Hugging Face model folder, read from its ``config.json`` with ``json``
    (no transformers): hidden size, layers, heads, KV heads, head dim, FFN, vocabulary, tied
    embeddings, context length, sliding window."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise PlanError(
            f"--model {str(folder)!r} has no config.json: give a Hugging Face model folder "
            f"(transformers' save_pretrained) or a preset {sorted(PRESETS)}"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"--model: {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise PlanError(f"--model: {path} must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise PlanError(
            f"--model: {path} has model_type {model_type!r}; the planner reads {sorted(HF_MODEL_TYPES)} "
            "(Llama-style decoders); give one of those or a preset"
        )
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if not isinstance(raw.get(k), int)]  # fmt: skip
    if missing:
        raise PlanError(f"--model: {path} lacks integer key(s) {missing}")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "smollm3") and not raw.get("use_sliding_window", False):
        window = None
    types = raw.get("layer_types") or []  # a window on the sliding layers only (the planner prices each layer)
    kinds = tuple(LayerKind(int(window or 0) if t == "sliding_attention" else 0) for t in types)
    if kinds and len(set(kinds)) > 1:
        window = None
    try:
        return ModelConfig(
            vocab_size=raw["vocab_size"],
            dim=raw["hidden_size"],
            n_layers=raw["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=raw.get("num_key_value_heads") or heads,
            ffn_dim=raw["intermediate_size"],
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            head_dim_override=0 if head_dim * heads == raw["hidden_size"] else head_dim,
            max_positions=int(raw.get("max_position_embeddings") or 0),
            sliding_window=int(window or 0),
            layer_kinds=kinds if window is None and len(set(kinds)) > 1 else (),
            **HF_MODEL_TYPES[model_type],
        )
    except (TypeError, ValueError) as exc:
        raise PlanError(f"--model: {path} describes no valid model: {exc}") from None


def model_spec(name: str) -> ModelConfig:
    """The model preset ``name`` (:data:`loongtrain.model.config.PRESETS`) or, for a path to a
    folder, the Hugging Face model in it (:func:`model_from_folder`)."""
    if name in PRESETS:
        return PRESETS[name]
    if Path(name).is_dir():
        return model_from_folder(name)
    raise PlanError(
        f"unknown model {name!r}; choose a preset {sorted(PRESETS)} or give a Hugging Face model folder "
        "(a path to a folder with config.json)"
    )
