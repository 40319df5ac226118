#!/usr/bin/env bash
# The CPU miniature of ProLong's two stages (docs/stages.md), about 3 minutes on 2 cores: three
# sources made by scripts/make_mixture_data.py (code and books of long documents, short ones),
# what each stage's mixture feeds (loongtrain data-inspect: a table and document_lengths.png), the
# first stage at 256 tokens, the second from its checkpoint at 1024 tokens with a larger RoPE
# base, and the needle grid (256 / 512 / 1K) before and after each stage. Run folders:
# runs/prolong_cpu/stage1 and stage2 (their eval/step-N/needles.png); run again, it resumes.
#   bash scripts/prolong_cpu.sh
# SEEDS="0 1 2" runs the two stages once per seed (initial weights and data order; seed 0 is the
# configs' own: runs/prolong_cpu/stage1, stage2; seed N: runs/prolong_cpu/seed-N/...), about
# 3 minutes each, and prints each seed's retrieval and the spread over the seeds: the miniature's
# numbers move with the float rounding of the machine as they do with the seed.
#   SEEDS="0 1 2 3 4" bash scripts/prolong_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/make_mixture_data.py runs/mixture-data
SEEDS=${SEEDS:-0}
for stage in 1 2; do
  .venv/bin/loongtrain data-inspect --config "configs/prolong_cpu_stage$stage.toml" --out "runs/prolong_cpu/inspect$stage"
done
folder_of() {  # seed -> its run folder prefix
  if [ "$1" = 0 ]; then echo runs/prolong_cpu; else echo "runs/prolong_cpu/seed-$1"; fi
}
for seed in $SEEDS; do
  out=$(folder_of "$seed")
  seeded=()
  [ "$seed" = 0 ] || seeded=(--run.seed "$seed" --data.seed "$seed")
  .venv/bin/loongtrain train --config configs/prolong_cpu_stage1.toml --nproc 4 --run.output_dir "$out/stage1" "${seeded[@]}"
  .venv/bin/loongtrain train --config configs/prolong_cpu_stage2.toml --nproc 4 --run.output_dir "$out/stage2" \
    --checkpoint.init_from "$out/stage1" "${seeded[@]}"
done
echo
echo "needle retrieval by length (share of needles retrieved; chance 0.125):"
for seed in $SEEDS; do
  out=$(folder_of "$seed")
  first=1
  for stage in 1 2; do
    evals=("$out/stage$stage"/eval/step-*)
    for folder in "$(ls -d "${evals[@]}" | sort -t- -k2 -n | head -1)" "$(ls -d "${evals[@]}" | sort -t- -k2 -n | tail -1)"; do
      if [ $first = 1 ]; then  # the lengths once, above the numbers
        printf "  %-24s %s\n" "" "$(grep -E '^depth ' "$folder/needles.txt" | cut -c6-)"
        first=0
      fi
      printf "  seed %s stage %s %-9s %s\n" "$seed" "$stage" "$(basename "$folder")" \
        "$(grep -E '^all ' "$folder/needles.txt" | cut -c6-)"
    done
  done
done
if [ "$(echo $SEEDS | wc -w)" -gt 1 ]; then
  folders=()
  for seed in $SEEDS; do folders+=("$(folder_of "$seed")"); done
  .venv/bin/python - "${folders[@]}" <<'EOF'
import json
import sys
from pathlib import Path

# each seed's long-context records (eval.every: before the first step and after the last)
rows = {}
for folder in sys.argv[1:]:
    for stage in (1, 2):
        lines = (Path(folder) / f"stage{stage}" / "metrics.jsonl").read_text().splitlines()
        evals = [r for r in map(json.loads, lines) if r.get("kind") == "long_context"]
        for when, record in (("before", evals[0]), ("after", evals[-1])):
            for key, value in record.items():
                if key.startswith("needle_accuracy_"):
                    rows.setdefault((stage, when, key[len("needle_accuracy_") :]), []).append(value)
print(f"\nover {len(sys.argv) - 1} seeds: mean (min - max)")
for (stage, when, length), values in rows.items():
    mean = sum(values) / len(values)
    print(f"  stage {stage} {when:<6} {length:>5}: {mean:.2f} ({min(values):.2f} - {max(values):.2f})")
EOF
fi
