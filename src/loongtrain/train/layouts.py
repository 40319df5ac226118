"""``parallel.layout = "per_batch"``: every hp x cp split of the sequence-parallel group as
its own :class:`~loongtrain.parallel.ParallelState` (process groups made once, at start),
each under the run's balance and under ``locality`` (a view of the split's state: the same
groups), and each microbatch on the one :func:`~loongtrain.attention.choose.choose_layout`
prices fastest for its documents. Every rank of a group chooses the same from the same batch, and
every split covers the same ranks, so FSDP's collectives (one mesh over all ranks) and the
number of forward/backward passes per step do not change."""

from __future__ import annotations

import torch

from loongtrain.attention.choose import CPU_GLOO, GPU_NODE, AttentionShape, candidate_configs, choose_layout
from loongtrain.data.batch import Microbatch
from loongtrain.model.config import ModelConfig
from loongtrain.parallel import ParallelState, init_parallel


class PerBatchLayouts:
    """Callable: a microbatch -> the state it is sharded and attended on. ``states[0]`` is the
    run's own (configured) layout; build with :meth:`build`."""

    def __init__(self, states: list[ParallelState], model: ModelConfig, elem_bytes: int) -> None:
        self.states = states
        self.configs = [s.config for s in states]
        self.shape = AttentionShape(model.n_heads, model.n_kv_heads, model.head_dim, elem_bytes)
        # every layer priced by its own window (sliding layers interleaved with full ones weigh by their count)
        self.windows = model.windows
        self.speeds = GPU_NODE if states[0].device.type == "cuda" else CPU_GLOO

    @classmethod
    def build(
        cls, state: ParallelState, model: ModelConfig, param_dtype: torch.dtype, verify_inputs: bool,
        head_groups: int = 1,
    ) -> PerBatchLayouts:  # fmt: skip
        """Collective: a state for every other split of ``state``'s ranks the model's heads (and its
        ``head_groups``) allow (groups made once per split; the other balance is a view of the
        split's state)."""
        configs = candidate_configs(state.config, model.n_heads, model.n_kv_heads, ("locality",), head_groups)
        splits = {(state.hp, state.cp): state}
        states = [state]
        for c in configs[1:]:
            base = splits.get((c.hp, c.cp))
            if base is None:
                base = init_parallel(c, device=state.device, verify_inputs=verify_inputs, zero_scopes=())
                splits[(c.hp, c.cp)] = base
            states.append(base if base.config == c else base.with_balance(c.balance))
        return cls(states, model, torch.finfo(param_dtype).bits // 8)

    @property
    def alternatives(self) -> list[ParallelState]:
        """The states besides the run's own (``parallelize``'s ``alternatives``)."""
        return self.states[1:]

    @property
    def counters(self) -> list:
        """Each distinct ``stats`` of the states once (a balance's view shares its split's)."""
        return list({id(s.stats): s.stats for s in self.states}.values())

    def __call__(self, mb: Microbatch) -> ParallelState:
        documents = mb.attention_documents
        bounds = None if documents is None else tuple(documents.tolist())
        seq = mb.tokens.shape[1]
        return self.states[choose_layout(self.configs, seq, bounds, self.windows, self.shape, self.speeds)]
