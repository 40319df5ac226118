"""The package's layers, read from the import graph: no module imports from a layer above it.

A layer is a set of top-level packages or modules of ``loongtrain``; every ``import`` or
``from ... import`` of ``loongtrain.X`` in a module of layer ``i`` must name an ``X`` of
layer ``<= i`` (lazy imports inside functions count too).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "loongtrain"

#: Lowest first. The library (up to ``train``/``eval``) never imports the tools above it.
LAYERS: list[set[str]] = [
    {"_lazy", "options", "torch_support", "local_workers"},  # names and checks; how workers start; no torch
    {"parallel"},  # degrees, rank layouts, process groups
    {"attention"},  # kernels, sequence layout, ring, all-to-all, 2D attention
    {"model"},  # the Llama model (knows nothing of parallelism beyond its attention function)
    {"planner", "apply", "data", "config", "launch"},  # cost model (pure); parallelize; data; config; launcher
    {"hf"},  # Hugging Face mapping and loading
    {"train"},  # the trainer, checkpoints, export
    {"eval", "generate"},  # long-context evaluation; generation on the training layout
    {"tools"},  # benchmarks, the planner's measuring side, the GPU check, the demo and their shared harness
    {"plan_cli", "cli", "__main__", "__init__"},  # the commands and the package's lazy exports
]


def _unit(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_units(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "loongtrain" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_unit_has_a_layer():
    layer_of = {u for layer in LAYERS for u in layer}
    units = {_unit(p) for p in SRC.rglob("*.py")}
    assert units - layer_of == set(), "add the new package or module to LAYERS"


def test_no_module_imports_from_a_layer_above_it():
    index = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        mine = index[_unit(path)]
        for other in _imported_units(path):
            if index.get(other, -1) > mine:
                upward.append(f"{path.relative_to(SRC)} imports loongtrain.{other}")
    assert upward == []
