"""The placement planner: a calibrated cost model of 2D head-context parallelism with
Double-Ring-Attention, a search over layouts and memory options, and a schedule simulator.

Every module here is pure Python (no torch, no process group) and imports nothing above
itself (only ``loongtrain.options``, ``parallel.config``/``layout``/``zero_grid``,
``model.config`` and ``attention.schedule``): ``specs`` (clusters, models, Hugging Face
folders), ``topology`` (which hops leave a node), ``cost`` (``Candidate``, FLOPs, bytes,
link and ring times), ``zero``, ``memory`` (peak device and host memory, named terms),
``estimate`` (one candidate), ``search`` (all candidates, their memory options,
baselines), ``policy`` (the checkpointing that fills a device), ``ceiling`` (a step from
measured kernel rates alone), ``maxlen`` (the longest sequence that fits), ``explain``, ``report``,
``simulate`` (event-driven schedule on modelled links), ``timeline`` (PNG, matplotlib),
``fit`` (calibration fits) and ``validation`` (what ``--validate`` compares); the published
measurements the model is checked against are in ``tests/planner_anchors.py``. CLI: ``cli``; the measuring side
(``--calibrate``, ``--validate``, ``--check-groups``) is ``loongtrain.tools.calibrate``, joined
with this one by ``loongtrain.plan_cli``.
"""

from loongtrain.planner.cost import Candidate, Workload
from loongtrain.planner.estimate import Estimate, estimate
from loongtrain.planner.memory import MemoryBreakdown, predict_peak_memory
from loongtrain.planner.search import SearchResult, search_layouts
from loongtrain.planner.specs import CLUSTER_PRESETS, ClusterSpec, PlanError, cluster_spec, model_spec

__all__ = [
    "CLUSTER_PRESETS",
    "Candidate",
    "ClusterSpec",
    "Estimate",
    "MemoryBreakdown",
    "PlanError",
    "SearchResult",
    "Workload",
    "cluster_spec",
    "estimate",
    "model_spec",
    "predict_peak_memory",
    "search_layouts",
]
