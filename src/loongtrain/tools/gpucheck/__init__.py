"""The GPU acceptance check (``loongtrain gpu-check``, ``scripts/gpu_check.sh``): every device
path of loongtrain in one run and one table.

- :mod:`~loongtrain.tools.gpucheck.check`: the command, profiles, budget and the report;
- :mod:`~loongtrain.tools.gpucheck.kernels`: block kernels and the lse merge against float64;
- :mod:`~loongtrain.tools.gpucheck.train`: timed training steps with MFU beside the planner's prediction;
- :mod:`~loongtrain.tools.gpucheck.dist`: the distributed attention and training on 2+ devices.
"""
