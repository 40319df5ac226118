"""Throughput arithmetic (model FLOPs, MFU), peak memory, and the metric writers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from loongtrain.model.config import ModelConfig

# Peak dense TFLOP/s per device from vendor spec sheets (bf16/fp16 tensor cores, and
# plain fp32), matched against torch.cuda.get_device_name(). H800/H200 share H100's SXM
# compute; A800 shares A100's.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.0, "float32": 67.0},
    "H100": {"bfloat16": 989.0, "float32": 67.0},
    "H800": {"bfloat16": 989.0, "float32": 67.0},
    "H20": {"bfloat16": 148.0, "float32": 44.0},
    "A100": {"bfloat16": 312.0, "float32": 19.5},
    "A800": {"bfloat16": 312.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.0, "float32": 91.6},
    "4090": {"bfloat16": 165.0, "float32": 82.6},
}


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs of one training token: :meth:`ModelConfig.flops_per_token`."""
    return cfg.flops_per_token(seq_len, causal=causal)


def batch_flops_per_token(cfg: ModelConfig, microbatches: list) -> float:
    """Model FLOPs per token of these microbatches (:class:`~loongtrain.data.Microbatch`),
    with attention counted over the keys each query really sees: packed documents'
    masks and each layer's sliding window cut the causal ``(S + 1) / 2`` (averaged over the layers)."""
    tokens = sum(mb.tokens.numel() for mb in microbatches)
    windows = cfg.windows
    keys = sum(windows.count(w) * sum(mb.attention_keys(w) for mb in microbatches) for w in set(windows)) / len(windows)
    return cfg.flops_per_token(microbatches[0].tokens.shape[1], keys_per_query=keys / tokens)


def device_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak dense TFLOP/s of ``device`` for ``dtype`` if it is a known GPU, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = "bfloat16" if dtype in (torch.bfloat16, torch.float16) else "float32"
    for model, peaks in PEAK_TFLOPS.items():
        if model in name:
            return peaks[key]
    return None


def mfu(tokens_per_s_per_device: float, flops_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation, or None when the peak is unknown."""
    if not peak_tflops:
        return None
    return tokens_per_s_per_device * flops_token / (peak_tflops * 1e12)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def _proc_status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU, or the process's peak resident memory on CPU
    (since the last :func:`reset_peak_memory`)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status_bytes("VmHWM")


class MetricsWriter:
    """Appends one JSON object per record to ``metrics.jsonl``; TensorBoard when available.

    ``purge_step``: a resumed run's first step; TensorBoard hides the events a previous
    attempt logged from that step on (so re-trained steps are not shown twice)."""

    def __init__(self, run_dir: Path, tensorboard: bool, purge_step: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._tb = None
        self.tensorboard_status = "off (run.tensorboard = false)"  # for the start-up line
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)
                self.tensorboard_status = f"TensorBoard logs in {run_dir / 'tensorboard'}"
            except ImportError:
                self.tensorboard_status = "off: the tensorboard package is not installed (pip install tensorboard)"
            except Exception as e:  # noqa: BLE001 - optional: a broken install must not stop training
                self.tensorboard_status = f"off: TensorBoard failed to start ({type(e).__name__}: {e})"

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(strict_json(record) + "\n")
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def finite_or_none(value: object) -> object:
    """``value`` with every non-finite float (NaN, infinities) replaced by None, in lists and dicts too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def strict_json(record: dict) -> str:
    """One ``metrics.jsonl`` line: JSON that every parser reads (RFC 8259 has no NaN or
    Infinity, so a non-finite number is written as null)."""
    return json.dumps(finite_or_none(record), allow_nan=False)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _number(value: object) -> bool:
    """A plottable number: a source absent from a step has no ``loss/NAME`` (or an old file's NaN)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def plot_curves(records: list[dict], path: Path, chance: float | None = None) -> None:
    """Loss and accuracy against step (train and eval) into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train" and _number(r.get("loss"))]
    evals = [r for r in records if r.get("kind") == "eval" and _number(r.get("loss"))]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval")
    # a mixture: each source's loss (records with loss/NAME), train thin, eval dotted, one colour each
    names = list(dict.fromkeys(k.split("/", 1)[1] for r in train + evals for k in r if k.startswith("loss/")))
    for i, name in enumerate(names):
        colour, key = f"C{i + 2}", f"loss/{name}"
        rows = [r for r in train if _number(r.get(key))]
        ax_loss.plot([r["step"] for r in rows], [r[key] for r in rows], color=colour, lw=0.6, alpha=0.8, label=name)
        rows = [r for r in evals if _number(r.get(key))]
        if rows:
            ax_loss.plot([r["step"] for r in rows], [r[key] for r in rows], ":o", color=colour, ms=3)
    ax_loss.set(xlabel="step", ylabel="loss per target token", title="loss")
    ax_loss.legend()
    ax_acc.plot([r["step"] for r in train], [r["accuracy"] for r in train], label="train", lw=1)
    if evals:
        ax_acc.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="eval")
    if chance is not None:
        ax_acc.axhline(chance, color="grey", ls="--", label=f"chance {chance:.3f}")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="next-token accuracy on scored targets", ylim=(0, 1))
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
