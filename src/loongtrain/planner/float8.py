"""What FP8 training (``[float8]``, torchao's float8 linears) changes in the planner's prices.

The transformer blocks' linears (q, k, v, o, w1, w2, w3) run their matmuls in float8 at the
cluster's ``fp8_matmul_tflops`` (Hopper: dense FP8 is twice bf16); the output layer, the
attention and everything elementwise keep their cost. On top come the casts: each float8
operand is read once for its amax and once to cast, and written in one byte
(:data:`CAST_BYTES` per element, at the device's memory bandwidth; a compiled step fuses
some of them, so this is the unfused upper bound). ``rowwise`` casts the output gradient
along both of its axes; ``rowwise_with_gw_hp`` keeps the weight gradient's matmul in bf16.
The float8 all-gather (``tensorwise`` only) gathers the blocks' weights in one byte, half of
bf16's; gathered, they take half the memory. Each matmul's float8 copies of its operands are
transient (torchao saves the high-precision tensors for backward and casts again there).
"""

from __future__ import annotations

from loongtrain.model.config import ModelConfig
from loongtrain.options import FLOAT8_RECIPES

#: bytes moved per element cast to float8: two reads of the bf16 input (amax, then the cast) and one byte written
CAST_BYTES = 5.0


def check_float8_recipe(recipe: str, all_gather: bool) -> None:
    """Raise ValueError for an unknown recipe ("" is off) or the float8 all-gather off ``tensorwise``."""
    if recipe and recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8 recipe {recipe!r}; choose one of {list(FLOAT8_RECIPES)} (or none)")
    if all_gather and recipe != "tensorwise":
        raise ValueError("the float8 all-gather sends one scale per weight: it needs the tensorwise recipe")


def block_linears(m: ModelConfig) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of one block's linears (what float8 converts)."""
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return [
        (q, m.dim),
        (kv, m.dim),
        (kv, m.dim),
        (m.dim, q),
        (m.ffn_dim, m.dim),
        (m.ffn_dim, m.dim),
        (m.dim, m.ffn_dim),
    ]


def cast_elements(m: ModelConfig, tokens: float, recipe: str) -> tuple[float, float]:
    """Elements cast to float8 in one layer's forward and backward for ``tokens`` tokens of this rank:
    forward each input and weight; backward each output gradient (twice, along both axes, for the
    rowwise recipes), each weight again and, unless the weight gradient is in high precision,
    each input again for it."""
    linears = block_linears(m)
    weights = sum(n * k for n, k in linears)
    inputs = tokens * sum(k for _, k in linears)
    grads = tokens * sum(n for n, _ in linears)
    forward = inputs + weights
    backward = grads * (2 if recipe.startswith("rowwise") else 1) + weights
    backward += 0.0 if recipe == "rowwise_with_gw_hp" else inputs
    return forward, backward


def cast_seconds(m: ModelConfig, tokens: float, recipe: str, hbm_gbs: float) -> tuple[float, float]:
    """Seconds of one layer's float8 casts (forward, backward) at ``hbm_gbs`` GB/s (0: not modelled)."""
    if not recipe or hbm_gbs <= 0:
        return 0.0, 0.0
    forward, backward = cast_elements(m, tokens, recipe)
    return forward * CAST_BYTES / (hbm_gbs * 1e9), backward * CAST_BYTES / (hbm_gbs * 1e9)


def copies_bytes(m: ModelConfig, tokens: float, recipe: str) -> float:
    """The float8 copies alive at once in a layer's backward: the largest linear's output
    gradient (both axes for rowwise), weight and, unless in high precision, input."""
    if not recipe:
        return 0.0
    out = 0.0
    for n, k in block_linears(m):
        grads = tokens * n * (2 if recipe.startswith("rowwise") else 1)
        inputs = 0.0 if recipe == "rowwise_with_gw_hp" else tokens * k
        out = max(out, grads + n * k + inputs)
    return out
