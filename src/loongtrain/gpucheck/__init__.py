"""The GPU acceptance check (``loongtrain gpu-check``, ``scripts/gpu_check.sh``): every device
path of loongtrain in one run and one table.

- :mod:`~loongtrain.gpucheck.check`: the command, profiles, budget and the report;
- :mod:`~loongtrain.gpucheck.kernels`: block kernels and the lse merge against float64;
- :mod:`~loongtrain.gpucheck.train`: timed training steps with MFU beside the planner's prediction;
- :mod:`~loongtrain.gpucheck.dist`: the distributed attention and training on 2+ devices.
"""
