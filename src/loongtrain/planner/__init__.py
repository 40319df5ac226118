"""The placement planner: a calibrated cost model of 2D head-context parallelism with
Double-Ring-Attention, a search over layouts, and a schedule simulator.

Every module here is pure Python (no torch, no process group): ``specs`` (clusters,
models), ``topology`` (which hops leave a node), ``cost`` (FLOPs, bytes, link and ring
times), ``zero``, ``memory``, ``estimate`` (one candidate), ``search`` (all candidates,
baselines), ``explain``, ``report``, ``simulate`` (event-driven schedule on modelled
links), ``timeline`` (PNG, matplotlib), ``fit`` (calibration fits), ``validation``
(what ``--validate`` compares) and ``anchors`` (published measurements the model is
checked against). The measuring side (``--calibrate``, ``--validate``,
``--check-groups``) lives in ``loongtrain.bench`` and is imported only when used. CLI: ``cli``.
"""

from loongtrain.planner.cost import Candidate, Workload
from loongtrain.planner.estimate import Estimate, estimate
from loongtrain.planner.search import SearchResult, search_layouts
from loongtrain.planner.specs import CLUSTER_PRESETS, ClusterSpec, PlanError, cluster_spec, model_spec

__all__ = [
    "CLUSTER_PRESETS",
    "Candidate",
    "ClusterSpec",
    "Estimate",
    "PlanError",
    "SearchResult",
    "Workload",
    "cluster_spec",
    "estimate",
    "model_spec",
    "search_layouts",
]
