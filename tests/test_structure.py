"""The package's shape: sub-packages by job, imports one way, no cycles; the POET layer in one
home (its autograd Functions in one file, kernels called by name, a kernel within six calls of
the module).

``poetxq.tools`` → ``poetxq.adapt`` (forward-only adaptation) → ``poetxq.training`` →
``poetxq.model`` / ``poetxq.data`` / ``poetxq.baselines`` (the baselines' update rules, which know
no recipe) → ``quant_kernels``, with
``poetxq.paths``, ``poetxq.text`` and ``poetxq.schema`` at the bottom for everyone. Imports
inside functions count too: a lazy import hides a dependency from import time, not from the
design.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: sub-package -> the sub-packages it may import (besides itself and the shared leaf modules)
ALLOWED = {
    "quant_kernels": set(),
    "poetxq.data": set(),
    "poetxq.model": {"quant_kernels"},
    "poetxq.baselines": set(),
    "poetxq.training": {"poetxq.model", "poetxq.data", "poetxq.baselines", "quant_kernels"},
    "poetxq.adapt": {"poetxq.training", "poetxq.model", "poetxq.data", "quant_kernels"},
    "poetxq.tools": {
        "poetxq.adapt", "poetxq.training", "poetxq.model", "poetxq.data", "poetxq.baselines",
        "quant_kernels",
    },
}  # fmt: skip
SHARED = {"poetxq", "poetxq.paths", "poetxq.text", "poetxq.schema"}


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("poetxq", "quant_kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _defining_module(module: str, name: str) -> str:
    """The module ``from module import name`` depends on: a sub-module of that name, else the
    module that defines the object (a package re-exporting a name depends on its definition)."""
    if f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    obj = getattr(importlib.import_module(module), name, None)
    owner = getattr(obj, "__module__", None)
    return owner if owner in MODULES else module


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _walk_at_import(node: ast.AST):
    """``node`` and what runs with it when the module is imported: not function bodies, nor
    ``if TYPE_CHECKING:`` blocks."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return
    if isinstance(node, ast.If) and _is_type_checking(node):
        return
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _walk_at_import(child)


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(modules imported at import time, modules imported anywhere), TYPE_CHECKING left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node)
        for child in node.body
        for n in ast.walk(child)
    }
    top = {id(n) for node in tree.body for n in _walk_at_import(node)}
    at_import, anywhere = set(), set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            targets = {_defining_module(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.Import):
            targets = {a.name for a in node.names if a.name in MODULES}
        else:
            continue
        anywhere |= targets
        if id(node) in top:
            at_import |= targets
    return at_import, anywhere


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "quant_kernels":
        return "quant_kernels"
    if len(parts) > 1 and (ROOT / "poetxq" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt == node:
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle_at_import_time_or_through_lazy_imports():
    assert _cycle({m: at for m, (at, _) in GRAPH.items()}) is None
    assert _cycle({m: anywhere for m, (_, anywhere) in GRAPH.items()}) is None


def test_sub_packages_import_one_way():
    wrong = sorted(
        f"{module} -> {target}"
        for module, (_, anywhere) in GRAPH.items()
        for target in anywhere
        if _package(module) in ALLOWED
        and _package(target) != _package(module)
        and _package(target) not in SHARED
        and _package(target) not in ALLOWED[_package(module)]
    )
    assert wrong == []


def test_every_module_belongs_to_a_sub_package_or_is_shared():
    loose = sorted(m for m in MODULES if _package(m) not in ALLOWED and m not in SHARED)
    assert loose == ["poetxq.__main__"]


# -- the POET layer has one home (docs/KERNELS.md: from the module to a kernel) --------------------

#: the one file of the layer's autograd Functions
LAYER_FUNCTIONS = "poetxq.model.functions"


def _subclasses_of(tree: ast.AST, base: str) -> list[str]:
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith(base) for b in node.bases)
    ]


def test_the_layers_autograd_functions_live_in_one_file():
    """Nowhere in poetxq.model or poetxq.adapt but in model/functions.py does an autograd
    Function of a linear layer appear (blockcache's concatenation of Q is not one)."""
    found = {
        name: _subclasses_of(ast.parse(MODULES[name].read_text(encoding="utf-8")), "Function")
        for name in MODULES
        if _package(name) in ("poetxq.model", "poetxq.adapt")
    }
    elsewhere = {m: fns for m, fns in found.items() if fns and m != LAYER_FUNCTIONS}
    assert elsewhere == {"poetxq.model.blockcache": ["_AdjacentRows"]}
    assert found[LAYER_FUNCTIONS]


def test_no_kernel_is_found_by_a_built_name():
    """Kernels are called by name, so grep finds every caller: no ``getattr`` of a module with
    a computed attribute name in poetxq or quant_kernels."""
    built = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in ("quant_kernels", "ops", "streamed", "formats")
                and not isinstance(node.args[1], ast.Constant)
            ):
                built.append(f"{name}:{node.lineno}")
    assert built == []


def test_a_layer_reaches_each_kernel_within_six_calls():
    """One ``mem`` training forward (int8, feature-major, slab-streamed GEMM, fused CNP), traced
    under the Triton interpreter: from ``POETXLinear.forward`` to a function of each kernel file
    it runs, at most six calls (five to the slab-streamed GEMM, four to the permute-transpose
    and to the fused CNP)."""
    import sys

    import torch

    from poetxq.model.layer import POETXLinear
    from quant_kernels.policy import HAS_TRITON, KernelPolicy

    if not HAS_TRITON:
        import pytest

        pytest.skip("needs triton (its CPU interpreter serves here)")
    policy = KernelPolicy(interpret_on_cpu=True, weight_gemm="streamed")
    gen = torch.Generator().manual_seed(0)
    layer = POETXLinear(32, 48, block_size=16, kernels=policy, generator=gen)
    x = torch.randn(8, 32, generator=gen, requires_grad=True)
    kernel_files = {"streamed.py", "transpose_perm.py", "cnp_hybrid.py"}
    stack: list[tuple[object, str]] = []
    depth: dict[str, int] = {}

    def trace(frame, event, _arg):
        path = Path(frame.f_code.co_filename)
        if event == "call" and ROOT in path.parents and ".venv" not in path.parts:
            names = [n for _, n in stack]
            if "POETXLinear.forward" in names and path.name in kernel_files:
                start = len(names) - 1 - names[::-1].index("POETXLinear.forward")
                calls = len(names) - start
                depth[path.name] = min(depth.get(path.name, calls), calls)
            stack.append((frame, frame.f_code.co_qualname))
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()

    sys.setprofile(trace)
    try:
        layer(x)
    finally:
        sys.setprofile(None)
    assert set(depth) == kernel_files, depth
    assert max(depth.values()) <= 6, depth


#: the recipe's resolved switches: settings whose value on a run the run plan decides
#: (poetxq.training.plan.RunPlan: cuda_graph, grad_sync, precision, fuse)
RESOLVED_SWITCHES = ("cuda_graph", "grad_sync", "precision", "fuse_elementwise")
#: the modules that may read them off a recipe's ``train`` section, and why
SWITCH_READERS = {
    "poetxq.training.recipe": "the schema: its checks of how the settings combine",
    "poetxq.training.plan": "resolves them once (resolve_plan)",
    "poetxq.training.cudagraph": "graph_wanted, graph_hint, grad_sync_mode (called by the plan) "
    "and the capture's fallback, which only train.cuda_graph: auto allows",
    "poetxq.model.fuse": "fuse_wanted (called by the plan)",
    "poetxq.training.precision": "run_precision and cpu_note (called by the plan)",
    "poetxq.training.memory": "the memory plan, whose optimizer offload gives way to the "
    "recipe's own train.cuda_graph: true",
    "poetxq.tools.cli_tools": "estimate-memory's note compares train.precision as written with "
    "the value the memory plan set (the setting, not the resolved precision)",
    "poetxq.tools.run_dir": "a run directory from before plan.json: its precision resolved "
    "again from recipe.yaml",
}


def _switch_reads(path: Path) -> list[str]:
    """``train.<switch>`` / ``tc.<switch>`` / ``<x>.train.<switch>`` reads in ``path`` (the
    names a recipe's ``train`` section goes by in this code base)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Attribute) and node.attr in RESOLVED_SWITCHES):
            continue
        base = node.value
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if name in ("train", "tc"):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_only_the_plan_and_its_deciding_functions_read_the_resolved_switches():
    """The trainer, the bench and the builder read the run plan (``plan.cuda_graph``, ...), not
    ``recipe.train.cuda_graph``: a new reader of a switch would re-decide what the plan decided
    (and could decide it differently). Each module allowed to read them says why."""
    found = [
        hit
        for module, path in MODULES.items()
        if module not in SWITCH_READERS
        for hit in _switch_reads(path)
    ]
    assert found == [], "read the run plan (poetxq.training.plan) instead:\n" + "\n".join(found)
    assert all(_switch_reads(MODULES[m]) for m in SWITCH_READERS), "an exemption no longer used"
