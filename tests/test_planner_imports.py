"""The planner's pure side imports no torch (``loongtrain plan`` starts in a fraction of a
second), imports nothing above itself, the measuring side is imported only when asked for,
and the top-level package exposes the attention and training entry points lazily. Each
import check runs in a fresh interpreter, whose ``sys.modules`` says what was imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PURE_MODULES = [
    "loongtrain",
    "loongtrain._lazy",
    "loongtrain.options",
    "loongtrain.torch_support",
    "loongtrain.model.config",
    "loongtrain.parallel.config",
    "loongtrain.parallel.layout",
    "loongtrain.parallel.zero_grid",
    "loongtrain.attention.schedule",
    "loongtrain.attention.workspace",
    "loongtrain.planner",
    "loongtrain.planner.cli",
    "loongtrain.planner.specs",
    "loongtrain.planner.topology",
    "loongtrain.planner.cost",
    "loongtrain.planner.zero",
    "loongtrain.planner.memory",
    "loongtrain.planner.estimate",
    "loongtrain.planner.search",
    "loongtrain.planner.explain",
    "loongtrain.planner.report",
    "loongtrain.planner.simulate",
    "loongtrain.planner.fit",
    "loongtrain.planner.validation",
    "loongtrain.planner.maxlen",
    "loongtrain.plan_cli",
    "loongtrain.tools.calibrate",
]
#: what the planner may import from the rest of loongtrain (it is below everything else)
PLANNER_MAY_IMPORT = (
    "loongtrain.options",
    "loongtrain.parallel.config",
    "loongtrain.parallel.layout",
    "loongtrain.parallel.zero_grid",
    "loongtrain.model.config",
    "loongtrain.attention.schedule",
    "loongtrain.attention.workspace",
    "loongtrain.planner",
)


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_pure_modules_import_no_torch():
    imports = "; ".join(f"import {name}" for name in PURE_MODULES)
    out = _python(f"import sys; {imports}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    assert out.strip() == "[]"


def test_loongtrain_plan_runs_without_torch():
    code = (
        "import sys, contextlib, io\n"
        "from loongtrain.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    main(['plan', '--model', '7b-gqa', '--seq-len', '128K', '--devices', '64', '--json'])\n"
        "assert '\"ranked\"' in out.getvalue()\n"
        "measuring = ('loongtrain.tools.bench', 'loongtrain.tools.calibrate.groups')\n"
        "print('torch' in sys.modules, *(name in sys.modules for name in measuring))\n"
    )
    assert _python(code).split() == ["False", "False", "False"]


def test_planner_imports_nothing_above_itself():
    planner = Path(__file__).resolve().parents[1] / "src" / "loongtrain" / "planner"
    for path in sorted(planner.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] == "loongtrain":
                    allowed = any(name == ok or name.startswith(ok + ".") for ok in PLANNER_MAY_IMPORT)
                    assert allowed, f"{path.name} imports {name}"


def test_top_level_exports_are_lazy_and_complete():
    code = (
        "import sys, loongtrain as lt\n"
        "print('torch' in sys.modules)\n"
        "names = ['ParallelConfig', 'ParallelState', 'RankLayout', 'init_parallel', 'shard_sequence',\n"
        "         'unshard_sequence', 'head_context_attention', 'model_config', 'build_model', 'parallelize',\n"
        "         'materialize', 'forward_backward', 'MemoryOptions', 'SequenceLayout', 'sequence_layout']\n"
        "assert sorted(names) == sorted(lt.__all__), lt.__all__\n"
        "from loongtrain.model.llama import build_model\n"
        "from loongtrain.apply import parallelize\n"
        "from loongtrain.apply.init import materialize\n"
        "from loongtrain.options import MemoryOptions\n"
        "from loongtrain.train.step import forward_backward\n"
        "assert lt.build_model is build_model and lt.materialize is materialize\n"
        "assert lt.forward_backward is forward_backward and lt.MemoryOptions is MemoryOptions\n"
        "assert lt.parallelize is parallelize  # a plain function\n"
        "print('torch' in sys.modules)\n"
    )
    assert _python(code).split() == ["False", "True"]


def test_every_subpackage_is_an_attribute_of_the_package():
    import loongtrain as lt

    root = Path(lt.__file__).parent
    packages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    assert {"hf", "eval", "train", "planner"} <= set(packages)
    for name in packages:
        assert getattr(lt, name).__name__ == f"loongtrain.{name}"
