"""``loongtrain train``: config file + overrides -> preflight -> every rank trains."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from loongtrain.config import ConfigError, describe, load_config
from loongtrain.data.tokens import TokenFileError
from loongtrain.launch import launch, under_torchrun
from loongtrain.train.checkpoint import CheckpointError
from loongtrain.train.trainer import preflight, train

USER_ERRORS = (ConfigError, TokenFileError, CheckpointError)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (see configs/); keys not given keep their defaults")
    parser.add_argument(
        "--nproc", type=int, default=1, help="local processes to spawn (ignored under torchrun, which sets it)"
    )
    parser.add_argument("--help-config", action="store_true", help="list every config key with its help and exit")
    parser.epilog = "Any config key can be overridden: --section.key value (e.g. --run.steps 50 --parallel.hp 2)."


def split_overrides(extra: list[str]) -> list[str]:
    """``['--run.steps', '5', '--data.seq_len=64']`` -> ``['run.steps=5', 'data.seq_len=64']``."""
    out, i = [], 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {item!r}; overrides look like --section.key value")
        if "=" in item:
            out.append(item[2:])
            i += 1
        elif i + 1 < len(extra):
            out.append(f"{item[2:]}={extra[i + 1]}")
            i += 2
        else:
            raise ConfigError(f"override {item!r} has no value")
    return out


def _train_rank(device: torch.device, cfg, plan) -> None:
    train(device, cfg, plan)


def main(args: argparse.Namespace, extra: list[str]) -> None:
    if args.help_config:
        print(describe())
        return
    try:
        cfg = load_config(args.config, split_overrides(extra))
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
        plan = preflight(cfg, world)
    except USER_ERRORS as e:
        print(f"loongtrain train: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    launch(_train_rank, args.nproc, cfg, plan, device=cfg.run.device)
