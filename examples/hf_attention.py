"""Train a Hugging Face model on loongtrain's 2D head-context attention (the README recipe).

    python examples/hf_attention.py --nproc 4 [--model path/to/hf-folder] [--hp 2 --cp 2]
        [--seq-len 256] [--steps 5] [--check]
    torchrun --nproc-per-node 8 examples/hf_attention.py --model /models/Llama-3.1-8B --hp 4 --cp 2

Without ``--model`` a tiny random Llama is built (nothing is downloaded). Every rank holds
its zigzag shard of each sequence: ``input_ids``, ``position_ids`` (global positions, for
RoPE) and the labels (shifted once over the whole sequence, then sharded). The loss is
divided by the global number of target tokens and the gradients are summed over all ranks,
so they equal the unsharded model's; ``--check`` compares the first step with the same
model run unsharded on one rank. Batches are random tokens: a recipe, not a data pipeline.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import loongtrain as lt
from loongtrain.hf.attention import register_attention
from loongtrain.launch import launch


def build_model(args: argparse.Namespace, device: torch.device):
    import transformers

    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        torch.manual_seed(0)  # the same random weights on every rank
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=args.seq_len,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    return model.to(device)


def global_batch(step: int, batch: int, seq_len: int, vocab: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel replica's full sequences and their next-token labels."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def train_rank(device: torch.device, args: argparse.Namespace) -> None:
    state = lt.init_parallel(lt.ParallelConfig(hp=args.hp, cp=args.cp))
    model = build_model(args, device)
    model.set_attn_implementation(register_attention(state))  # every layer now runs 2D attention
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    for step in range(args.steps):
        tokens, labels = global_batch(step, args.batch, args.seq_len, vocab, state.coords.dp)
        positions = torch.arange(args.seq_len).expand_as(tokens)
        input_ids, position_ids, local_labels = (
            lt.shard_sequence(x, state).to(device) for x in (tokens, positions, labels)
        )
        logits = model(input_ids=input_ids, position_ids=position_ids).logits
        global_targets = labels.numel() * state.dp
        loss = F.cross_entropy(logits.flatten(0, 1).float(), local_labels.flatten(), reduction="sum") / global_targets
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # sum over every rank: each saw other tokens
        total = loss.detach().clone()
        dist.all_reduce(total)
        if step == 0 and args.check:
            check_first_step(args, model, tokens, labels, total.item(), device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {total.item():.4f}", flush=True)


def check_first_step(args, model, tokens, labels, loss: float, device: torch.device) -> None:
    """Rank 0 runs the same model unsharded (sdpa) and compares loss and gradients."""
    if dist.get_rank() != 0:
        return
    if dist.get_world_size() != args.hp * args.cp:
        raise SystemExit("--check needs one data-parallel replica (world size = hp * cp)")
    ref = build_model(args, device)
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("sdpa")
    ref_loss = F.cross_entropy(
        ref(input_ids=tokens.to(device)).logits.flatten(0, 1).float(), labels.to(device).flatten()
    )
    ref_loss.backward()
    worst = max(((p.grad - r.grad).norm() / r.grad.norm()).item() for p, r in zip(model.parameters(), ref.parameters()))
    print(f"check: loss {loss:.6f} vs unsharded {ref_loss.item():.6f}; max gradient rel err {worst:.2e}")
    if abs(loss - ref_loss.item()) > 1e-5 * abs(ref_loss.item()) or worst > 1e-5:
        raise SystemExit("check failed: the 2D attention run differs from the unsharded model")
    print("check: loss and gradients match the unsharded model (within 1e-5)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="local Hugging Face model folder (default: a tiny random Llama)")
    parser.add_argument("--nproc", type=int, default=4, help="local processes (ignored under torchrun)")
    parser.add_argument("--hp", type=int, default=2, help="head-parallel degree")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel degree")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (a multiple of 2*hp*cp)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel replica")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="compare the first step with the unsharded model")
    args = parser.parse_args()
    launch(train_rank, args.nproc, args, device="auto")


if __name__ == "__main__":
    main()
