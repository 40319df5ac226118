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


def main(args: argparse.Namespace, extra: list[str]) -> None:
    """``loongtrain lm-eval ...``: lm-eval's command line with the loongtrain model type registered."""
    try:
        from lm_eval.__main__ import cli_evaluate

        import loongtrain.tools.lm_eval_model  # noqa: F401 - registers the model type
    except ImportError as e:
        print(f"loongtrain lm-eval: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = ["lm_eval", *extra]
    cli_evaluate()
