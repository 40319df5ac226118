"""The GPU acceptance check (``loongtrain gpu-check``, ``scripts/gpu_check.sh``): every device
path of loongtrain in one run and one table; and the end of the lent GPU's one run
(``scripts/gpu_run.sh``).

- :mod:`~loongtrain.tools.gpucheck.check`: the command, profiles, budget and the report (JSON lines as rows end);
- :mod:`~loongtrain.tools.gpucheck.kernels`: block kernels and the lse merge against float64;
- :mod:`~loongtrain.tools.gpucheck.train`: timed training steps with MFU beside the planner's prediction,
  and each row's time estimate;
- :mod:`~loongtrain.tools.gpucheck.dist`: the distributed attention and training on 2+ devices;
- :mod:`~loongtrain.tools.gpucheck.goals`: the goals a GPU run is judged against;
- :mod:`~loongtrain.tools.gpucheck.verdict`: what comes back from the GPU machine, and the verdict table.
"""
