"""Independent references: float64 attention written out with einsum and softmax."""

from __future__ import annotations

import torch


def visibility(seq: int, cu_seqlens=None, causal: bool = True, window: int | None = None) -> torch.Tensor:
    """[S, S] bool: query i sees key j (same document, j <= i if causal, |i - j| < window)."""
    pos = torch.arange(seq)
    bounds = list(cu_seqlens) if cu_seqlens is not None else [0, seq]
    doc = torch.zeros(seq, dtype=torch.long)
    for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
        doc[a:b] = d
    i, j = pos[:, None], pos[None, :]
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (i - j).abs() < window
    return keep


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Full attention in float64. q [B,S,H,d], k/v [B,S,G,d] -> [B,S,H,d] (float64).

    ``keep`` ([Sq, Sk] bool, e.g. from :func:`visibility`) replaces the causal mask."""
    q, k, v = q.double(), k.double(), v.double()
    heads, groups = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // groups, dim=2)
    v = v.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if keep is None and causal:
        sq, sk = q.shape[1], k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
    if keep is not None:
        scores = scores.masked_fill(~keep.to(q.device), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)


def reference_lse(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Log-sum-exp of the scores in float64, [B, S, H]."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bqhk", q, k) * scale
    if causal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    return scores.logsumexp(dim=-1)


def rel_errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(norm-relative error, max-abs error relative to max |ref|)."""
    got, ref = got.double(), ref.double()
    diff = got - ref
    return (diff.norm() / ref.norm()).item(), (diff.abs().max() / ref.abs().max()).item()


def attention_with_grads(q, k, v, dout, causal: bool, scale: float, keep: torch.Tensor | None = None):
    """float64 reference output and (dq, dk, dv) for upstream gradient ``dout``."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, causal, scale, keep)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy (float32) of full logits over labels != -100: the
    reference the model's chunked loss is compared with."""
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def reference_logits(model, tokens: torch.Tensor, positions: torch.Tensor, windows, ropes) -> torch.Tensor:
    """The logits of a loongtrain ``Transformer`` written out in float64 from its weights, layer
    ``i`` with sliding window ``windows[i]`` (0: full causal) and RoPE ``ropes[i]``: ``(theta,
    linear factor)`` (the complex rotation by ``position / factor * theta^(-2j/d)``) or None."""
    p = {name: t.detach().double() for name, t in model.named_parameters()}
    cfg = model.config
    seq, d = tokens.shape[1], cfg.head_dim

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(x, theta, factor):
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angle = (positions.double() / factor)[..., None] * inv
        z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)[:, :, None]).flatten(-2)

    h = p["tok_embeddings.weight"][tokens]
    for i, (window, rp) in enumerate(zip(windows, ropes)):
        pre = f"layers.{i}."
        x = norm(h, p[pre + "attention_norm.weight"])
        q = (x @ p[pre + "attention.wq.weight"].T).unflatten(-1, (cfg.n_heads, d))
        k = (x @ p[pre + "attention.wk.weight"].T).unflatten(-1, (cfg.n_kv_heads, d))
        v = (x @ p[pre + "attention.wv.weight"].T).unflatten(-1, (cfg.n_kv_heads, d))
        if rp is not None:
            q, k = rope(q, *rp), rope(k, *rp)
        out = reference_attention(q, k, v, True, d**-0.5, visibility(seq, None, True, window or None))
        h = h + out.flatten(-2) @ p[pre + "attention.wo.weight"].T
        x = norm(h, p[pre + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(x @ p[pre + "feed_forward.w1.weight"].T)
        h = h + (gate * (x @ p[pre + "feed_forward.w3.weight"].T)) @ p[pre + "feed_forward.w2.weight"].T
    out_w = p["tok_embeddings.weight"] if cfg.tie_embeddings else p["output.weight"]
    return norm(h, p["norm.weight"]) @ out_w.T


def torchao_float8(model: torch.nn.Module, recipe: str) -> torch.nn.Module:
    """``model`` (a transformers causal LM) with its linears converted to float8 training by
    torchao itself (``recipe``, emulated): every linear but ``lm_head`` whose dims are multiples
    of 16, the rule loongtrain states (docs/fp8.md). In place; returns ``model``."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    keep = lambda m, fqn: fqn != "lm_head" and m.in_features % 16 == 0 and m.out_features % 16 == 0  # noqa: E731
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return model
