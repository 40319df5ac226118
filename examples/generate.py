"""Load an exported folder with plain ``transformers`` (no loongtrain code) and generate.

python examples/generate.py runs/extend_cpu/hf --prompt "The ring" [--tokens 24]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a Hugging Face model folder (e.g. written by `loongtrain export`)")
    parser.add_argument("--prompt", default="The ring")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens to generate (greedy)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.folder, local_files_only=True)
    config = model.config
    print(f"{config.model_type}: max_position_embeddings {config.max_position_embeddings}, "
          f"rope {config.rope_parameters}")  # fmt: skip
    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.tokens, do_sample=False)
    print(repr(tokenizer.decode(out[0], skip_special_tokens=True)))


if __name__ == "__main__":
    main()
