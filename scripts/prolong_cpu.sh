#!/usr/bin/env bash
# The CPU miniature of ProLong's two stages (docs/stages.md), about 3 minutes on 2 cores: three
# sources made by scripts/make_mixture_data.py (code and books of long documents, short ones),
# what each stage's mixture feeds (loongtrain data-inspect: a table and document_lengths.png), the
# first stage at 256 tokens, the second from its checkpoint at 1024 tokens with a larger RoPE
# base, and the needle grid (256 / 512 / 1K) before and after each stage. Run folders:
# runs/prolong_cpu/stage1 and stage2 (their eval/step-N/needles.png); run again, it resumes.
#   bash scripts/prolong_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/make_mixture_data.py runs/mixture-data
for stage in 1 2; do
  .venv/bin/loongtrain data-inspect --config "configs/prolong_cpu_stage$stage.toml" --out "runs/prolong_cpu/inspect$stage"
  .venv/bin/loongtrain train --config "configs/prolong_cpu_stage$stage.toml" --nproc 4
done
echo
echo "needle retrieval by length (share of needles retrieved; chance 0.125):"
for stage in 1 2; do
  evals=("runs/prolong_cpu/stage$stage"/eval/step-*)
  for folder in "$(ls -d "${evals[@]}" | sort -t- -k2 -n | head -1)" "$(ls -d "${evals[@]}" | sort -t- -k2 -n | tail -1)"; do
    printf "  stage %s %-9s %s\n" "$stage" "$(basename "$folder")" "$(grep -E '^(depth|all) ' "$folder/needles.txt" | tr '\n' ' ')"
  done
done
