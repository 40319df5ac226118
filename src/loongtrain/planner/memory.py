"""Peak memory per device (and the host memory it pins) of one training step. Pure.

A sum of named terms, each the bytes of tensors this implementation holds. Per-token
terms are bytes per token of the rank's shard (``T = micro_batch * seq_len / sp`` tokens,
before the head all-to-all); ``e`` is the compute dtype's bytes (2 for bf16), ``a`` the
accumulation dtype's (4: fp32). Where each term comes from:

- ``model/llama.py``: ``RMSNorm`` saves its input and the fp32 ``1 / rms`` (``e * width + 4``;
  its backward recomputes the fp32 upcast and the normalised copy); the attention's norm and
  the q/k/v projections are one function saving the same two (``NormedProjections``: the
  normalised input is recomputed in backward); every other linear saves its input;
  RoPE saves only the shared cos/sin tables; ``FeedForward`` saves w1's output, silu's
  output, w3's output and their product (``4 * e * ffn``), or tiled (``model/tiled_mlp.py``)
  only its input and norm2's 1/rms; a block's output is the next block's input. The norms,
  RoPE and the q/k/v projections run over token tiles (``model.config.token_tile``: their
  temporaries within 512 MiB), so their float32 temporaries are one tile's
  (``TILE_TEMP_BYTES`` per token and element of width), priced in the projections' backward.
- ``attention/ops.py``: ``ring_attention`` saves ``q_h``, ``kv_h``, ``out_h`` and the fp32
  ``lse``; ``head_scatter``/``head_gather`` save nothing, but with ``hp > 1`` the gathered
  output is ``wo``'s saved input (with ``hp == 1`` it is ``out_h`` itself); with ``hp == 1``
  ``kv_h`` is ``torch.stack((k, v))``.
- ``apply/activation_checkpoint.py``: ``full`` keeps each block's input; ``sc++`` also keeps
  the outputs of the MUST_SAVE ops (``ring_attention``'s out and lse; with ``hp > 1`` also
  ``head_scatter``'s q_h, kv_h and ``head_gather``'s output). A checkpointed block's
  backward first recomputes its forward, so one layer's saved set exists again.
- ``attention/double_ring.py``: backward holds an fp32 ``dq`` accumulator, an fp32 dK/dV
  partial, the block kernel's dq/dk/dv, and with ``cp > 1`` the KV blocks and dK/dV
  partials in flight; with ``cp == 1`` (and no document mask, which the planner does not
  price) one block whose dq and stacked dk/dv are the result.
- ``attention/kernels.py``: a block's backward call over more than
  ``attention.workspace.BACKWARD_ROW_HEADS`` rows x heads runs over head groups; on a GPU
  each call also allocates FlashAttention-2's workspace (``backward_call_bytes``).
- ``model/loss.py``: with ``loss_chunk = 0`` the loss is ``F.cross_entropy(logits.float())``
  inside the model's forward (log-softmax output saved; its backward adds the gradient and
  the input gradient, fp32); the logits themselves are freed when the forward returns. With
  ``loss_chunk`` (the fused linear cross
  entropy the trainer runs when it is set) one chunk's logits exist at a time, the
  gradient of the final norm's output (``[T, d]`` fp32) is made in the forward and kept
  until backward starts, and the output weight's gradient accumulates in fp32.
- ``apply/zero.py`` (FSDP2): sharded fp32 parameters; gathered (compute dtype) copies of the
  layer in use and the one prefetched; the root (the final norm; tied, the embedding) stays
  gathered from forward to backward, untied vocabulary matrices only around their use (the
  output for the loss); a layer's gradients are reduce-scattered as it finishes. The
  vocabulary matrices' fp32 gradients go straight to their shards (``apply/vocab.py``): the
  output's from the chunked loss's backward on (it waits through every layer's backward),
  the embedding's in its backward (a dense fp32 buffer reduced on several ranks); FSDP2
  reduces the rest of the root after that, through an fp32 buffer of its full size (the
  "root reduce" phase; on one rank that buffer becomes the gradient).
  AdamW's moments (fp32) exist between steps.

The peak is the largest of five phases: the loss (every layer's kept tensors plus the
loss's), the backward of the first layer it reaches (every layer's kept tensors, plus one
layer's recompute working set), of the last (one layer's kept tensors, the other layers'
sharded gradients), the root's reduce and the optimizer step; with
``activation_checkpoint_layers`` (the first k layers checkpointed, the rest plain) a sixth, the
backward of the last checkpointed layer (the k layers' kept tensors, the plain layers'
gradients, one recompute), while the first layer's backward is a plain layer's. ``MemoryOptions`` change
exactly their terms: ``mlp_tile`` replaces the per-token MLP intermediates by one tile's, ``loss_chunk`` the
logits by one chunk's, ``offload_activations`` keeps two layers of kept tensors on the
device in forward (the layer in use and the one being copied out) and one through a layer's
attention and MLP backward (``apply/offload.py`` brings the previous layer's back once the
attention's backward is done: a third backward phase, the projections' backward beside the
prefetched layer, is priced too), all of them on the host; ``offload_states`` moves
parameters, gradients and optimizer states to the host.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from loongtrain.attention.workspace import backward_heads_per_call, backward_workspace_bytes
from loongtrain.model.config import TILE_TEMP_BYTES, ModelConfig, token_tile, vocab_slice_rows
from loongtrain.options import checkpointed_count
from loongtrain.planner.cost import Candidate, Workload, replicated_kv_heads
from loongtrain.planner.float8 import copies_bytes
from loongtrain.planner.zero import shard_degree

#: checkpointed layers' kept tensors on the device with ``offload_activations`` in forward:
#: the layer in use and the one being copied out (in backward: the layer in use, and the
#: one prefetched while its q/k/v projections' backward runs)
OFFLOAD_LAYERS_ON_DEVICE = 2
#: FSDP2 layers gathered at once: the one computing and the one prefetched
GATHERED_LAYERS = 2


def norm_saved(width: int, e: int) -> float:
    """Bytes per token an ``RMSNorm`` over ``width`` saves (``model/llama.py``): its input (the
    caller's tensor, in the compute dtype) and the fp32 ``1 / rms``; its backward recomputes
    the rest."""
    return e * width + 4.0


@dataclass(frozen=True)
class LayerBytes:
    """One transformer layer's bytes per token of the rank's shard (see the module docstring)."""

    saved: float  # everything autograd saves without checkpointing (the block input included)
    kept: float  # what the layer keeps from forward to its backward, under its checkpoint mode
    recompute: float  # saved again by the recompute in the layer's backward (not already kept)
    mlp_backward: float  # MLP backward transients above the saved set
    attention_saved: float  # of ``saved``, what is still alive while the attention's backward runs
    attention_recompute: float  # of ``recompute``, what is still alive then (``attention_saved`` less ``kept``)
    attention_backward: float  # attention backward buffers (ring, all-to-alls), its input gradient included


def group_model(m: ModelConfig, groups: int) -> ModelConfig:
    """The heads of one of ``groups`` head groups (``memory.head_groups``) as a model: its
    query heads, and the key/value heads it reads (one when groups split a key/value head)."""
    if groups == 1:
        return m
    return replace(
        m, n_heads=m.n_heads // groups, n_kv_heads=max(1, m.n_kv_heads // groups), head_dim_override=m.head_dim
    )


@functools.lru_cache(maxsize=65536)  # pure; a search asks for the same few layers thousands of times
def layer_bytes(
    m: ModelConfig, hp: int, cp: int, e: int, mode: str, tiled: bool, a: int = 4, groups: int = 1
) -> LayerBytes:
    """Per-token bytes of one layer (``mode``: its checkpoint mode; ``tiled``: MLP tiling on;
    ``groups``: the attention over that many head groups, ``model/head_groups.py``)."""
    if groups > 1:
        return _grouped_layer_bytes(m, hp, cp, e, mode, tiled, a, groups)
    d, hd, h, f = m.dim, m.head_dim, m.n_heads, m.ffn_dim
    gr = replicated_kv_heads(m, hp)
    q, kv, out, lse = e * h * hd, 2 * e * gr * hd, e * h * hd, a * h
    gathered_out = e * h * hd if hp > 1 else 0.0  # head_gather's output, wo's input
    qk_norms = norm_saved(h * hd, e) + norm_saved(m.n_kv_heads * hd, e) if m.qk_norm else 0.0
    norm1 = norm_saved(d, e)
    # norm1 + wq/wk/wv (one function: the block input and 1/rms), q/k norms, the ring op
    attention_saved = norm1 + qk_norms + q + kv + out + lse + gathered_out
    sc_kept = out + lse + (q + kv + gathered_out if hp > 1 else 0.0)  # the ring op's results (and scatter's)
    # ring backward (double_ring.ring_backward): dout, fp32 dq accumulator and the own block's
    # dK/dV, the block kernel's dq/dk/dv; with cp > 1 two KV blocks in flight and two fp32
    # dK/dV blocks (the partial passed on, and the next one arriving or a window's total coming home);
    # with cp == 1 one block whose dq and stacked dk/dv are the result (when one kernel call
    # returns dk/dv apart, their stacking is priced with the call: ``backward_call_bytes``)
    ring = _ring_backward_bytes(q, kv, h, hd, cp, e, a)
    # head_scatter's backward (hp > 1): dq_h/dkv_h and the all-to-all's packed send and receive
    scatter = 3 * (q + kv) if hp > 1 else 0.0
    attention_backward = e * d + max(ring, scatter)  # + the residual stream's gradient
    return _checkpointed(mode, attention_saved, sc_kept, attention_backward, d, f, e, tiled)


def _checkpointed(
    mode: str, attention_saved: float, sc_kept: float, attention_backward: float, d: int, f: int, e: int, tiled: bool
) -> LayerBytes:
    """A layer's bytes under checkpoint ``mode`` from what its attention saves (the block
    input, norm1's saved input, among them), what ``sc++`` keeps of it, and its attention
    backward's buffers; the MLP's part (norm2 and w1/w3's input and the SwiGLU intermediates;
    tiled: norm2 is inside the tiles, so only its input and 1/rms are saved) added here."""
    mlp_part = norm_saved(d, e) + (0.0 if tiled else e * d + 4 * e * f)
    saved = attention_saved + mlp_part
    input_alias = e * d  # norm1 saves its input: the block input itself
    if mode == "none":
        kept, recompute, attention_kept = saved, 0.0, attention_saved - input_alias
    elif mode == "full":
        kept, attention_kept = e * d, 0.0
        recompute = saved - input_alias
    elif mode == "sc++":
        attention_kept = sc_kept
        kept = e * d + attention_kept
        # (over head groups the selective checkpoint caches tensors the function does not save)
        recompute = max(0.0, saved - input_alias - attention_kept)
    else:
        raise ValueError(f"unknown checkpoint mode {mode!r}")
    # the block input and what the checkpoint keeps are in ``kept``, not recomputed
    attention_recompute = max(0.0, attention_saved - input_alias - attention_kept)
    # backward of w2 then of the product: its gradient and the gradients of silu's and w3's outputs
    mlp_backward = 0.0 if tiled else 2 * e * f
    return LayerBytes(saved, kept, recompute, mlp_backward, attention_saved, attention_recompute, attention_backward)


def _ring_backward_bytes(q: float, kv: float, h: int, hd: int, cp: int, e: int, a: int) -> float:
    """The ring's backward buffers for ``q``/``kv`` bytes per token of ``h`` query heads (see
    :func:`layer_bytes`)."""
    if cp == 1:
        return 2 * q + kv  # dout, and the one block's dq and stacked dk/dv (the result)
    return q + a * h * hd + a * kv / e + (q + kv) + 2 * kv + 2 * a * kv / e


def _grouped_layer_bytes(
    m: ModelConfig, hp: int, cp: int, e: int, mode: str, tiled: bool, a: int, groups: int
) -> LayerBytes:
    """:func:`layer_bytes` of a layer whose attention runs over ``groups`` head groups: the
    function saves the block input, its fp32 ``1 / rms`` and each group's ring output and
    lse (all groups: one ``out`` and one ``lse``), but under ``full`` (which recomputes the
    layer) none of the attention's (its backward runs each group's attention again); its
    backward holds the residual gradient ``dy`` and the input gradient it adds into, and one
    group's q/k/v (before and after their norms and RoPE), output, ``dout`` and ring (or
    all-to-all) buffers at a time."""
    d, hd, h, f = m.dim, m.head_dim, m.n_heads, m.ffn_dim
    gm = group_model(m, groups)
    gr = replicated_kv_heads(gm, hp)
    keep = mode != "full"
    out, lse = (e * h * hd, a * h) if keep else (0.0, 0.0)
    attention_saved = norm_saved(d, e) + out + lse
    # sc++ keeps the attention ops' outputs, every group's
    q_all, kv_all = e * h * hd, 2 * e * replicated_kv_heads(gm, hp) * groups * hd
    sc_kept = out + lse + (q_all + kv_all + out if hp > 1 else 0.0)
    q, kv = e * gm.n_heads * hd, 2 * e * gr * hd  # one group's, after the all-to-all's replication
    own_kv = 2 * e * gm.n_kv_heads * hd
    projections = 2 * e * gm.n_heads * hd + 1.5 * own_kv  # q and k before and after their norms and RoPE, v
    # the group's output: run again (and its lse) when not kept, gathered again when hp > 1
    projections += (0.0 if keep and hp == 1 else e * gm.n_heads * hd) + (0.0 if keep else a * gm.n_heads)
    ring = _ring_backward_bytes(q, kv, gm.n_heads, hd, cp, e, a)
    scatter = 3 * (q + kv) if hp > 1 else 0.0
    attention_backward = 2 * e * d + projections + max(ring, scatter)  # dy and the input gradient
    return _checkpointed(mode, attention_saved, sc_kept, attention_backward, d, f, e, tiled)


def backward_call_bytes(
    m: ModelConfig, hp: int, rows: int, e: int, gpu: bool, a: int = 4, stacked: bool = False
) -> float:
    """Bytes of one block's backward kernel call of ``rows`` query (and key) rows beside the
    gradients it returns (``attention/kernels.block_backward``): over head groups
    (:func:`~loongtrain.attention.workspace.backward_heads_per_call`) each call's gradients
    before they are copied into place, the fp32 dk/dv sums when a call covers part of a
    key/value group, and on a GPU the copies ``flash_attn`` makes of the call's inputs and
    FlashAttention-2's own workspace (:func:`~loongtrain.attention.workspace.backward_workspace_bytes`;
    the CPU kernel keeps per-thread tiles only). ``stacked`` (one rank of context): the
    gradients are dq and a stacked dkv, and one call over every head returns dk/dv apart."""
    hd, heads, groups = m.head_dim, m.n_heads // hp, replicated_kv_heads(m, hp) // hp
    per_call = backward_heads_per_call(rows, heads, groups)
    ratio = heads // groups
    kv_per_call = max(1, per_call // ratio)
    total = backward_workspace_bytes(rows, rows, per_call, kv_per_call, hd, e) if gpu else 0.0
    if stacked and per_call == heads:
        total += 2.0 * e * rows * hd * groups  # dk and dv before their stack
    if per_call < heads:
        total += e * rows * hd * (per_call + 2 * kv_per_call)  # the call's dq, dk, dv
        if gpu:
            total += e * rows * hd * (3 * per_call + 2 * kv_per_call)  # dout, q, out, k, v made contiguous
        if per_call < ratio:
            total += 2 * a * rows * hd  # the group's fp32 dk/dv sums
    return total


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes per device by component, the phase where the peak is, and the host bytes
    this rank pins. ``terms`` names every term of the peak phase (bytes)."""

    states: float  # sharded fp32 parameters, AdamW moments and the gradients made so far
    gathered: float  # FSDP's gathered layers and their gradients, the root's, the loss's fixed buffers
    activations: float  # kept by activation checkpointing (device part), inputs, RoPE tables
    working: float  # the phase's transients: recompute working set, attention buffers, loss
    host: float  # pinned host bytes of this rank: offloaded kept tensors and model states
    phase: str
    terms: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations + self.working

    @property
    def step(self) -> float:
        """The peak above what exists before the step (sharded parameters and AdamW moments)."""
        before = dict(self.terms)
        return self.total - before.get("params", 0.0) - before.get("optimizer", 0.0)

    def term(self, name: str) -> float:
        """One named term of the peak phase (0 when the phase has none of it)."""
        return dict(self.terms).get(name, 0.0)


_KIND = {
    "params": "states",
    "optimizer": "states",
    "grads": "states",
    "optimizer temporaries": "states",
    "gathered layers": "gathered",
    "layer gradients": "gathered",
    "root": "gathered",
    "root gradient": "gathered",
    "root reduce": "gathered",
    "embedding gradient": "states",
    "loss fixed": "gathered",
    "all-gather output": "gathered",
    "kept": "activations",
    "inputs": "activations",
    "rope": "activations",
}


def _breakdown(phase: str, terms: dict[str, float], host: float) -> MemoryBreakdown:
    parts = {"states": 0.0, "gathered": 0.0, "activations": 0.0, "working": 0.0}
    for name, value in terms.items():
        parts[_KIND.get(name, "working")] += value
    return MemoryBreakdown(**parts, host=host, phase=phase, terms=tuple(terms.items()))


def memory_bytes(w: Workload, layout: Candidate, optimizer: bool = True, gpu: bool = True) -> MemoryBreakdown:
    """Peak memory of one device for ``layout`` running ``w`` (micro-batch ``w.micro_batch``);
    ``optimizer=False``: a forward and backward without an optimizer (no moments, no step);
    ``gpu=False``: the CPU attention kernel (no FlashAttention workspace)."""
    phases, host = memory_phases(w, layout, optimizer, gpu)
    phase, terms = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    return _breakdown(phase, terms, host)


def memory_phases(
    w: Workload, layout: Candidate, optimizer: bool = True, gpu: bool = True
) -> tuple[dict[str, dict[str, float]], float]:
    """Every phase's named terms (bytes on one device) and the host bytes the rank pins:
    ``({phase: {term: bytes}}, host)``. The peak is the phase with the largest sum.
    ``gpu=False``: the CPU attention kernel, and gloo's collectives, which copy a
    reduce-scatter's input and make an all-gather's output anew (measured: an 8 MiB buffer,
    8 MiB more in each; NCCL works in place)."""
    m, e, a = w.model, w.dtype_bytes, w.accum_bytes
    p, mem = layout.parallel, layout.memory
    tokens = w.micro_batch * w.seq_len / p.sp
    shard = shard_degree(layout)
    p_layer = m.layer_params()
    p_total = m.num_params()
    p_root = p_total - m.n_layers * p_layer
    p_output = m.vocab_size * m.dim  # the output weight (the embedding when tied)
    tile = min(mem.mlp_tile, tokens) if mem.mlp_tile else 0
    ckpt = mem.activation_checkpoint
    n_ckpt = checkpointed_count(mem, m.n_layers)
    n_plain = m.n_layers - n_ckpt
    groups = mem.head_groups
    mine = layer_bytes(m, p.hp, p.cp, e, ckpt, tile > 0, a, groups) if n_ckpt else None
    plain = layer_bytes(m, p.hp, p.cp, e, "none", tile > 0, a, groups)

    # -- host: offloaded kept tensors (all checkpointed layers) and model states
    host = 0.0
    kept_ckpt_layer = mine.kept * tokens if mine else 0.0
    # checkpoint spans (apply/activation_checkpoint.py): one kept input per span; in a span's
    # backward its recompute has made the inputs of its other layers again
    span = mem.activation_checkpoint_span
    units = math.ceil(n_ckpt / span)
    span_inputs = (span - 1) * e * m.dim * tokens
    on_device_ckpt = backward_ckpt = units
    prefetched = 0.0  # the previous layer's kept tensors, back on the device during the projections' backward
    if mem.offload_activations and n_ckpt:
        host += units * kept_ckpt_layer
        on_device_ckpt = min(units, OFFLOAD_LAYERS_ON_DEVICE)
        backward_ckpt, prefetched = 1, kept_ckpt_layer
    if mem.offload_states:
        host += 16.0 * p_total / shard

    # -- always there
    fixed: dict[str, float] = {}
    if mem.offload_states:
        fixed["params"] = 0.0
        fixed["optimizer"] = 0.0
    else:
        fixed["params"] = 4.0 * p_total / shard
        fixed["optimizer"] = 8.0 * p_total / shard if optimizer else 0.0
    full_sequence = w.micro_batch * w.seq_len
    fixed["inputs"] = 24.0 * full_sequence + 24.0 * tokens  # tokens/labels/positions, whole and sharded (int64)
    fixed["rope"] = 4.0 * m.head_dim * w.seq_len / p.sp  # cos and sin, fp32 [1, S/sp, head_dim/2]
    # gathered from forward to backward: the root's parameters, but for untied vocabulary matrices,
    # each its own unit gathered only around its use (apply/zero.py): the output matrix for the loss
    p_vocab = m.vocab_size * m.dim
    root = (p_root if m.tie_embeddings else p_root - 2 * p_vocab) * e
    # ... where one shard is the whole matrix on the device, the chunked loss reads that float32
    # master a vocabulary slice at a time instead (model/vocab.py): no gathered copy
    master = not m.tie_embeddings and bool(mem.loss_chunk) and shard == 1 and not mem.offload_states
    output_gathered = 0.0 if m.tie_embeddings or master else e * p_output

    kept_all = on_device_ckpt * kept_ckpt_layer + n_plain * plain.kept * tokens
    kept_backward = backward_ckpt * kept_ckpt_layer + n_plain * plain.kept * tokens

    # -- the loss
    loss: dict[str, float] = {**fixed, "root": root + output_gathered, "kept": kept_all}
    final = norm_saved(m.dim, e) + e * m.dim  # the final norm's saved tensors and its output h
    if mem.loss_chunk:
        chunk = min(mem.loss_chunk, tokens)
        # the last block's output and its gradient [T, d], made in the forward: the final norm
        # runs inside the loss, chunk by chunk (model/loss.py)
        loss["loss"] = 2.0 * e * m.dim * tokens
        # the fp32 dL/dW accumulator, one chunk's fp32 logits (turned into their softmax and its
        # gradient in place) and beside them its compute-dtype logits or gradient (fp32: none);
        # the chunk's normed rows and their gradient
        chunk_logits = (4.0 + (e if e < 4 else 0.0)) * chunk * m.vocab_size
        # a vocabulary slice's compute-dtype product with the chunk (dL/dW's; the master's cast
        # slice and its float32 sum of dL/dh)
        # (none in float32: products in float32 need no slices, a float32 master is used whole)
        rows = vocab_slice_rows(m.vocab_size, m.dim, int(e))
        vocab_slice = (e * rows + (4.0 * chunk if master else 0.0)) * m.dim if e < 4 else 0.0
        loss["loss fixed"] = 4.0 * p_output + chunk_logits + 2.0 * e * chunk * m.dim + vocab_slice
        if shard > 1 and output_gathered:
            # FSDP2 keeps its last all-gather's output buffer (the output matrix's, in the compute
            # dtype) until the next all-gather or the root's forward ends
            # (FSDPParamGroup.wait_for_unshard, FSDPState._post_forward): through the chunked loss,
            # which makes its gradients in forward. (gloo's copy of the [V, d] fp32 gradient in the
            # sink's reduce-scatter comes after it, in the loss's backward.)
            loss["all-gather output"] = output_gathered
    else:
        # the loss's backward: the saved fp32 log-softmax, the gradient of its output and of its
        # input (fp32), cast to the compute dtype for the output layer's backward when that is not fp32
        cast = e * m.vocab_size if e < 4 else 0.0
        loss["loss"] = (final + 12.0 * m.vocab_size + cast) * tokens

    # -- one layer's backward (the first one reached, and the last)
    rows = w.micro_batch * w.seq_len // p.cp  # the largest block
    call = backward_call_bytes(group_model(m, groups), p.hp, rows, e, gpu, a, stacked=p.cp == 1) / tokens

    def working(lb: LayerBytes) -> float:
        mlp_phase = lb.recompute + lb.mlp_backward + e * m.dim  # + the gradient flowing in
        attn_phase = lb.attention_recompute + lb.attention_backward + call
        if tile:  # the tiled input's gradient [T, d]; one tile's normed input (fp32 and e), SwiGLU
            # intermediates and gradients
            mlp_phase += e * m.dim + ((4.0 + e) * m.dim + 6.0 * e * m.ffn_dim) * tile / tokens
        return max(mlp_phase, attn_phase) * tokens

    # after the attention's backward: the residual's gradient, the gradients of q, k, v, and
    # RoPE's output or the projections' input gradient; beside the prefetched previous layer
    q_bytes, kv_bytes = e * m.n_heads * m.head_dim, 2 * e * m.n_kv_heads * m.head_dim
    # and one token tile's temporaries of the norm and projections' backward (model/norm.py)
    tile_temps = TILE_TEMP_BYTES * m.dim * w.micro_batch * min(w.seq_len / p.sp, token_tile(m.dim))
    projections = (e * m.dim + q_bytes + kv_bytes + max(q_bytes, e * m.dim)) * tokens + tile_temps + prefetched
    if groups > 1:  # the projections' backward is inside the grouped function (its working set);
        projections = 0.0  # the previous layer's kept tensors come back when its backward reads them

    # by the projections' backward the layer's own kept tensors but its input are freed (the MLP's
    # and the attention's saved tensors; sc++'s kept attention results)
    def at_projections(lb: LayerBytes) -> float:
        return projections - (lb.kept - e * m.dim) * tokens

    ckpt_work = max(at_projections(mine), working(mine)) if mine else 0.0
    # a layer without checkpointing: its saved set is in kept already
    plain_work = max(at_projections(plain), working(plain)) if n_plain else 0.0
    first_work = last_work = max(ckpt_work, plain_work)  # every k-th layer: either kind comes first and last
    # the first activation_checkpoint_layers layers checkpointed: backward reaches the others first
    # and has freed their activations before the first recompute
    counted = bool(mem.activation_checkpoint_layers and n_plain)
    if counted:
        first_work, last_work = plain_work, ckpt_work
    layer_grads = p_layer * e + (4.0 * p_layer / shard if mem.offload_states else 0.0)
    # float8 all-gather: a layer's linear weights gathered in one byte (planner/float8.py)
    gathered_bytes = p_layer * e - (m.layer_matmul_params() * (e - 1) if w.float8_all_gather else 0)
    gathered_layers = GATHERED_LAYERS * gathered_bytes + (
        GATHERED_LAYERS * 4.0 * p_layer / shard if mem.offload_states else 0.0
    )
    # the output matrix's gradient from the loss's backward on: with the chunked loss its fp32
    # shard (apply/vocab.py; on the host with the states), else autograd's compute-dtype one
    if mem.loss_chunk:
        output_grad = 0.0 if mem.offload_states else 4.0 * p_output / shard
    else:
        output_grad = p_output * e
    backward_common = {
        **fixed,
        "gathered layers": gathered_layers,
        "layer gradients": layer_grads,
        "root": root,
        "root gradient": output_grad,
    }
    if not gpu and shard > 1:  # gloo: a layer's fp32 gradient reduce-scatter, or its all-gather
        backward_common["gloo copies"] = max(4.0, e) * p_layer
    if span > 1:
        backward_common["span inputs"] = span_inputs
    if w.float8:  # one matmul's float8 copies of its operands (transient: torchao casts again in backward)
        backward_common["float8 copies"] = copies_bytes(m, tokens, w.float8)
    first = {**backward_common, "kept": kept_backward, "layer backward": first_work}
    last_kept = kept_ckpt_layer if n_ckpt else plain.kept * tokens
    sharded_grads = 0.0 if mem.offload_states else 4.0 * p_layer / shard * (m.n_layers - 1)
    last = {**backward_common, "grads": sharded_grads, "kept": last_kept, "layer backward": last_work}
    recompute_first = None
    if counted:  # the last checkpointed layer's backward: the layers after it done, their gradients sharded
        plain_grads = 0.0 if mem.offload_states else 4.0 * p_layer / shard * n_plain
        kept_ckpt = backward_ckpt * kept_ckpt_layer
        recompute_first = {**backward_common, "grads": plain_grads, "kept": kept_ckpt, "layer backward": ckpt_work}

    # the embedding's backward and the root's reduce after it: the embedding's fp32 gradient
    # (apply/vocab.py: on one rank its rows added into the gradient itself, on several a dense
    # [V, d] fp32 buffer reduce-scattered into the shard), then FSDP2's reduce of the rest of
    # the root (the final norm; the output matrix when the loss is not chunked): its
    # compute-dtype gradients and the fp32 reduce-scatter input of their full size and its
    # output shard (on one rank the input is the output: apply/zero_comm.py); beside the layers'
    # sharded fp32 gradients and the output matrix's
    p_norms = p_root - p_vocab * (1 if m.tie_embeddings else 2)
    fsdp_root = p_norms + (0 if mem.loss_chunk else p_output)
    embedding_grad = 0.0 if mem.offload_states else 4.0 * p_vocab / shard
    embedding_dense = 4.0 * p_vocab if shard > 1 else 0.0
    fsdp_reduce = (4.0 + e) * fsdp_root + (4.0 * fsdp_root / shard if shard > 1 else 0.0)
    root_reduce = {
        **fixed,
        "root": root,
        "root gradient": 0.0 if m.tie_embeddings else output_grad,
        "grads": 0.0 if mem.offload_states else 4.0 * p_layer / shard * m.n_layers,
        "embedding gradient": embedding_grad,
        "root reduce": max(embedding_dense, fsdp_reduce) * (2 if not gpu and shard > 1 else 1),  # gloo: copied
    }
    phases = {"loss": loss, "backward, first layer": first, "backward, last layer": last, "root reduce": root_reduce}
    if recompute_first is not None:
        phases["backward, first recompute"] = recompute_first
    if optimizer and not mem.offload_states:  # AdamW: params, grads, moments and a foreach temporary
        phases["optimizer step"] = {
            "params": fixed["params"],
            "optimizer": fixed["optimizer"],
            "grads": 4.0 * p_total / shard,
            "optimizer temporaries": 4.0 * p_total / shard,
        }
    return phases, host


def predict_peak_memory(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    dtype_bytes: int,
    candidate: Candidate,
    optimizer: bool = True,
    gpu: bool = True,
) -> MemoryBreakdown:
    """The peak memory of one rank for ``candidate`` training ``model`` on sequences of
    ``seq_len`` tokens, ``micro_batch`` at a time, computing in ``dtype_bytes``-byte floats.

    For ``loongtrain bench memory`` to compare with measured peaks (torch-free). ``total``
    is the device peak with AdamW moments; ``step`` leaves out what exists before a step
    (sharded parameters and moments); ``terms`` names every part. ``optimizer=False``: a
    forward and backward without an optimizer (no moments, no optimizer step). ``gpu``: the
    attention backward runs FlashAttention-2 (its workspace counted); ``False``: the CPU kernel.
    """
    batch = candidate.parallel.dp * micro_batch
    w = Workload(model, seq_len, batch=batch, micro_batch=micro_batch, dtype_bytes=dtype_bytes)
    return memory_bytes(w, candidate, optimizer, gpu)
