"""The placement planner: a calibrated cost model of 2D head-context parallelism with
Double-Ring-Attention, a search over layouts, and a schedule simulator.

Pure modules (no process group): ``specs`` (clusters, models), ``topology`` (which hops
leave a node), ``cost`` (FLOPs, bytes, link and ring times), ``zero``, ``memory``,
``estimate`` (one layout), ``search`` (all layouts, baselines), ``explain``, ``report``,
``simulate`` (event-driven schedule) and ``timeline`` (PNG). Modules that start
processes: ``calibrate``, ``validate``, ``groups`` (fake backend). CLI: ``cli``.
"""

from loongtrain.planner.cost import Layout, Workload
from loongtrain.planner.estimate import Estimate, estimate
from loongtrain.planner.search import PlanResult, plan
from loongtrain.planner.specs import CLUSTER_PRESETS, ClusterSpec, PlanError, cluster_spec, model_spec

__all__ = [
    "CLUSTER_PRESETS",
    "ClusterSpec",
    "Estimate",
    "Layout",
    "PlanError",
    "PlanResult",
    "Workload",
    "cluster_spec",
    "estimate",
    "model_spec",
    "plan",
]
