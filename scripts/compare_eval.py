"""Compare two `loongtrain eval` outputs (eval.json) of the same weights on two layouts: are
the needle outcomes identical, how far apart are the losses, and did the generated tasks
write the same text?

    python scripts/compare_eval.py runs/x/eval/a/eval.json runs/x/eval/b/eval.json
"""

from __future__ import annotations

import json
import sys


def main(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    oa, ob = a["needles"]["outcomes"], b["needles"]["outcomes"]
    where = [(o["length"], o["depth"], o["sample"], o["key"], o["position"]) for o in oa]
    if where != [(o["length"], o["depth"], o["sample"], o["key"], o["position"]) for o in ob]:
        print("the two evaluations placed different needles (another plan or seed)")
        return 1
    same = [o["correct"] for o in oa] == [o["correct"] for o in ob]
    loss = max(abs(x["answer_loss"] - y["answer_loss"]) / x["answer_tokens"] for x, y in zip(oa, ob))
    print(f"needles: {len(oa)} exact-match outcomes identical: {same}; max |delta answer loss per token| {loss:.2e}")
    if "loss_by_position" in a and "loss_by_position" in b:
        ra, rb = a["loss_by_position"]["rows"], b["loss_by_position"]["rows"]
        d = max(abs(x["mean_loss"] - y["mean_loss"]) for x, y in zip(ra, rb) if x["mean_loss"] is not None)
        print(f"loss by position: {len(ra)} buckets, max |delta mean loss| {d:.2e}")
    for task, ga in a.get("generated", {}).items():
        gb = b.get("generated", {}).get(task)
        if gb is None:
            print(f"{task}: only in {a_path}")
            same = False
            continue
        texts = [o["generated"] for o in ga["outcomes"]] == [o["generated"] for o in gb["outcomes"]]
        print(f"{task}: {len(ga['outcomes'])} generated answers identical: {texts}; "
              f"score {ga['accuracy']:.3f} vs {gb['accuracy']:.3f}")  # fmt: skip
        same = same and texts
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
