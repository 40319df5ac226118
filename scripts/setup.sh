#!/usr/bin/env bash
# Create .venv once (again when pyproject.toml or this file changes) with the pinned
# PyTorch and loongtrain installed in editable mode. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0  # the CPU wheel of this version lies on the dev machines' disk
stamp=.venv/.loongtrain-setup
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  echo "setting up .venv (torch==$TORCH_VERSION, loongtrain editable) ..." >&2
  # torch first and pinned, so nothing below can pull another (multi-GB) build
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" -e ".[dev,hf,tensorboard,wandb,mlflow,fp8]"  # torch named again: the extras must not replace it
  touch "$stamp"
fi
