"""``loongtrain lm-eval``: lm-evaluation-harness's own command line (``lm_eval``, 0.4.x) with
the ``loongtrain`` model type registered first (lm-eval 0.4 finds a third-party model type only
once its module is imported: :mod:`loongtrain.tools.lm_eval_model`).

    loongtrain lm-eval --model loongtrain --model_args path=RUN_OR_HF_FOLDER,nproc=4 --tasks TASK

Needs the ``lm-eval`` extra (``pip install -e '.[lm-eval]'``; it does not install torch).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "The arguments of lm-eval's own command line (lm_eval --help); --model loongtrain runs loongtrain."


#: model_args shortcuts for config keys
SHORTCUTS = {
    "hp": "parallel.hp", "cp": "parallel.cp", "ring_window": "parallel.ring_window", "dtype": "parallel.param_dtype"
}  # fmt: skip
#: the loongtrain model type's own model_args (the others are config keys)
MODEL_ARGS = ("path", "nproc", "step", "tokenizer", "max_length", "max_gen_toks", "add_bos_token", "batch_size",
              "max_batch_size", "device")  # fmt: skip


def config_overrides(kwargs: dict) -> list[str]:
    """``model_args`` beyond the model type's own: config keys (``parallel.cp=4``) or shortcuts."""
    from loongtrain.config import ConfigError

    out = []
    for key, value in kwargs.items():
        key = SHORTCUTS.get(key, key)
        if "." not in key:
            raise ConfigError(
                f"model_args {key}={value}: not an argument of the loongtrain model type (path, nproc, step, "
                f"tokenizer, max_length, max_gen_toks, add_bos_token) nor a config key (section.key, e.g. parallel.cp)"
            )
        out.append(f"{key}={value}")
    return out


def _option(extra: list[str], name: str) -> str | None:
    for i, arg in enumerate(extra):
        if arg == name and i + 1 < len(extra):
            return extra[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def check_model_args(extra: list[str]) -> None:
    """With ``--model loongtrain``: check its ``--model_args`` (the folder, the layout against the
    model: heads vs hp, sequence length vs cp, ...) as the model type will, before lm-eval is
    imported, so that a bad layout is one line, not lm-eval's traceback. Raises ConfigError."""
    from loongtrain.config import ConfigError

    if _option(extra, "--model") != "loongtrain":
        return
    text = _option(extra, "--model_args") or ""
    kwargs = dict(item.split("=", 1) if "=" in item else (item, "") for item in text.split(",") if item.strip())
    if "path" not in kwargs:
        raise ConfigError("--model loongtrain needs --model_args path=RUN_OR_HF_FOLDER[,nproc=N,hp=...]")
    from loongtrain.eval.jobs import resolve_target

    nproc = int(kwargs.get("nproc", 1))
    step = int(kwargs["step"]) if kwargs.get("step") else None
    overrides = config_overrides({k: v for k, v in kwargs.items() if k not in MODEL_ARGS})
    resolve_target(kwargs["path"], overrides, nproc, nproc, step=step)


def main(args: argparse.Namespace, extra: list[str]) -> None:
    """``loongtrain lm-eval ...``: lm-eval's command line with the loongtrain model type registered."""
    from loongtrain.train.checkpoint import CheckpointError

    try:
        check_model_args(extra)
    except (ValueError, CheckpointError) as e:  # ConfigError, TokenFileError: one line, before lm-eval starts
        print(f"loongtrain lm-eval: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        from lm_eval.__main__ import cli_evaluate

        import loongtrain.tools.lm_eval_model  # noqa: F401 - registers the model type
    except ImportError as e:
        print(f"loongtrain lm-eval: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = ["lm_eval", *extra]
    cli_evaluate()
