"""The memory options in the time model and the search, ``--max-seq-len``, the printed training
config, Hugging Face model folders, and bad input in one line. Pure: no processes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from loongtrain.cli import main as loongtrain_main
from loongtrain.config import load_config
from loongtrain.model.config import PRESETS
from loongtrain.planner.cost import Candidate, Workload, linear_flops_fwd, mlp_flops_fwd
from loongtrain.planner.estimate import CPU_ADAMW_BYTES_PER_PARAM, estimate
from loongtrain.planner.maxlen import length_unit, max_seq_len
from loongtrain.planner.memory import layer_bytes
from loongtrain.planner.report import train_config
from loongtrain.planner.search import evaluate_layouts, search_layouts
from loongtrain.planner.specs import CLUSTER_PRESETS, PlanError, cluster_to_toml, model_spec
from loongtrain.planner.zero import shard_degree

H100 = CLUSTER_PRESETS["h100"]
LLAMA = PRESETS["llama3-8b"]
K = 1024


# -- the time model --------------------------------------------------------------------
def test_tiled_mlp_adds_one_mlp_forward_per_layer():
    w = Workload(LLAMA, 64 * K)
    plain = estimate(H100, w, Candidate.of(cp=8, activation_checkpoint="full"))
    tiled = estimate(H100, w, Candidate.of(cp=8, activation_checkpoint="full", mlp_tile=4096))
    extra = LLAMA.n_layers * mlp_flops_fwd(w, 8) / (H100.matmul_tflops * 1e12)
    assert tiled.compute_s - plain.compute_s == pytest.approx(extra)
    # the chunked loss costs the same FLOPs as the whole-shard one
    whole = estimate(H100, w, Candidate.of(cp=8, activation_checkpoint="full", loss_chunk=0))
    assert whole.step_s == plain.step_s


def test_activation_offload_is_exposed_only_beyond_the_layer_compute():
    w = Workload(LLAMA, 64 * K)
    x = Candidate.of(cp=8, activation_checkpoint="full", offload_activations=True)
    kept = layer_bytes(LLAMA, 1, 8, 2, "full", False).kept * w.seq_len / 8
    lin = linear_flops_fwd(w, 8) / (H100.matmul_tflops * 1e12)
    qkv = LLAMA.dim * (LLAMA.n_heads + 2 * LLAMA.n_kv_heads) * LLAMA.head_dim
    window = 2 * lin * qkv / LLAMA.layer_matmul_params()  # the q/k/v projections' backward
    # 8 KB/token per layer over PCIe hides behind the layer's forward; in backward the previous
    # layer comes back after the attention's, behind the q/k/v projections' backward alone
    e = estimate(H100, w, x)
    assert e.offload_s == pytest.approx(LLAMA.n_layers * (kept / (H100.host_copy_gbs * 1e9) - window))
    assert 0 < e.offload_s < 0.01 * e.step_s
    slow = replace(H100, host_link_gbs=0.01, host_mem_bw_gbs=0.0)
    e = estimate(slow, w, x)
    fwd = lin + e.attention.fwd
    transfer = kept / 0.01e9
    assert e.offload_s == pytest.approx(LLAMA.n_layers * ((transfer - fwd) + (transfer - window)))


def test_state_offload_prices_the_cpu_optimizer_step():
    w = Workload(LLAMA, 64 * K)
    x = Candidate.of(cp=8, activation_checkpoint="full", offload_states=True)
    e = estimate(H100, w, x)
    per_rank_bw = H100.host_mem_bw_gbs * 1e9 / 8  # the node's DRAM bandwidth shared by its 8 ranks
    cpu = LLAMA.num_params() / shard_degree(x) * CPU_ADAMW_BYTES_PER_PARAM / per_rank_bw
    assert e.offload_s == pytest.approx(cpu)  # the parameter and gradient shards hide behind the layers
    plain = estimate(H100, w, Candidate.of(cp=8, activation_checkpoint="full"))
    assert e.step_s == pytest.approx(plain.step_s + cpu)


# -- the search ------------------------------------------------------------------------
def test_search_takes_offload_only_when_the_layout_needs_it():
    w = Workload(LLAMA, 1024 * K, batch=1)
    roomy = search_layouts(replace(H100, device_memory_gib=1e4), w, 8)
    for e in roomy.ranked:  # everything fits plainly: no tiling, no offload anywhere
        m = e.candidate.memory
        assert not (m.mlp_tile or m.offload_activations or m.offload_states)
    tight = search_layouts(H100, w, 8)
    for e in tight.ranked:
        m = e.candidate.memory
        if m.mlp_tile or m.offload_activations or m.offload_states:
            plain = e.candidate.with_(mlp_tile=0, offload_activations=False, offload_states=False)
            assert not estimate(H100, w, plain).fits and not estimate(H100, w, plain.with_(loss_chunk=0)).fits
        if m.offload_states:  # only when tiling and activation offload are not enough (e.g. zero=none)
            lean = e.candidate.with_(mlp_tile=8192, offload_activations=m.activation_checkpoint != "none")
            assert not estimate(H100, w, lean.with_(offload_states=False)).fits
    assert not tight.best.candidate.memory.offload_states  # the winner shards its states over the 8 ranks
    no_host = replace(H100, host_memory_gib=0.0)
    for e in evaluate_layouts(no_host, w, 8)[1]:
        assert not (e.candidate.memory.offload_activations or e.candidate.memory.offload_states)


def test_state_offload_when_nothing_else_fits():
    w = Workload(LLAMA, 64 * K, batch=1)  # one device: 16 bytes x 8B parameters exceed 80 GB
    best = search_layouts(H100, w, 1).best
    assert best.candidate.memory.offload_states
    assert best.host_per_node <= H100.host_memory_gib * 2**30


# -- --max-seq-len ---------------------------------------------------------------------
def test_max_seq_len_is_the_plan_at_that_length_and_grows_with_devices():
    answers = {d: max_seq_len(H100, LLAMA, d) for d in (1, 8, 16)}
    for devices, answer in answers.items():
        unit = length_unit(devices)
        assert answer.seq_len % unit == 0
        fits = search_layouts(H100, Workload(LLAMA, answer.seq_len), devices)
        assert fits.best.candidate == answer.result.best.candidate
        longer = Workload(LLAMA, answer.seq_len + unit)
        assert evaluate_layouts(H100, longer, devices)[1] == []  # one unit more does not fit
        assert answer.limiting is not None and not answer.limiting.fits
    assert answers[1].seq_len < answers[8].seq_len < answers[16].seq_len


def test_max_seq_len_when_nothing_fits():
    tiny = replace(H100, device_memory_gib=1.0)
    with pytest.raises(PlanError, match=f"even the shortest length {length_unit(8)} does not fit"):
        max_seq_len(tiny, LLAMA, 8)


def test_max_seq_len_cli_prints_the_answer_and_its_config(capsys, tmp_path):
    loongtrain_main(["plan", "--cluster", "h100", "--model", "llama3-8b", "--devices", "8", "--max-seq-len"])
    out = capsys.readouterr().out
    assert "longest sequence that trains:" in out and "does not fit:" in out and "[memory]" in out
    loongtrain_main(["plan", "--cluster", "h100", "--model", "llama3-8b", "--devices", "8", "--max-seq-len", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["max_seq_len"] % data["unit"] == 0 and data["best"]["fits"]


# -- the printed training config ---------------------------------------------------------
@pytest.mark.parametrize("devices, seq", [(8, 1024 * K), (1, 64 * K)])
def test_printed_config_loads_as_a_training_config(tmp_path, devices, seq):
    w = Workload.from_tokens(LLAMA, seq, max(seq, 4 * devices * seq // 8))
    best = search_layouts(H100, w, devices).best
    text = train_config(best, w, "llama3-8b")
    path = tmp_path / "plan.toml"
    path.write_text(text)
    cfg = load_config(path)
    x, p = best.candidate, best.candidate.parallel
    assert (cfg.parallel.hp, cfg.parallel.cp, cfg.parallel.ring_window) == (p.hp, p.cp, p.ring_window)
    assert (cfg.parallel.placement, cfg.parallel.zero, cfg.parallel.param_dtype) == (p.placement, x.zero, "bfloat16")
    assert cfg.memory.options() == x.memory
    assert (cfg.data.seq_len, cfg.data.global_batch) == (seq, w.batch)
    assert cfg.data.global_batch // (p.dp * cfg.data.micro_batches) == w.micro_batch
    assert cfg.model.preset == "llama3-8b"
    assert "bf16" in text  # says what it assumes


# -- Hugging Face model folders ----------------------------------------------------------
def _folder(tmp_path, **config):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_model_from_a_hugging_face_folder(tmp_path):
    qwen3 = _folder(
        tmp_path,
        model_type="qwen3",
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    )
    m = model_spec(qwen3)
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim) == (2048, 28, 16, 8, 128, 6144)
    assert m.tie_embeddings and m.qk_norm and m.max_positions == 40960 and m.vocab_size == 151936
    w = Workload(m, 128 * K)
    assert search_layouts(H100, w, 8).best.fits


@pytest.mark.parametrize(
    "config, message",
    [
        (None, "has no config.json"),
        ({"model_type": "gpt2", "hidden_size": 64}, "model_type 'gpt2'; the planner reads"),
        ({"model_type": "llama", "hidden_size": 64}, "lacks integer key\\(s\\)"),
    ],
)
def test_bad_hugging_face_folders(tmp_path, config, message):
    if config is None:
        (tmp_path / "model").mkdir()
        folder = str(tmp_path / "model")
    else:
        folder = _folder(tmp_path, **config)
    with pytest.raises(PlanError, match=message):
        model_spec(folder)


# -- bad input: one line, before anything runs -------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "128K", "--devices", "8", "--layout", "hp=8,window=2"], "window= was renamed; use ring_window"),
        (["--seq-len", "128K", "--devices", "8", "--layout", "hp=8,offload=disk"], "offload='disk'; use one of"),
        (
            ["--seq-len", "128K", "--devices", "8", "--layout", "hp=8,ckpt=full,mlp_tile=65536"],
            "mlp_tile=65536 is larger than a rank's shard of 16384 tokens",
        ),
        (["--seq-len", "128K", "--devices", "8", "--layout", "loss_chunk=-1"], "must be a non-negative integer"),
        (["--devices", "8", "--max-seq-len", "--seq-len", "1M"], "drop --seq-len"),
        (["--devices", "8", "--max-seq-len", "--global-batch", "4M"], "drop --global-batch"),
        (["--max-seq-len"], "--max-seq-len needs --devices"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        loongtrain_main(["plan", "--cluster", "h100", "--model", "llama3-8b", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loongtrain plan: error:")
    assert __import__("re").search(message, err[0]), err[0]


def test_offload_on_a_cluster_without_host_memory_is_refused(tmp_path, capsys):
    path = tmp_path / "nohost.toml"
    path.write_text(cluster_to_toml(replace(H100, name="nohost", host_memory_gib=0.0)))
    layout = "hp=8,ckpt=full,offload=activations"
    with pytest.raises(SystemExit):
        loongtrain_main(["plan", "--cluster", str(path), "--seq-len", "128K", "--devices", "8", "--layout", layout])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no host memory to spare for offloading activations (host_memory_gib=0)" in err[0]


def test_max_seq_len_that_does_not_fit_at_all_is_one_line(tmp_path, capsys):
    path = tmp_path / "small.toml"
    path.write_text(cluster_to_toml(replace(H100, name="small", device_memory_gib=1.0)))
    with pytest.raises(SystemExit):
        loongtrain_main(["plan", "--cluster", str(path), "--model", "llama3-8b", "--devices", "8", "--max-seq-len"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "even the shortest length 1024 does not fit" in err[0]
    assert math.isfinite(H100.host_copy_gbs)
