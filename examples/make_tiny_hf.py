"""Write a tiny random Hugging Face Llama and a BPE tokenizer trained on local text
into a folder, as a stand-in for a downloaded checkpoint (nothing is downloaded).

    python examples/make_tiny_hf.py -o runs/tiny-hf [--text README.md docs src] [--context 128] [--family olmo3]

The folder is what ``transformers``' ``save_pretrained`` writes (config.json,
model.safetensors, generation_config.json, tokenizer files), so ``[model] init_from``
and ``loongtrain prepare --tokenizer`` take it like any local Llama checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SUFFIXES = (".md", ".py", ".txt", ".toml")


def text_files(inputs: list[str]) -> list[str]:
    files = []
    for item in inputs:
        path = Path(item)
        files += sorted(str(p) for p in path.rglob("*") if p.suffix in SUFFIXES) if path.is_dir() else [str(path)]
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", required=True, help="folder to write (must not exist)")
    parser.add_argument("--text", nargs="+", default=["README.md", "docs", "src"], help="text to train the tokenizer")
    parser.add_argument("--vocab", type=int, default=512, help="tokenizer vocabulary size")
    parser.add_argument("--context", type=int, default=128, help="max_position_embeddings (the 'pretrained' context)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--family", choices=["llama", "olmo3"], default="llama",
        help="llama, or olmo3: OLMo 3's blocks with three sliding layers (window 32) for each full one",
    )  # fmt: skip
    args = parser.parse_args()
    out = Path(args.output)
    if out.exists():
        raise SystemExit(f"{out} already exists; choose a new folder")

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train(text_files(args.text), trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )

    torch.manual_seed(args.seed)
    shape = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.context,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    if args.family == "olmo3":
        config = transformers.Olmo3Config(**shape, sliding_window=32, pad_token_id=None)  # layer_types 3:1
    else:
        config = transformers.LlamaConfig(**shape)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote a tiny random {args.family} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"vocabulary {len(tokenizer)}, context {args.context}) to {out}")  # fmt: skip


if __name__ == "__main__":
    main()
