"""What a GPU run (or a reading of the CUDA and NCCL paths) found that the CPU path hides,
checked here where a CPU test can see it at all (the kernels' argument rules are in
``test_kernels.py``; the rules themselves in ``docs/gpu_check.md``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from loongtrain.apply.vocab import ShardGradient
from loongtrain.parallel.stats import AttentionStats


@pytest.fixture
def one_fake_rank():
    dist.init_process_group("fake", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _offloaded_parameter(mesh: DeviceMesh, local: torch.Tensor) -> torch.nn.Parameter:
    """A sharded parameter whose shard lives on another device than its mesh's, as FSDP2 makes
    one whose states it offloaded to the host (it builds the DTensor from the host shard; the
    public ``from_local`` would move the shard to the mesh's device)."""
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(local.shape, local.stride(), local.dtype))
    return torch.nn.Parameter(DTensor(local, spec, requires_grad=True))


def test_a_host_offloaded_vocabulary_matrix_gets_its_gradient_on_the_host(one_fake_rank):
    """With the states offloaded the matrix's shard is on the host and its mesh on the device;
    the gradient must be on the host (844df7e made it with ``DTensor.from_local``, which moved it:
    "attempting to assign a gradient with device type 'cuda' to a tensor with device type 'cpu'").
    Here the mesh's device is ``meta``, the host the CPU: the same mismatch, and the same error
    on that code."""
    mesh = DeviceMesh("meta", [0])
    weight = _offloaded_parameter(mesh, torch.zeros(6, 4))
    sink = ShardGradient(weight, AttentionStats())
    assert sink.master() is None  # the model does not read a host master
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    sink.add(first)
    sink.add(second)
    assert isinstance(weight.grad, DTensor) and weight.grad.to_local().device.type == "cpu"
    torch.testing.assert_close(weight.grad.to_local(), first + second, rtol=0, atol=0)
    ids = torch.tensor([1, 1, 5])
    rows = torch.randn(3, 4, generator=g)
    sink.add_rows(ids, rows)
    expected = first + second
    expected.index_add_(0, ids, rows)
    torch.testing.assert_close(weight.grad.to_local(), expected, rtol=0, atol=0)
    weight.grad = None
    sink.add_rows(ids, rows)  # the first contribution a scatter of rows
    torch.testing.assert_close(weight.grad.to_local(), torch.zeros(6, 4).index_add_(0, ids, rows), rtol=0, atol=0)


def test_the_one_shard_reduce_records_the_input_it_hands_back_on_the_asking_stream(monkeypatch):
    """FSDP2 reads a reduce's output on its reduce-scatter stream (and the all-reduce's) after the
    event the compute stream waits for before freeing the input: the input handed back as the
    output is recorded on the stream asking for it, and only that one (a new buffer is FSDP2's own)."""
    import loongtrain.apply.zero_comm as zero_comm

    recorded: list[torch.Tensor] = []
    monkeypatch.setattr(zero_comm, "record_on_current_stream", recorded.append)
    one = zero_comm._CountingReduceScatter(AttentionStats(), single_shard=True)
    cpu = torch.device("cpu")
    reduce_input = one.allocate((12,), dtype=torch.float32, device=cpu)
    assert recorded == []
    assert one.allocate((12,), dtype=torch.float32, device=cpu) is reduce_input
    assert len(recorded) == 1 and recorded[0] is reduce_input
    hook = zero_comm._all_reduce_counter(AttentionStats(), replicas=2, single_shard=True)
    hook(reduce_input)
    assert len(recorded) == 2 and recorded[1] is reduce_input
    zero_comm._all_reduce_counter(AttentionStats(), replicas=2, single_shard=False)(reduce_input)
    assert len(recorded) == 2


def test_nccl_runs_with_gloo_beside_it_for_host_tensors():
    """Clipping all-reduces the norms of host gradients when the states are offloaded: under
    NCCL the default group needs a host backend too."""
    from loongtrain.launch import process_group_backend

    assert process_group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("gloo") == "gloo"


def test_a_torchrun_rank_left_on_the_first_gpu_is_moved_to_its_own(monkeypatch):
    """A library user who calls ``init_process_group("nccl")`` under torchrun without
    ``torch.cuda.set_device`` gets local rank r on cuda:r, not every rank on cuda:0; a device the
    user chose is kept."""
    from loongtrain.parallel import state as state_module

    current = {"device": 0}
    monkeypatch.setattr(state_module.dist, "get_backend", lambda: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.update(device=d))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert state_module.default_device() == torch.device("cuda", 3)
    current["device"] = 5  # chosen by the user
    assert state_module.default_device() == torch.device("cuda", 5)
    monkeypatch.setenv("LOCAL_RANK", "0")
    current["device"] = 0
    assert state_module.default_device() == torch.device("cuda", 0)


def test_auto_chooses_the_kernel_by_the_device(monkeypatch):
    """cuDNN on Hopper/Blackwell with cuDNN >= 9.15 (measured faster on an H200), FlashAttention-2
    on Ampere and newer otherwise, SDPA before; the CPU kernel on CPU; fp32 always on SDPA."""
    import loongtrain.attention.backends as backends

    if backends.flash_attn_unavailable() is None:
        pytest.skip("flash_attn is installed here (auto takes it)")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    for capability, cudnn, expected in [((9, 0), 91900, "cudnn"), ((10, 0), 91600, "cudnn"), ((9, 0), 91400, "flash"),
                                        ((8, 0), 91900, "flash"), ((7, 5), 91900, "sdpa")]:  # fmt: skip
        monkeypatch.setattr(backends, "_capability", lambda device, c=capability: c)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda v=cudnn: v)
        monkeypatch.setattr(backends, "_runs", lambda name, device: True)
        assert backends.auto_kernel(cuda) == expected, (capability, cudnn)
    monkeypatch.setattr(backends, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    monkeypatch.setattr(backends, "_runs", lambda name, device: name != "cudnn")  # cuDNN refuses here
    assert backends.auto_kernel(cuda) == "flash"
    monkeypatch.setattr(backends, "_runs", lambda name, device: False)
    assert backends.auto_kernel(cuda) == "sdpa"
    assert backends.auto_kernel(torch.device("cpu")) == "cpu"
    assert isinstance(backends._backend("cudnn", "cuda", torch.float32), backends.CudaSdpaBackend)
    assert isinstance(backends._backend("cudnn", "cuda", torch.bfloat16), backends.CudnnBackend)
    assert isinstance(backends._backend("flash", "cuda", torch.float16), backends.Fa2Backend)


def test_a_kernel_that_cannot_run_is_refused_in_one_line(monkeypatch):
    import loongtrain.attention.backends as backends
    from loongtrain.config import ConfigError, load_config
    from loongtrain.options import check_kernel_device

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert "runs on CUDA, not on the CPU; use auto or cpu" in backends.kernel_unavailable("cudnn", cpu)
    monkeypatch.setattr(backends, "_capability", lambda device: (7, 5))
    assert "compute capability 8.0 or newer, this GPU has 7.5; use sdpa" in backends.kernel_unavailable("flash", cuda)
    assert backends.kernel_unavailable("sdpa", cuda) is None and backends.kernel_unavailable("auto", cuda) is None
    with pytest.raises(ValueError, match="unknown; choose one of"):
        backends.set_attention_kernel("fa9")
    with pytest.raises(ValueError, match="run.device=cpu; use attention.kernel=auto"):
        check_kernel_device("cudnn", "cpu")
    with pytest.raises(ValueError, match="run.device=cuda; use attention.kernel=auto"):
        check_kernel_device("cpu", "cuda")
    with pytest.raises(ConfigError, match="attention.kernel='fa9'; choose one of"):
        load_config(overrides=["attention.kernel=fa9"])


def test_adamw_is_fused_on_a_gpu_and_the_default_elsewhere(monkeypatch):
    """Fused AdamW (one kernel per parameter group and dtype) where every parameter is on a GPU,
    as torchtitan runs it; PyTorch's default on CPU and for parameters offloaded to the host."""
    from loongtrain.config import OptimSection
    from loongtrain.train import spec

    assert spec.fused_adamw({"cuda"}) is True
    assert spec.fused_adamw({"cuda", "cpu"}) is None and spec.fused_adamw({"cpu"}) is None
    made = {}
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kw: made.update(kw) or kw)
    spec.build_optimizer([torch.zeros(2, requires_grad=True)], OptimSection())
    assert made["fused"] is None
    meta = torch.zeros(2, device="meta", requires_grad=True)
    monkeypatch.setattr(spec, "FUSED_ADAMW_DEVICES", ("meta",))  # stands in for a GPU here
    spec.build_optimizer([meta], OptimSection())
    assert made["fused"] is True
