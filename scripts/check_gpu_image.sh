#!/usr/bin/env bash
# Run the unit and dist test subsets, the commands' multi-process path (a 4-process training
# under the elastic launcher, its evaluation with generated tasks) and the GPU check's CPU
# paths under the GPU machine's software (Python 3.12, torch 2.11.0), in a side environment
# .venv-gpu-image (made once).
# PyPI's torch 2.11.0 wheel is a CUDA build (a few GB with its nvidia packages) that runs
# on the CPU. Set PYTHON to a Python 3.12 (default python3.12); extra arguments go to pytest.
#   PYTHON=python3.12 bash scripts/check_gpu_image.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.12}
TORCH_VERSION=${GPU_IMAGE_TORCH:-2.11.0}
venv=.venv-gpu-image
stamp=$venv/.loongtrain-setup-$TORCH_VERSION
if [ ! -x $venv/bin/python ]; then
  "$PYTHON" -m venv $venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setting up $venv (torch==$TORCH_VERSION, loongtrain editable) ..." >&2
  $venv/bin/python -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy
  $venv/bin/python -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" -e ".[dev,hf,tensorboard]"
  touch "$stamp"
fi
$venv/bin/python -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")'
$venv/bin/python -m pytest -m "unit or dist" -q "$@"
run=$(mktemp -d "${TMPDIR:-/tmp}/loongtrain-image-run.XXXXXX")
$venv/bin/python -m loongtrain train --config configs/debug_cpu.toml --nproc 4 --run.steps 10 \
  --run.output_dir "$run" --eval.every 0 --run.progress off
$venv/bin/python -m loongtrain eval "$run" --nproc 4 --eval.generated all --eval.lengths 64,128 --eval.depths 2
rm -rf "$run"
LOONGTRAIN_PYTHON=$venv/bin/python bash scripts/gpu_check.sh --device cpu --json "${TMPDIR:-/tmp}/gpu_check_image.json"
