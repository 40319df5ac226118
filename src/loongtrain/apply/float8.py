"""FP8 training of the transformer blocks' linear layers with torchao (torchtitan's recipe).

:func:`apply_float8` swaps the blocks' ``nn.Linear`` modules for torchao's ``Float8Linear``
(``convert_to_float8_training``) on the meta model, first in ``parallelize``: before
activation checkpointing, ``torch.compile`` and FSDP2 wrap them, so the recompute, the
compiled graph and ZeRO all see the float8 modules. The weights stay high-precision
parameters under their own names (checkpoints, HF import and export are unchanged); only
the matmuls cast their operands to float8 with dynamic scales. Attention, norms, RoPE, the
ring, the embedding and the output layer + loss keep the compute dtype.

Which linears are converted is :func:`exclusion_reason` (pure): never the output layer,
never a linear whose dims are not multiples of 16 (FP8 matmul kernels need them), not the
ones the user's ``filter_fqns`` name, and with ``auto_filter_small_kn`` not the ones
torchao's size heuristics (measured on H100) expect no gain from.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from torch import nn

from loongtrain.options import Float8Options
from loongtrain.torch_support import release

#: the torchao releases whose float8 training API this module is written against
TORCHAO_MIN = (0, 18)
INSTALL = "pip install 'torchao>=0.18,<0.19' torch==<your torch version> (or: pip install -e '.[fp8]')"
#: the model's output layer: its matmul feeds the loss, kept in the compute dtype
OUTPUT_LAYER = "output"


#: loggers that warn once at torchao's import: CUDA extensions a CPU build cannot load, an enum
#: registration torch 2.13 deprecates (neither concerns the float8 training path)
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def require_torchao():
    """The ``torchao`` module, or ValueError naming the install command when it is missing or
    older than 0.18. Its import-time warnings about CUDA extensions a CPU build cannot load
    are silenced (the float8 training path is pure Python)."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ValueError(f"float8.enabled needs torchao >= 0.18, which is not installed ({e}): {INSTALL}") from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    if release(torchao.__version__) < TORCHAO_MIN:
        raise ValueError(f"float8.enabled needs torchao >= 0.18, found {torchao.__version__}: {INSTALL}")
    return torchao


def auto_filter_keeps(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether torchao's size heuristics (``_auto_filter_for_recipe``; its thresholds, measured on
    H100) expect a float8 gain for a linear of weight ``[out_features, in_features]``: tensorwise
    needs ``K > 4096 or N > 1024``; the rowwise recipes ``N > 2048, K > 1024`` and not both
    ``N <= 4096, K <= 2048`` (torchao has no heuristic of its own for ``rowwise_with_gw_hp``:
    rowwise's)."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)


def exclusion_reason(fqn: str, out_features: int, in_features: int, options: Float8Options) -> str | None:
    """Why the linear ``fqn`` (weight ``[out_features, in_features]``) stays in high precision
    under ``options``, in words, or None when it is converted to float8."""
    if fqn == OUTPUT_LAYER or fqn.endswith("." + OUTPUT_LAYER):
        return "output layer"
    if out_features % 16 or in_features % 16:
        return f"dims {out_features}x{in_features} not multiples of 16"
    named = [part for part in options.fqn_filters() if part in fqn]
    if named:
        return f"filter_fqns {named[0]!r}"
    if options.auto_filter_small_kn and not auto_filter_keeps(options.recipe_name, out_features, in_features):
        return "auto_filter_small_kn (too small to gain)"
    return None


@dataclass(frozen=True)
class Float8Plan:
    """Which linears of a model are float8 and which were left out (name -> reason)."""

    recipe: str
    converted: tuple[str, ...]
    left_out: dict[str, str]

    def describe(self) -> str:
        """The start-up line: the recipe, how many linears are float8, and each one left out with why."""
        text = f"float8 ({self.recipe}): {len(self.converted)} linear(s) in float8"
        if self.left_out:
            by_reason: dict[str, list[str]] = {}
            for name, reason in self.left_out.items():
                by_reason.setdefault(reason, []).append(name)
            text += "; kept in high precision: " + "; ".join(
                f"{_names(names)} ({reason})" for reason, names in by_reason.items()
            )
        return text


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} and {len(names) - 3} more"


def float8_plan(model: nn.Module, options: Float8Options) -> Float8Plan:
    """Which linears of ``model`` (on any device, meta included) :func:`apply_float8` converts."""
    converted, left_out = [], {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason = exclusion_reason(fqn, module.out_features, module.in_features, options)
        if reason is None:
            converted.append(fqn)
        else:
            left_out[fqn] = reason
    return Float8Plan(options.recipe_name, tuple(converted), left_out)


def empty_plan_warning(plan: Float8Plan) -> str | None:
    """A one-line warning when the filters leave no linear in float8 (the run would train in high
    precision under a float8 flag), or None."""
    if plan.converted:
        return None
    return (
        f"warning: float8.enabled but no linear is converted ({plan.describe()}): loosen float8.filter_fqns or "
        f"float8.auto_filter_small_kn, or set float8.enabled=false"
    )


def linear_config(options: Float8Options):
    """torchao's ``Float8LinearConfig`` for ``options`` (its recipe, ``emulate`` and the float8
    all-gather)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(options.recipe_name)
    return dataclasses.replace(
        config, emulate=options.emulate, enable_fsdp_float8_all_gather=options.enable_fsdp_float8_all_gather
    )


def apply_float8(model: nn.Module, options: Float8Options) -> Float8Plan | None:
    """Swap ``model``'s linears for torchao's float8 modules as :func:`float8_plan` says (in
    place; the model may be on meta); None when ``options.enabled`` is false. ``model.float8_plan``
    keeps the plan (for the start-up line)."""
    if not options.enabled:
        model.float8_plan = None
        return None
    require_torchao()
    from torchao.float8 import convert_to_float8_training

    plan = float8_plan(model, options)
    chosen = set(plan.converted)
    convert_to_float8_training(model, config=linear_config(options), module_filter_fn=lambda module, fqn: fqn in chosen)
    model.float8_plan = plan
    model.float8_precompute = options.precompute_float8_dynamic_scale_for_fsdp
    return plan


def float8_modules(model: nn.Module) -> list[str]:
    """Names of ``model``'s modules that compute in float8 (torchao's ``Float8Linear``)."""
    return [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]


def precompute_scales(model: nn.Module) -> None:
    """After ``optimizer.step()`` (and a checkpoint load): where the model's float8 all-gather
    precomputes its scales, every sharded weight's scale in one op (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``); nothing otherwise."""
    if getattr(model, "float8_precompute", False):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def uses_float8(model: nn.Module) -> bool:
    """Whether ``model`` holds float8 linears (the memory-lean projections must not bypass them)."""
    return bool(getattr(model, "float8_plan", None))


__all__ = [
    "Float8Plan",
    "apply_float8",
    "auto_filter_keeps",
    "empty_plan_warning",
    "exclusion_reason",
    "float8_modules",
    "float8_plan",
    "linear_config",
    "precompute_scales",
    "require_torchao",
    "uses_float8",
]
