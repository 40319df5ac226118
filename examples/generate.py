"""Load an exported folder with plain ``transformers`` (no loongtrain code) and generate.

    python examples/generate.py runs/extend_cpu/hf --prompt "The ring" [--tokens 24]
    python examples/generate.py runs/smollm2_chat/hf --chat --prompt "What is the capital of France?"
    python examples/generate.py runs/smollm2_chat/hf --chat-jsonl runs/chat/eval.jsonl --record 0

``--chat`` renders the prompt as one user turn with the tokenizer's chat template (and the
assistant's generation prompt). ``--chat-jsonl`` takes a record of a chat JSONL (such as
``scripts/make_chat_data.py`` writes) instead: its turns before the last assistant turn are
the prompt; the script prints the expected answer, the loss per answer token under teacher
forcing, and the greedy answer.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def chat_record(path: str, index: int) -> tuple[list[dict], str]:
    """The turns of record ``index`` before its last assistant turn, and that turn's content."""
    with open(path, encoding="utf-8") as f:
        line = [row for row in f if row.strip()][index]
    messages = json.loads(line)["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], messages[last]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a Hugging Face model folder (e.g. written by `loongtrain export`)")
    parser.add_argument("--prompt", default="The ring")
    parser.add_argument("--chat", action="store_true", help="send --prompt as a user turn through the chat template")
    parser.add_argument("--chat-jsonl", default=None, help="a chat JSONL file: answer one of its records")
    parser.add_argument("--record", type=int, default=0, help="--chat-jsonl: which record (0-based)")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens to generate (greedy)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.folder, local_files_only=True)
    model.eval()
    config = model.config
    print(f"{config.model_type}: max_position_embeddings {config.max_position_embeddings}, "
          f"rope {config.rope_parameters}")  # fmt: skip
    expected = None
    if args.chat_jsonl:
        messages, expected = chat_record(args.chat_jsonl, args.record)
    elif args.chat:
        messages = [{"role": "user", "content": args.prompt}]
    if args.chat or args.chat_jsonl:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    print(f"prompt: {ids.shape[1]} tokens")
    with torch.no_grad():
        if expected is not None:
            end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
            answer = tokenizer(expected, add_special_tokens=False, return_tensors="pt").input_ids
            if end is not None:
                answer = torch.cat([answer, torch.tensor([[end]])], dim=1)
            full = torch.cat([ids, answer], dim=1)
            logits = model(input_ids=full).logits[0, ids.shape[1] - 1 : -1]
            loss = torch.nn.functional.cross_entropy(logits.float(), answer[0]).item()
            print(f"expected: {expected!r}\nloss per answer token (teacher forcing): {loss:.4f}")
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, do_sample=False
        )
    answer_text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"answer ({time.perf_counter() - start:.1f} s): {answer_text!r}")
    if expected is not None:
        print(f"exact match: {answer_text.strip() == expected.strip()}")


if __name__ == "__main__":
    main()
