"""The memory model's terms by hand for a small model: each memory option changes exactly
the terms it should, by the bytes counted here; the model against peaks tracked on the real
code; host memory. Pure: no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loongtrain.model.config import ModelConfig, model_config
from loongtrain.planner.cost import Candidate, Workload
from loongtrain.planner.memory import layer_bytes, memory_bytes, memory_phases, predict_peak_memory

# D=64, H=4, G=2, head_dim 16, F=128, V=100, 2 layers; bf16 (e=2), one sequence of 64 tokens on one rank
M = ModelConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
T = 64
W = Workload(M, seq_len=T)
P_LAYER = 36864 + 2 * 64  # matmuls + two norms
P_TOTAL = 2 * P_LAYER + 2 * 100 * 64 + 64


def phases(**options):
    return memory_phases(W, Candidate.of(**options))


def differing(a: dict, b: dict) -> dict:
    """{phase: {term: (a, b)}} where the two differ."""
    out = {}
    for phase in a.keys() | b.keys():
        ta, tb = a.get(phase, {}), b.get(phase, {})
        diff = {k: (ta.get(k, 0.0), tb.get(k, 0.0)) for k in ta.keys() | tb.keys() if ta.get(k, 0.0) != tb.get(k, 0.0)}
        if diff:
            out[phase] = diff
    return out


def test_layer_bytes_by_hand():
    full = layer_bytes(M, 1, 1, 2, "full", tiled=False)
    # saved without checkpointing: norm1 with wq/wk/wv (one function: its bf16 input 64*2 + fp32
    # 1/rms 4), q 128, k/v stack 128, out 128, lse 16, norm2 132, w1/w3 input 128, SwiGLU 4 x 128 x 2
    assert full.saved == 132 + 128 + 128 + 128 + 16 + 132 + 128 + 1024 == 1816
    assert (full.kept, full.recompute) == (128, 1816 - 128)  # norm1's saved input is the kept block input
    assert full.mlp_backward == 2 * 2 * 128  # the product's gradient, then silu's and w3's
    assert full.attention_saved == 132 + 128 + 128 + 128 + 16
    # alive in the attention's backward and recomputed: all of that but the (kept) block input
    assert full.attention_recompute == 4 + 128 + 128 + 128 + 16
    # one rank of context: one block whose gradients are the result: dout 128, dq 128, the
    # stacked dk/dv 128; + the residual's 128 (dk/dv before their stack: priced with the call)
    assert full.attention_backward == 128 + 128 + 128 + 128
    sc = layer_bytes(M, 1, 1, 2, "sc++", tiled=False)
    assert sc.kept == 128 + 128 + 16 and sc.recompute == 1816 - 128 - 144  # the ring's out and lse are kept
    assert sc.attention_recompute == 4 + 128 + 128  # the norm's 1/rms, q, k/v: out and lse are kept
    assert layer_bytes(M, 1, 1, 2, "none", tiled=False).attention_recompute == 0  # all of it is kept
    # tiled: the MLP saves its input (the residual stream) and norm2's 1/rms only
    assert layer_bytes(M, 1, 1, 2, "none", tiled=True).saved == 1816 - 1024 - 128
    # fp32 too: norm1's saved input is the kept block input itself, not counted again
    assert layer_bytes(M, 1, 1, 4, "full", tiled=False).recompute == layer_bytes(M, 1, 1, 4, "none", False).saved - 256
    # a ring of cp > 1: dout 128, fp32 dq 256, the own block's fp32 dK/dV 256, the block's dq/dk/dv
    # 256, two KV blocks (2 x 128) in flight and two fp32 dK/dV blocks (2 x 256: the partial passed
    # on, and the next one arriving or a window's total coming home); + the residual's 128
    ring = layer_bytes(M, 1, 4, 2, "full", tiled=False)
    assert ring.attention_backward == 128 + 128 + 256 + 256 + 256 + 2 * 128 + 2 * 256


def test_chunked_loss_changes_the_loss_terms_and_where_the_output_gradient_lives():
    whole, _ = phases(activation_checkpoint="full", loss_chunk=0)
    chunked, _ = phases(activation_checkpoint="full", loss_chunk=1024)  # a 64-token shard: one chunk of 64
    final = (2 * 64 + 4) + 2 * 64  # the final norm's saved input and 1/rms, and its output
    output_grad = (2 * 100 * 64, 4 * 100 * 64)  # autograd's bf16 [V, d] -> the fp32 one (apply/vocab.py)
    assert differing(whole, chunked) == {
        # whole shard: the loss's backward holds the fp32 log-softmax, its gradient and the input
        # gradient, and that gradient cast to bf16 for the output layer's backward
        # chunked (the final norm inside, chunk by chunk): the last block's output and its bf16
        # gradient [T, d] made in the forward; fp32 grad_W [V, d], one fp32 [chunk, V] (logits,
        # softmax and gradient in place), its bf16 logits or gradient beside it, and the chunk's
        # normed rows and their gradient; on one shard it reads the fp32 master matrix: no bf16
        # gathered copy of it (the root's 2 * 100 * 64), one cast vocabulary slice (here all 100
        # rows) and the fp32 sum of the chunk's dL/dh instead
        "loss": {
            "loss": ((final + 12 * 100 + 2 * 100) * T, (2 * 64 + 2 * 64) * T),
            "loss fixed": (0.0, 4 * 100 * 64 + (4 + 2) * 64 * 100 + 2 * 2 * 64 * 64 + 2 * 100 * 64 + 4 * 64 * 64),
            "root": (2 * (64 + 100 * 64), 2 * 64),
        },
        "backward, first layer": {"root gradient": output_grad},
        "backward, last layer": {"root gradient": output_grad},
        # FSDP2 reduces the final norm and, without the chunked loss, the output matrix: their bf16
        # gradients and the fp32 reduce buffer (one rank: it becomes the gradient)
        "root reduce": {"root gradient": output_grad, "root reduce": ((4 + 2) * (64 + 100 * 64), (4 + 2) * 64)},
    }
    # fp32 compute: the master is read whole (no cast slice, no separate dL/dh sum), nor a copy gathered
    (fp32, _), (fp32_whole, _) = (
        memory_phases(replace(W, dtype_bytes=4), Candidate.of(activation_checkpoint="full", loss_chunk=c))
        for c in (1024, 0)
    )
    assert fp32["loss"]["loss fixed"] == 4 * 100 * 64 + 4 * 64 * 100 + 2 * 4 * 64 * 64
    assert fp32_whole["loss"]["root"] - fp32["loss"]["root"] == 4 * 100 * 64


def test_fsdp2_keeps_the_output_matrix_all_gather_through_the_chunked_loss():
    """Sharded (hp=2: two shards), FSDP2 holds its last all-gather's output until the root's
    forward ends: the output matrix's bf16 buffer beside its gathered copy through the chunked
    loss (read in torch's FSDPParamGroup.wait_for_unshard; seen by the allocator trace), not
    with the whole-shard loss (whose peak is its backward) nor on one shard (no gather)."""
    chunked, _ = phases(hp=2, activation_checkpoint="full", loss_chunk=1024)
    whole, _ = phases(hp=2, activation_checkpoint="full", loss_chunk=0)
    one, _ = phases(activation_checkpoint="full", loss_chunk=1024)
    assert chunked["loss"]["all-gather output"] == 2 * 100 * 64
    assert "all-gather output" not in whole["loss"] and "all-gather output" not in one["loss"]


def test_tiled_mlp_changes_only_the_layer_working_set():
    plain, _ = phases(activation_checkpoint="full")
    tiled, _ = phases(activation_checkpoint="full", mlp_tile=16)
    # untiled: the recomputed layer (1816 - 128 kept) + MLP backward (512) + the incoming gradient (128)
    # tiled: no [T, ffn] tensors (1688 - 1024) and no normed MLP input (128: norm2 is inside the
    # tiles), the tiled input's gradient (128), one tile's normed input (fp32 and bf16: 6 * 64)
    # and six [16, ffn] tensors (6 * 2 * 128)
    untiled_work = (1688 + 512 + 128) * T
    tiled_mlp = (1688 - 1024 - 128 + 128 + 128) * T + (6 * 64 + 6 * 2 * 128) * 16
    # ... which now falls below the attention's backward: its recomputed part (532 less the
    # block input 128) + dout 128, the kernel's dq 128, the stacked dk/dv 128, the residual's
    # gradient 128, and the call's: dk/dv before their stack 128, FlashAttention-2's fp32 dq
    # accumulator 256 and dk/dv at the 4 query heads 256
    attention_phase = (404 + 128 + 128 + 128 + 128 + 128 + 256 + 256) * T
    tiled_work = max(tiled_mlp, attention_phase)
    assert tiled_work == attention_phase
    assert differing(plain, tiled) == {
        "backward, first layer": {"layer backward": (untiled_work, tiled_work)},
        "backward, last layer": {"layer backward": (untiled_work, tiled_work)},
    }
    # without checkpointing the SwiGLU intermediates and the normed MLP input leave every layer's kept tensors
    none, _ = phases(activation_checkpoint="none")
    none_tiled, _ = phases(activation_checkpoint="none", mlp_tile=16)
    assert none["loss"]["kept"] - none_tiled["loss"]["kept"] == 2 * (4 * 2 * 128 + 2 * 64) * T


def test_activation_offload_keeps_two_layers_on_the_device_in_forward_and_one_in_backward():
    w = Workload(replace(M, n_layers=4), seq_len=T)
    on_device, host = memory_phases(w, Candidate.of(activation_checkpoint="full"))
    offloaded, host_off = memory_phases(w, Candidate.of(activation_checkpoint="full", offload_activations=True))
    assert host == 0 and host_off == 4 * 128 * T  # every layer's block input, pinned on the host
    # the previous layer comes back after the attention's backward, beside the projections'
    # backward: the residual's gradient 128, q's 128 and k/v's 128 gradients, RoPE's output 128,
    # and that layer's input 128 -- less than the attention and MLP phases here
    assert differing(on_device, offloaded) == {
        "loss": {"kept": (4 * 128 * T, 2 * 128 * T)},
        "backward, first layer": {"kept": (4 * 128 * T, 1 * 128 * T)},
    }
    assert offloaded["backward, first layer"]["layer backward"] > (4 * 128 + 128) * T


def test_state_offload_moves_the_model_states_to_the_host():
    plain, host = phases(activation_checkpoint="full")
    offloaded, host_off = phases(activation_checkpoint="full", offload_states=True)
    assert host == 0 and host_off == 16 * P_TOTAL  # fp32 parameters, gradients, two moments (one rank)
    assert "optimizer step" in plain and "optimizer step" not in offloaded  # AdamW runs on the CPU
    for phase in ("loss", "backward, first layer", "backward, last layer", "root reduce"):
        diff = differing(plain, offloaded)[phase]
        assert diff.pop("params") == (4 * P_TOTAL, 0.0)
        assert diff.pop("optimizer") == (8 * P_TOTAL, 0.0)
        if phase.startswith("backward"):  # two layers' shards copied in; a layer's gradient shard on its way out
            assert diff.pop("gathered layers") == (2 * 2 * P_LAYER, 2 * 2 * P_LAYER + 2 * 4 * P_LAYER)
            assert diff.pop("layer gradients") == (2 * P_LAYER, 2 * P_LAYER + 4 * P_LAYER)
        if phase != "loss":  # the vocabulary matrices' fp32 gradients go to the host (apply/vocab.py)
            assert diff.pop("root gradient") == (4 * 100 * 64, 0.0)
        if phase == "backward, last layer":  # the other layers' gradient shards went to the host
            assert diff.pop("grads") == (4 * P_LAYER, 0.0)
        if phase == "loss":  # the master matrix on the host: the loss reads a gathered bf16 copy, not
            # the master a cast slice at a time (the slice's bf16 product stays; the fp32 sum of dL/dh goes)
            assert diff.pop("root") == (2 * 64, 2 * (64 + 100 * 64))
            chunked = 4 * 100 * 64 + (4 + 2) * 64 * 100 + 2 * 2 * 64 * 64 + 2 * 100 * 64
            assert diff.pop("loss fixed") == (chunked + 4 * 64 * 64, chunked)
        if phase == "root reduce":  # every layer's gradient shard and the embedding's went to the host
            assert diff.pop("grads") == (2 * 4 * P_LAYER, 0.0)
            assert diff.pop("embedding gradient") == (4 * 100 * 64, 0.0)
        assert diff == {}


def test_the_attention_backward_runs_over_head_groups_at_long_sequences():
    """Llama-3-8B on one device at 1M tokens: a backward call over all 32 heads would allocate
    FlashAttention-2's fp32 dq accumulator (16 GiB) and dk/dv at the query heads (16 GiB);
    one head a call (1M rows x 1 head) allocates its dq accumulator (512 MiB), its dq/dk/dv
    (768 MiB), flash_attn's contiguous copies of dout/q/out/k/v (1280 MiB) and the group's fp32
    dk/dv sums (1 GiB). On the CPU kernel only the last three."""
    from loongtrain.attention.workspace import backward_heads_per_call, backward_workspace_bytes
    from loongtrain.planner.memory import backward_call_bytes

    m, rows, mib = model_config("llama3-8b"), 2**20, 2**20
    assert backward_heads_per_call(rows, 32, 8) == 1
    assert backward_workspace_bytes(rows, rows, 32, 8, 128, 2) == 32 * 1024 * mib
    assert backward_call_bytes(m, 1, rows, 2, gpu=True) == (512 + 768 + 1280 + 1024) * mib
    assert backward_call_bytes(m, 1, rows, 2, gpu=False) == (768 + 1024) * mib
    assert backward_call_bytes(m, 1, 4096, 2, gpu=False) == 0  # one call: nothing beside its gradients
    # in the peak: the layers' backward (its attention phase) grows by the GPU's part and nothing else does
    w, x = Workload(m, seq_len=rows), Candidate.of(activation_checkpoint="full", mlp_tile=8192)
    gpu, cpu = memory_phases(w, x)[0], memory_phases(w, x, gpu=False)[0]
    assert differing(cpu, gpu) == {
        phase: {"layer backward": (cpu[phase]["layer backward"], cpu[phase]["layer backward"] + (512 + 1280) * mib)}
        for phase in ("backward, first layer", "backward, last layer")
    }


def test_peak_is_the_largest_phase_and_predict_peak_memory_is_memory_bytes():
    x = Candidate.of(activation_checkpoint="sc++")
    every, _ = memory_phases(W, x)
    peak = memory_bytes(W, x)
    assert peak.total == pytest.approx(max(sum(t.values()) for t in every.values()))
    assert predict_peak_memory(M, T, 1, 2, x).total == peak.total
    no_optimizer = predict_peak_memory(M, T, 1, 2, x, optimizer=False)
    assert "optimizer" not in dict(no_optimizer.terms) or no_optimizer.term("optimizer") == 0
    assert no_optimizer.total < peak.total


# Peaks of one forward + backward on CPU (gloo), measured on the real code (a record of one day's
# code; tests/test_memory_options.py measures three of these rows live, so it follows the code) by
# `loongtrain.tools.bench.memory.measure` (the profiler's allocator events over the step on top of the
# live tensors before it: the tracking `loongtrain bench memory` does), max over ranks, MiB. The
# debug model scaled: dim 256, 4 layers, 4/2 heads, ffn 704, vocab 1024; the whole-shard loss
# (loss_chunk = 0) unless the row names options. Measured 2026-12-01 on the code with the norms,
# RoPE and projections over 4096-token tiles, norm2 inside the MLP's tiles, and the offload
# fetching the previous layer after the attention's backward (the world-4 hp=4 row varies
# between runs of the same code: 56.8, 65.5 and 57.5 MiB measured the same day); the one-device
# rows at 16K and 32K again on 2026-12-05, once tiles were sized by bytes (one tile of the whole
# sequence at this width; the rows at 4096 tokens and the world-4 rows were one tile before too).
ONE_DEVICE = dict(loss_chunk=1024, mlp_tile=2048, offload_activations=True)  # what the one-device plans choose
# the first k layers checkpointed (the rest keep everything): one device, bf16, 16K tokens,
# chunked loss; measured 2026-12-05 with the byte-sized tiles (one tile of the whole sequence here)
PARTIAL = [("none", 0, 621.8), ("sc++", 0, 261.4), ("sc++", 1, 501.6), ("sc++", 2, 381.5), ("sc++", 3, 261.4),
           ("full", 2, 365.0)]  # fmt: skip
TRACKED = [
    # (world, hp, cp, checkpoint, zero, bytes per float, seq_len, MiB[, other memory options])
    (1, 1, 1, "sc++", "dp_sp", 4, 4096, 139.1),
    (1, 1, 1, "none", "dp_sp", 2, 4096, 204.7),
    (1, 1, 1, "full", "dp_sp", 2, 4096, 76.4),
    (1, 1, 1, "sc++", "dp_sp", 2, 4096, 84.6),
    (1, 1, 1, "full", "dp_sp", 2, 16384, 135.1, ONE_DEVICE),
    (1, 1, 1, "full", "dp_sp", 2, 32768, 249.8, ONE_DEVICE),
    (1, 1, 1, "sc++", "dp_sp", 2, 16384, 143.3, ONE_DEVICE),
    (1, 1, 1, "sc++", "dp_sp", 2, 32768, 266.3, ONE_DEVICE),
    (4, 1, 4, "sc++", "dp_sp", 4, 4096, 45.5),
    (4, 2, 2, "sc++", "dp_sp", 4, 4096, 54.5),
    (4, 4, 1, "sc++", "dp_sp", 4, 4096, 57.5),
    (4, 2, 2, "full", "dp_sp", 4, 4096, 46.0),
    (4, 2, 2, "none", "dp_sp", 4, 4096, 95.5),
    (4, 1, 2, "full", "dp", 4, 4096, 71.8),
    (4, 1, 2, "sc++", "sp", 4, 4096, 78.7),
    (4, 1, 4, "full", "none", 4, 4096, 54.9),
    (4, 1, 4, "sc++", "dp_sp", 4, 8192, 72.4),
    (4, 2, 2, "sc++", "dp_sp", 2, 4096, 30.9),
    *(
        (1, 1, 1, ckpt, "dp_sp", 2, 16384, mib, {"loss_chunk": 1024, "activation_checkpoint_layers": k})
        for ckpt, k, mib in PARTIAL
    ),
]
BENCH_MODEL = model_config("debug", dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=704, vocab_size=1024)


def test_memory_model_matches_peaks_tracked_on_the_real_code():
    errors, slopes, partial = [], {}, []
    for world, hp, cp, ckpt, zero, e, seq, measured, *more in TRACKED:
        options = {"loss_chunk": 0, **(more[0] if more else {})}
        x = Candidate.of(dp=world // (hp * cp), hp=hp, cp=cp, zero=zero, activation_checkpoint=ckpt, **options)
        predicted = predict_peak_memory(BENCH_MODEL, seq, 1, e, x, optimizer=False, gpu=False).total / 2**20
        errors.append(abs(predicted / measured - 1))
        if more and more[0] is not ONE_DEVICE:
            partial.append(predicted / measured)
        elif more:
            slopes.setdefault(ckpt, []).append((predicted, measured))
    # every policy of the first k layers checkpointed (what `auto` chooses among): within 2%
    # (measured: 0.996-0.998; the plain layers' kept tensors freed by their projections' backward)
    assert len(partial) == len(PARTIAL) and all(abs(r - 1) <= 0.02 for r in partial), partial
    # one device with the long-sequence options, bf16: per token (the slope between two lengths,
    # what decides the longest sequence) the model is not below the measurement, and within 10%
    # (measured: 5.6% above; at 16K tokens the real peak is the MLP phase with one tile's
    # intermediates, at 32K the attention's, so the measured slope mixes two phases)
    for (p_short, m_short), (p_long, m_long) in slopes.values():
        assert 1.0 <= (p_long - p_short) / (m_long - m_short) <= 1.10
    errors.sort()
    # world-4 peaks vary between runs of the same code (the hp=4 row: 56.8 and 65.5 MiB measured
    # the same day), so the worst bound is the memory model's acceptance bound (20%), the median tight
    assert errors[len(errors) // 2] <= 0.05 and errors[-1] <= 0.20, errors
