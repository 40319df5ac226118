"""The tools around the library, which the library never imports (a layering test checks):

- :mod:`~loongtrain.tools.bench`: the benchmarks (``loongtrain bench ...``);
- :mod:`~loongtrain.tools.calibrate`: the planner's measuring side (``loongtrain plan
  --calibrate / --validate / --check-groups``, per-batch predictions from a token file);
- :mod:`~loongtrain.tools.gpucheck`: the GPU acceptance check (``loongtrain gpu-check``);
- :mod:`~loongtrain.tools.demo`: distributed attention against full attention on local processes;
- :mod:`~loongtrain.tools.harness`: inputs, layouts and timing shared by the above.
"""
