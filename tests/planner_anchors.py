"""Published measurements the cost model is checked against (tests, docs/planner.md). Pure.

Each anchor names its source, the setting as published, and what the planner predicts for
that setting. The constants of the presets are not fitted to these numbers (their sources
are in ``specs.py`` and docs/planner.md), except where an anchor says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loongtrain.model.config import ModelConfig
from loongtrain.planner.cost import Candidate, Workload, attention_seconds, block_seconds, candidate_topology
from loongtrain.planner.estimate import estimate
from loongtrain.planner.specs import CLUSTER_PRESETS, ClusterSpec

# -- ring-flash-attention: zigzag ring efficiency on one 8-GPU node -----------------------
RING_FLASH_ATTENTION_SOURCE = (
    "zhuzilin/ring-flash-attention README, batch api table, fwd + bwd (iter/sec): zigzag_ring "
    "89.8% of 'theoretic flash_attn' on 8xA100, 90.2% on 8xH800; benchmark/benchmark_kvpacked_func.py: "
    "bf16, batch 1, 8192 tokens per GPU, 32 query heads, 8 KV heads, head dim 128, causal; "
    "'theoretic' = the single-GPU flash_attn_kvpacked_func time of 8192 causal tokens / 8"
)
#: the published efficiencies (fwd + bwd)
RING_FLASH_ATTENTION_EFFICIENCY = {"a100": 0.898, "h800": 0.902}
#: the same table's single-GPU flash_attn (FlashAttention-2) column: iterations/s of one
#: 8192-token causal call, (forward only, forward + backward)
RFA_FLASH_ITERS = {"a100": (373.4, 94.7), "h800": (591.5, 154.7)}

RFA_MODEL = ModelConfig(vocab_size=8, dim=32 * 128, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=8)
RFA_TOKENS_PER_GPU = 8192


def flash_attention2_rates(c: ClusterSpec, fwd_iters: float, both_iters: float) -> tuple[float, float]:
    """``(attn_fwd_tflops, attn_bwd_tflops)`` that make ``c`` run one 8192-token causal call of
    the ring-flash-attention setting at the published ``fwd_iters`` (forward) and
    ``both_iters`` (forward + backward) iterations per second, with ``c``'s per-call
    overheads and block-size efficiency."""
    w = Workload(RFA_MODEL, RFA_TOKENS_PER_GPU)
    unit = replace(c, attn_fwd_tflops=1.0, attn_bwd_tflops=1.0, kernel_overhead_us=1e-9, kernel_bwd_overhead_us=1e-9)
    at_unit_rate = block_seconds(unit, w, 1, 1)  # seconds at 1 TFLOP/s: FLOPs / 1e12 / efficiency
    bwd_overhead = c.bwd_overhead_us
    fwd_s = 1.0 / fwd_iters - c.kernel_overhead_us * 1e-6
    bwd_s = 1.0 / both_iters - 1.0 / fwd_iters - bwd_overhead * 1e-6
    return at_unit_rate.kernel_fwd_first / fwd_s, at_unit_rate.kernel_bwd_first / bwd_s


def ring_flash_attention_clusters() -> dict[str, ClusterSpec]:
    """The clusters of the two published rows, with the FlashAttention-2 rates of that
    table's own single-GPU column (:func:`flash_attention2_rates`): ``a100`` (the preset
    holds exactly these rates) and ``h800`` (whose preset holds the faster cuDNN/FA3 class
    kernel). Only the kernel rates come from the anchor; the ring model does not."""
    out = {}
    for name, (fwd_iters, both_iters) in RFA_FLASH_ITERS.items():
        c = CLUSTER_PRESETS[name]
        fwd, bwd = flash_attention2_rates(c, fwd_iters, both_iters)
        out[name] = replace(c, name=f"{name}-fa2", attn_fwd_tflops=fwd, attn_bwd_tflops=bwd)
    return out


def ring_efficiency(c: ClusterSpec, cp: int = 8, tokens_per_gpu: int = RFA_TOKENS_PER_GPU) -> float:
    """Predicted zigzag ring efficiency as ring-flash-attention defines it: ``cp`` x the
    single-GPU causal attention of ``tokens_per_gpu`` tokens (one kernel call, forward +
    backward) over the ring's forward + backward on ``cp`` GPUs of one node."""
    single = block_seconds(c, Workload(RFA_MODEL, tokens_per_gpu), 1, 1)
    ring_w = Workload(RFA_MODEL, tokens_per_gpu * cp)
    ring = Candidate.of(cp=cp)
    t = attention_seconds(c, ring_w, ring, candidate_topology(c, ring))
    return cp * (single.kernel_fwd_first + single.kernel_bwd_first) / (t.fwd + t.bwd)


# -- TRL: Qwen3-8B on 1M-token sequences, one 8xH100 node ---------------------------------
TRL_SOURCE = (
    "huggingface/trl docs/source/long_context_training.md ('Training Beyond 1M Tokens') and "
    "examples/sft_qwen3_8b_1m_context/: Qwen3-8B, 1,048,576-token sequences, one 8xH100 node, "
    "FSDP2 + context parallelism cp_size=8 (ring attention through PyTorch SDPA), bf16, one sequence "
    "per step, gradient checkpointing (offloaded to host), chunked loss: 380 s/step in the guide's log "
    "(the example's docstring: 373 s/step; huggingface/trl PR #6845: 364 s)"
)
TRL_STEP_SECONDS = 380.0
#: Qwen3-8B (Hugging Face config): 36 layers, hidden 4096, 32 query / 8 KV heads of 128, FFN 12288
QWEN3_8B = ModelConfig(vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288)
#: the run's layout: one ring of 8 over the node, FSDP over all 8, full recompute offloaded to
#: the host, chunked loss
TRL_CANDIDATE = Candidate.of(cp=8, zero="dp_sp", activation_checkpoint="full", offload_activations=True)


@dataclass(frozen=True)
class StepCheck:
    """A predicted optimizer step against a published one."""

    predicted_s: float
    published_s: float

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.published_s


def trl_qwen3_8b_1m(c: ClusterSpec | None = None) -> StepCheck:
    """The planner's step time for the TRL setting (checkpoints offloaded to the host, chunked
    loss, as the run did)."""
    c = c or CLUSTER_PRESETS["h100"]
    e = estimate(c, Workload(QWEN3_8B, 2**20), TRL_CANDIDATE)
    return StepCheck(e.step_s, TRL_STEP_SECONDS)
