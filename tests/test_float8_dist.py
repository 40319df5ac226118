"""FP8 training whose result does not depend on the parallel layout.

With torchao's ``rowwise_with_gw_hp`` recipe every float8 scale is per token or per weight
row and the weight gradient stays in high precision, so sharding the tokens over hp x cp
ranks (2D attention, the double ring, ZeRO scopes, packed documents, sc++, microbatches)
must give the loss, every gradient and the parameters after an AdamW step of one process
running the same float8 model. The reference is independent of loongtrain: transformers'
``LlamaForCausalLM`` with the same weights, converted by torchao itself with the same recipe
and filter (every block linear; ``lm_head`` kept), its attention a dense fp32 softmax under
the document mask, on one process.

The only differences left are float8 roundings that flip where fp32 sums were added in
another order (a ring merges attention blocks, one process does not). The bound is a floor
measured in the same body, the largest of: the reference against itself with its attention
computed as 2, 3 and 4 key blocks merged by their log-sum-exp instead of one call; the
reference with every weight moved by at most one fp32 ulp (a value on a float8 rounding
boundary flips under any fp32-sized change: on one world-8 batch a single such flip moves a
norm weight's gradient by 8e-3, in the reference as in every layout); and the same layout
without float8 against the reference without float8 (the layout's own fp32 reordering: its
gradient reductions, which no perturbation of the reference reproduces; AdamW's first step
turns it into parameter differences where gradients are tiny). Each layout lands within 4x
that floor; ``tensorwise``, whose scales follow each rank's shard, lands orders of magnitude
above it (the control test).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from loongtrain.apply import Float8Options, MemoryOptions, materialize, parallelize
from loongtrain.data.batch import Microbatch
from loongtrain.model import build_model, model_config
from loongtrain.model.llama import init_value
from loongtrain.train.step import forward_backward

from dist_pool import cached_state
from reference import lm_loss_sum, torchao_float8, visibility

pytest.importorskip("torchao", reason="FP8 training needs torchao: pip install -e '.[fp8]'")
pytest.importorskip("transformers", reason="the float8 reference is transformers' Llama")

SEED = 11
RECIPE = "rowwise_with_gw_hp"
ADAMW = dict(lr=3e-3, weight_decay=0.1, eps=1e-6)
ATTENTION = "float8_reference_attention"
_MASK: dict = {}  # the current batch's visibility and how many key blocks the reference attention merges


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: [B, H, S, d] -> ([B, S, H, d], None), fp32, under the
    batch's document mask; with ``blocks > 1`` the keys in that many blocks, merged by log-sum-exp."""
    keep, blocks = _MASK["keep"], _MASK["blocks"]
    rep = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    if blocks == 1:
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=keep, scale=scaling)
        return out.transpose(1, 2), None
    out, lse = None, None
    for cols in torch.arange(k.shape[2]).chunk(blocks):
        scores = (query @ k[:, :, cols].transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~keep[:, cols], float("-inf"))
        part_lse = scores.logsumexp(-1, keepdim=True)
        safe = torch.where(torch.isfinite(part_lse), part_lse, torch.zeros_like(part_lse))
        part = (scores - safe).exp() @ v[:, :, cols]
        if out is None:
            out, lse = part, part_lse
            continue
        merged = torch.logaddexp(lse, part_lse)
        out = torch.exp(lse - merged).nan_to_num() * out + torch.exp(part_lse - merged).nan_to_num() * part
        lse = merged
    return out.transpose(1, 2), None


def _hf_float8_model(mcfg, blocks: int, recipe: str | None = RECIPE, jitter: int | None = None):
    """transformers' Llama with the debug model's initial weights, its linears converted to
    float8 by torchao directly (the recipe emulated; lm_head and dims not multiple of 16 kept)."""
    import transformers

    from loongtrain.hf.families import hf_config_dict
    from loongtrain.hf.weights import parameter_map, to_hf_tensor

    transformers.AttentionInterface.register(ATTENTION, _reference_attention)
    raw = hf_config_dict(mcfg, None, "float32", 4096)
    config = transformers.AutoConfig.for_model(**raw)
    config._attn_implementation = ATTENTION
    model = transformers.LlamaForCausalLM(config)
    ours = build_model(mcfg)
    mapping = parameter_map(mcfg)
    state = {
        mapping[name].hf_name: to_hf_tensor(mcfg, mapping[name], init_value(mcfg, name, p.shape, SEED, "cpu"))
        for name, p in ours.named_parameters()
    }
    if jitter is not None:  # every weight moved by -1, 0 or +1 ulp (seeded): fp32 rounding noise, no more
        gen = torch.Generator().manual_seed(jitter)
        state = {k: v * (1 + 2.0**-23 * torch.randint(-1, 2, v.shape, generator=gen)) for k, v in state.items()}
    model.load_state_dict(state, strict=False)
    if recipe is not None:  # None: the fp32 model
        torchao_float8(model, recipe)
    model.blocks = blocks
    return model


def _batches(micro: int, seq: int, vocab: int, pack: bool) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    out = []
    for m in range(micro):
        rng = random.Random(m)
        cu = [0]
        while pack and cu[-1] < seq:
            cu.append(min(seq, cu[-1] + rng.choice([3, 9, 17, 40])))
        cu = cu if pack else [0, seq]
        gen = torch.Generator().manual_seed(100 + m)
        tokens = torch.randint(0, vocab, (1, seq), generator=gen)
        labels = torch.randint(0, vocab, (1, seq), generator=gen)
        labels[0, [b - 1 for b in cu[1:]]] = -100
        out.append((tokens, labels, cu))
    return out


def _positions(cu: list[int]) -> torch.Tensor:
    return torch.tensor([p for a, b in zip(cu, cu[1:]) for p in range(b - a)]).unsqueeze(0)


def _reference_step(model, batches) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One step of the reference: (loss, gradients, parameters after AdamW) by HF name."""
    targets = sum(int((lab != -100).sum()) for _, lab, _ in batches)
    loss_total = 0.0
    for tokens, labels, cu in batches:
        _MASK.update(keep=visibility(tokens.shape[1], cu), blocks=model.blocks)
        logits = model(input_ids=tokens, position_ids=_positions(cu)).logits
        loss = lm_loss_sum(logits, labels) / targets
        loss.backward()
        loss_total += loss.item()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    optimizer.step()
    return loss_total, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _errors(loss, grads, params, ref) -> dict[str, float]:
    ref_loss, ref_grads, ref_params = ref
    worst = max(grads, key=lambda n: _rel(grads[n], ref_grads[n]))
    return {
        "worst_grad": worst,
        "grad_all": _rel(
            torch.cat([g.flatten() for g in grads.values()]), torch.cat([ref_grads[n].flatten() for n in grads])
        ),
        "param_all": _rel(
            torch.cat([p.flatten() for p in params.values()]), torch.cat([ref_params[n].flatten() for n in params])
        ),
        "loss": abs(loss - ref_loss) / abs(ref_loss),
        "grad": max(_rel(g, ref_grads[n]) for n, g in grads.items()),
        "param": max(_rel(p, ref_params[n]) for n, p in params.items()),
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _invariance(
    cfg: dict,
    zero: str,
    ckpt: str,
    micro: int,
    pack: bool,
    recipe: str = RECIPE,
    memory: dict | None = None,
    others: tuple = (),
) -> dict:
    state = cached_state(**cfg)
    mcfg = model_config("debug")
    seq = 16 * state.sp
    batches = _batches(micro, seq, mcfg.vocab_size, pack)
    reference = _reference_step(_hf_float8_model(mcfg, 1, recipe), batches)
    perturbed = [_hf_float8_model(mcfg, n, recipe) for n in FLOOR_BLOCKS]
    perturbed += [_hf_float8_model(mcfg, 1, recipe, jitter=0)]
    floors = [_errors(*_reference_step(model, batches), reference) for model in perturbed]
    floor = {key: max(f[key] for f in floors) for key in floors[0] if key != "worst_grad"}

    # the layout's own fp32 reordering (ring merges, gradient reductions): the same layout without
    # float8 against the fp32 reference; float8 cannot be closer to one process than fp32 is
    memory = MemoryOptions(activation_checkpoint=ckpt, **(memory or {}))
    alternatives = [cached_state(**{**cfg, **o}) for o in others]  # a layout per microbatch: m on m % (1 + len)
    *fp32_step, _ = _parallel_step(state, mcfg, zero, memory, batches, pack, None, alternatives)
    fp32 = _errors(*fp32_step, _reference_step(_hf_float8_model(mcfg, 1, None), batches))
    floor = {key: max(value, fp32[key]) for key, value in floor.items() if key != "worst_grad"}
    loss, grads, params, converted = _parallel_step(state, mcfg, zero, memory, batches, pack, recipe, alternatives)
    return {"floor": floor, "layout": _errors(loss, grads, params, reference), "float8_linears": converted}


def _parallel_step(state, mcfg, zero: str, memory, batches, pack: bool, recipe: str | None, alternatives):
    """One step of loongtrain's parallel model (float8 with ``recipe``; None: fp32): (loss,
    gradients, parameters after AdamW) by HF name, and how many linears are float8."""
    from loongtrain.hf.weights import parameter_map, to_hf_tensor

    float8 = Float8Options(enabled=recipe is not None, recipe_name=recipe or RECIPE, emulate=True)
    par = parallelize(build_model(mcfg), state, memory=memory, zero=zero, float8=float8, alternatives=alternatives)
    materialize(par, torch.device("cpu"), SEED)
    mine = [Microbatch(t, lab, torch.tensor(cu) if pack else None) for t, lab, cu in batches]
    states = [state, *alternatives]
    turns = iter(range(len(mine)))
    choose = (lambda mb: states[next(turns) % len(states)]) if alternatives else None
    loss = forward_backward(par, state, mine, choose=choose).loss
    mapping = parameter_map(mcfg)
    hf = lambda name, t: (mapping[name].hf_name, to_hf_tensor(mcfg, mapping[name], _full(t)))  # noqa: E731
    grads = dict(hf(n, p.grad) for n, p in par.named_parameters())
    optimizer = torch.optim.AdamW(par.parameters(), **ADAMW)
    optimizer.step()
    params = dict(hf(n, p.detach()) for n, p in par.named_parameters())
    return loss, grads, params, sum(type(m).__name__ == "Float8Linear" for m in par.modules())


# (world, layout, ZeRO scope, activation checkpointing, microbatches, packed documents)
CASES = [
    (4, {"hp": 2, "cp": 2}, "dp_sp", "sc++", 2, False),
    (4, {"cp": 4, "ring_window": 2}, "sp", "full", 1, True),
    (4, {"hp": 2, "cp": 2, "placement": "context_first"}, "none", "sc++", 1, True),
]
# memory options and a layout per microbatch: (world, layout, zero, checkpointing, microbatches, packed,
# memory options, the other hp x cp splits of the microbatches)
OPTION_CASES = [
    (4, {"hp": 2, "cp": 2}, "dp_sp", "sc++", 1, True, {"offload_activations": True, "offload_states": True}, ()),
    (
        4,
        {"hp": 2, "cp": 2, "balance": "locality"},
        "dp_sp",
        "full",
        2,
        True,
        {},
        ({"hp": 1, "cp": 4, "ring_window": 2},),
    ),
]
# (also measured, not kept for time: cp 8 interleaved window 4, ZeRO over sp, one packed microbatch:
# every error within the floor)
SLOW_CASES = [(8, {"hp": 2, "cp": 4, "ring_window": 2}, "dp_sp", "sc++", 2, True)]
FLOOR_FACTOR = 4
#: the reference's attention as this many key blocks merged by log-sum-exp; the floor is the
#: largest difference any of them makes (a float8 rounding flips or not: one reordering alone
#: measures it noisily)
FLOOR_BLOCKS = (2, 3, 4)
#: one fp32 ulp (relative): where the two-block reference changes a result by less than fp32
#: can show (the loss, summed to one float32, often agrees to the bit), the floor is this
FP32_ULP = 2.0**-23


def _bounds(floor: dict[str, float]) -> dict[str, float]:
    return {key: FLOOR_FACTOR * max(value, FP32_ULP) for key, value in floor.items() if key != "worst_grad"}


def _check(dist_pool, case) -> None:
    world, cfg, zero, ckpt, micro, pack, *options = case
    memory, others = options or ({}, ())
    for rank, result in enumerate(
        dist_pool(world).run(_invariance, cfg, zero, ckpt, micro, pack, RECIPE, memory, others)
    ):
        assert result["float8_linears"] == 14, result  # 7 per block: every linear but the output layer
        floor, layout = result["floor"], result["layout"]
        if rank == 0:
            print(f"{_case_id(case)}: floor {floor} layout {layout}")
        for key, bound in _bounds(floor).items():
            assert layout[key] <= bound, f"rank {rank}: {key} {layout[key]:.2e} > 4 x floor {floor}"


def _case_id(case) -> str:
    world, cfg, zero, ckpt, micro, pack, *options = case
    parts = [f"w{world}", *(f"{k}={v}" for k, v in cfg.items()), zero, ckpt, f"micro{micro}"]
    parts += ["packed"] if pack else []
    if options:
        parts += [*(k for k in options[0]), *(f"then-{o['hp']}x{o['cp']}" for o in options[1])]
    return "-".join(parts)


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_rowwise_float8_does_not_depend_on_the_layout(dist_pool, case):
    _check(dist_pool, case)


@pytest.mark.dist
@pytest.mark.parametrize("case", OPTION_CASES, ids=_case_id)
def test_rowwise_float8_with_offload_and_a_layout_per_microbatch(dist_pool, case):
    _check(dist_pool, case)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=_case_id)
def test_rowwise_float8_does_not_depend_on_the_layout_world8(dist_pool, case):
    _check(dist_pool, case)


@pytest.mark.dist
def test_the_floor_tells_a_layout_dependent_recipe_apart(dist_pool):
    """The control: ``tensorwise`` scales each activation and gradient by its maximum over the
    tokens this rank holds, so on the double ring its gradients land orders of magnitude above
    the floor (measured: 0.12 against a floor of 2.4e-7) where ``rowwise_with_gw_hp`` stays
    within 4x of it: the bound tells a layout-dependent scale apart."""
    world, cfg, zero, ckpt, micro, pack = CASES[1]
    result = dist_pool(world).run(_invariance, cfg, zero, ckpt, micro, pack, "tensorwise")[0]
    assert result["layout"]["grad"] > 1000 * _bounds(result["floor"])["grad"], result


def _all_gather_run(float8_all_gather: bool, steps: int, param_dtype=None) -> tuple[list, dict, int]:
    """``steps`` AdamW steps of the tensorwise float8 model on 2 data-parallel ranks (ZeRO over
    both), its weights gathered in float8 (scales precomputed after each step) or in the compute
    dtype and cast whole: (losses, final parameters, all-gather bytes of the first forward)."""
    from loongtrain.apply.float8 import precompute_scales

    state = cached_state(dp=2)
    mcfg = model_config("debug")
    float8 = Float8Options(
        enabled=True, recipe_name="tensorwise", enable_fsdp_float8_all_gather=float8_all_gather,
        precompute_float8_dynamic_scale_for_fsdp=float8_all_gather,
    )  # fmt: skip
    par = parallelize(build_model(mcfg), state, zero="dp_sp", float8=float8, param_dtype=param_dtype)
    materialize(par, torch.device("cpu"), SEED)
    precompute_scales(par)
    optimizer = torch.optim.AdamW(par.parameters(), **ADAMW)
    losses, gathered = [], 0
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        data = torch.randint(0, mcfg.vocab_size, (2, 33), generator=gen)[state.coords.dp : state.coords.dp + 1]
        state.stats.reset()
        losses.append(forward_backward(par, state, [(data[:, :-1], data[:, 1:])], backward=param_dtype is None).loss)
        gathered = gathered or state.stats.bytes.get("zero.all_gather", 0)
        if param_dtype is not None:  # bf16 on the CPU: the bytes of one forward are all we need
            break
        optimizer.step()
        optimizer.zero_grad()
        precompute_scales(par)
    return losses, {n: _full(p.detach()).clone() for n, p in par.named_parameters()}, gathered


def _float8_all_gather(steps: int) -> dict:
    on, off = _all_gather_run(True, steps), _all_gather_run(False, steps)
    (_, _, f8_bytes), (_, _, bf16_bytes) = (_all_gather_run(on, 1, torch.bfloat16) for on in (True, False))
    return {
        "losses": (on[0], off[0]),
        "same_params": all(torch.equal(on[1][n], off[1][n]) for n in on[1]),
        "bytes": (f8_bytes, bf16_bytes),
        "linear_params": model_config("debug").layer_matmul_params() * model_config("debug").n_layers,
    }


@pytest.mark.dist
def test_float8_all_gather_on_gloo_is_bit_equal_and_sends_half_of_bf16(dist_pool):
    """The float8 all-gather (tensorwise; its 1-byte buffers travel as uint8 over gloo, scales
    precomputed after each optimizer step) gives the losses and, after 3 AdamW steps, the
    parameters of the same model gathering its weights whole and casting them, bit for bit (a
    weight's float8 values depend on its global amax only); one forward's all-gather sends the
    blocks' linear weights in one byte each where bf16 sends two."""
    for result in dist_pool(2).run(_float8_all_gather, 3):
        gathered, plain = result["losses"]
        assert gathered == plain and result["same_params"], result
        f8_bytes, bf16_bytes = result["bytes"]
        # each rank sends its half of every linear weight to the other: 1 byte per element, not 2
        assert bf16_bytes - f8_bytes == result["linear_params"] // 2, result


def _train_float8(overrides: list[str]) -> list[float]:
    """The trainer (``loongtrain train``'s run) on the recall task with tensorwise float8, its
    weights all-gathered in float8 and the scales precomputed: the losses of its steps."""
    from loongtrain.config import load_config
    from loongtrain.train.trainer import preflight, train

    base = [
        "run.log_every=100", "run.eval_batches=1", "run.tensorboard=false", "run.progress=off",
        "data.seq_len=64", "data.global_batch=4", "data.recall_queries=8", "optim.warmup_steps=2",
        "checkpoint.every=0", "checkpoint.save_final=false", "parallel.cp=2", "parallel.zero=dp_sp",
        "float8.enabled=true", "float8.recipe_name=tensorwise", "float8.emulate=true",
        "float8.enable_fsdp_float8_all_gather=true", "float8.precompute_float8_dynamic_scale_for_fsdp=true",
    ]  # fmt: skip
    cfg = load_config(None, base + overrides)
    return train(torch.device("cpu"), cfg, preflight(cfg, torch.distributed.get_world_size())).losses


@pytest.mark.dist
def test_a_float8_all_gather_run_resumes_bit_exactly(dist_pool, tmp_path):
    """A run with the float8 all-gather stopped at step 2 and resumed gives the losses of the
    uninterrupted run, bit for bit: the checkpoint holds the high-precision weights and the AdamW
    state, and the float8 copies made from them after the resume are those of the run that went on."""
    pool = dist_pool(2)
    full = pool.run(_train_float8, ["run.steps=4", f"run.output_dir={tmp_path / 'a'}"])[0]
    first = pool.run(_train_float8, ["run.steps=2", "checkpoint.every=2", f"run.output_dir={tmp_path / 'b'}"])[0]
    rest = pool.run(_train_float8, ["run.steps=4", f"run.output_dir={tmp_path / 'b'}"])[0]
    assert len(rest) == 2 and first + rest == full, (first, rest, full)
