"""The goals a GPU run is judged against (issues 37, 40, 42, 43; one H200's numbers), in one place
for the GPU check's rows, the peer benchmark and the verdict that ends ``scripts/gpu_run.sh``.
Pure: no torch, so the verdict reads a killed run's files without importing it."""

from __future__ import annotations

#: replayed / fused time of the double ring at S >= 32K
REPLAY_GOAL = 1.10
#: the chosen kernel / the fastest SDPA backend, dense causal, S >= 32K
DENSE_GOAL = 1.10
#: one sequence / packed documents (lognormal, median 2K), by length
DOCUMENTS_GOAL = {32768: 3.0, 131072: 11.0}
#: tokens/s of the planner's policy (auto) and of sc++ forced on the 1.1B model, by (length, mode)
TOKENS_GOAL = {(32768, "auto"): 40_600, (131072, "auto"): 14_500, (32768, "sc++"): 35_700}
#: peak memory (GiB) of sc++ forced (0.75x the plain PyTorch step's), by (length, mode)
PEAK_GIB_GOAL = {(32768, "sc++"): 24.0, (131072, "sc++"): 65.0}
#: |measured / predicted peak - 1| of the auto rows
POLICY_MEMORY_GOAL = 0.05
#: |predicted / measured step - 1|
PLANNER_GOAL = 0.20
#: loongtrain auto's tokens/s over transformers' with its checkpointing, same run, by length
PEER_GOAL = {32768: 1.5, 131072: 1.3}
#: largest difference of a step's loss between two runs that should compute the same (bf16
#: compute; nondeterministic kernels), relative to the loss
SAME_LOSS_RTOL = 2e-3
