"""``torch.compile`` per transformer block (the torchtitan recipe).

Each block is compiled in place (``nn.Module.compile``: parameter names do not change, so
checkpoints load across the switch) after activation checkpointing is applied and before
FSDP2 wraps it. The distributed attention stays opaque to the compiler: it is three custom
ops with fake implementations, so inductor fuses the norms, projections, RoPE and MLP
around it while the ring and all-to-all run as written. Selective Checkpoint++ still keeps
the attention ops' outputs (its policy is applied by the compiled graph's partitioner).
"""

from __future__ import annotations

import logging

from loongtrain.model.llama import Transformer

# Under sc++ torch.compile warns once per process that a selective-checkpoint policy is in
# use ("make sure the checkpointed region does not contain in-place ops"). The blocks hold
# none (compiled == eager is tested under every checkpoint mode), and the same lines from
# every rank buried the trainer's output, so that one logger is kept to errors.
_SELECTIVE_CHECKPOINT_NOTICE = "torch._higher_order_ops.wrap"


def compile_counts() -> dict[str, int]:
    """Graphs ``torch.compile`` has made in this process so far (a recompile makes one more) and
    the graph breaks it met. Read from dynamo's ``torch._dynamo.utils.counters``, in this one
    place: PyTorch has no public API for them (``torch._dynamo.explain`` compiles anew)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def apply_compile(model: Transformer, fullgraph: bool = True) -> None:
    """Compile every transformer block of ``model`` in place.

    ``fullgraph=True`` makes any graph break an error (one graph per block, as intended).
    """
    logging.getLogger(_SELECTIVE_CHECKPOINT_NOTICE).setLevel(logging.ERROR)
    for layer in model.layers:
        layer.compile(fullgraph=fullgraph)
