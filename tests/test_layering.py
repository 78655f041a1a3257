"""The project's fences, read from its source: private torch is reached only through the compat
modules, the floors import one way, and no modules import each other in a circle."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPAT = {"passes/_compat.py", "passes/inductor_memory.py"}
"""The modules allowed to reach into torch's private code (README: Supported torch)."""
INTERNAL_ATTRIBUTES = {"kineto_results"}
"""Attributes of torch objects that are private without a leading underscore."""
NOT_TORCH = {"_getframe"}
"""Private names of the standard library the code reads (sys._getframe): no reach into torch."""
TOOLS = "ckpt_fx.bench"
"""The bench and its helpers: the core (what users import) never imports them."""


def _sources() -> list[pathlib.Path]:
    return sorted(p for folder in ("ckpt_fx", "passes", "examples") for p in (ROOT / folder).rglob("*.py"))


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _own_private_names(trees: dict[pathlib.Path, ast.AST]) -> set[str]:
    """Private names the project defines itself (functions, classes, attributes, fields): reading
    them is no reach into torch."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
    return {n for n in names if _private(n)}


def private_torch_uses(trees: dict[pathlib.Path, ast.AST]) -> list[str]:
    """Every reach into torch's private code outside the compat modules: an import of a private
    module (torch._dynamo), a from-import of a private name (from torch.utils import _pytree), a
    private attribute of a torch path (torch._dynamo.reset) or of any object when the project does
    not define that name itself (gm.graph._codegen, module._parameters), and the few private
    attributes without an underscore (prof.profiler.kineto_results)."""
    own = _own_private_names(trees)
    found = []
    for path, tree in trees.items():
        where = str(path.relative_to(ROOT))
        if where in COMPAT:
            continue
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("torch.") and any(map(_private, a.name.split(".")))]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
                if any(map(_private, node.module.split("."))):
                    names = [node.module]
                else:
                    names = [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute):
                dotted = _dotted(node) or ""
                if dotted.startswith("torch.ops."):
                    continue  # aten ops are named where they are matched (torch.ops.aten._foo)
                if dotted.startswith("torch."):
                    if any(map(_private, dotted.split(".")[1:])):
                        names = [dotted]
                elif node.attr in INTERNAL_ATTRIBUTES or (_private(node.attr) and node.attr not in own | NOT_TORCH):
                    names = [f"<object>.{node.attr}"]
            found += [f"{where}:{node.lineno} {n}" for n in names]
    return sorted(set(found))


def imports_of(trees: dict[pathlib.Path, ast.AST]) -> dict[str, set[str]]:
    """{module: the project's modules it imports}, anywhere in it (functions, TYPE_CHECKING too)."""
    modules = {_module(p) for p in trees}
    graph: dict[str, set[str]] = {}
    for path, tree in trees.items():
        here = _module(path)
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets.add(node.module)
                targets |= {f"{node.module}.{a.name}" for a in node.names}
        graph[here] = {t for t in targets if t in modules and t != here}
    return graph


@pytest.fixture(scope="module")
def trees() -> dict[pathlib.Path, ast.AST]:
    return {p: ast.parse(p.read_text()) for p in _sources()}


def test_private_torch_only_through_the_compat_modules(trees):
    """README: every reach into torch's private code goes through passes/_compat.py (and Inductor's
    memory model through passes/inductor_memory.py)."""
    assert private_torch_uses(trees) == []


@pytest.mark.parametrize("planted", [
    "from torch.utils import _pytree\n",
    "import torch._dynamo\n",
    "def f(gm):\n    return gm.graph._codegen\n",
    "def f(prof):\n    return prof.profiler.kineto_results\n",
    "def f(m):\n    return m._parameters\n",
    "import torch\ntorch._dynamo.reset()\n",
])
def test_the_private_check_catches_a_planted_use(trees, planted):
    """The check above can fail: each kind of private use, planted in a copy of ckpt_fx/fit.py, is found."""
    path = ROOT / "ckpt_fx" / "fit.py"
    planted_trees = {**trees, path: ast.parse(path.read_text() + "\n" + planted)}
    assert private_torch_uses(planted_trees), planted


def test_the_floors_import_one_way(trees):
    """passes/ never imports ckpt_fx; ckpt_fx's core (what users import) never imports the tools
    (ckpt_fx.bench); the examples use the package as a user would."""
    graph = imports_of(trees)
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if m.startswith("passes") and t.startswith("ckpt_fx"))
    assert upward == []
    core_to_tools = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                           if m.startswith("ckpt_fx") and not m.startswith(TOOLS) and m != "ckpt_fx.__main__"
                           and t.startswith(TOOLS))
    assert core_to_tools == []


def test_no_import_circles(trees):
    """No module imports, directly or through others, one that imports it (type-only imports
    included): each floor can be read bottom up."""
    graph = imports_of(trees)
    # A package's __init__ that re-exports its submodules is not a circle with them.
    edges = {m: {t for t in ts if not m.startswith(t + ".") and not t.startswith(m + ".")} for m, ts in graph.items()}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif state.get(nxt) is None:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    assert cycles == []


@pytest.mark.parametrize("module", ["passes.costs", "ckpt_fx.fit", "ckpt_fx.bench.table"])
def test_a_deprecation_attributed_to_our_code_fails_the_suite(module):
    """pyproject.toml's filters: a DeprecationWarning or FutureWarning that torch (or anything)
    attributes to our code, about an API we call, is an error in the suite, not hidden."""
    import warnings

    for category in (DeprecationWarning, FutureWarning):
        with pytest.raises(category):
            warnings.warn_explicit("this API goes away", category, filename="x.py", lineno=1, module=module)
    warnings.warn_explicit("not ours", DeprecationWarning, filename="x.py", lineno=1, module="some_library")


COMPILER_NAMES = {"eager", "inductor", "min_cut"}
"""How options and torch name inner compilers and partitioners."""
PARSES_OPTIONS = {"ckpt_fx/dynamo_backend.py", "ckpt_fx/__main__.py", "passes/targets.py"}
"""Where a name of an inner compiler may be compared: the options and the command line that parse
it, the targets it names; the bench (ckpt_fx/bench/) compares torch's own backend names."""


def compared_compiler_names(trees: dict[pathlib.Path, ast.AST]) -> list[str]:
    """Comparisons with a name of an inner compiler outside the code that parses options: past
    it, the passes and the package ask a Target (passes/targets.py)."""
    found = []
    for path, tree in trees.items():
        relative = path.relative_to(ROOT).as_posix()
        if relative in PARSES_OPTIONS or relative.startswith("ckpt_fx/bench/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value in COMPILER_NAMES for o in operands):
                    found.append(f"{relative}:{node.lineno}")
    return found


def test_the_inner_compiler_is_asked_not_named(trees):
    assert compared_compiler_names(trees) == []


def test_the_compiler_name_check_catches_a_planted_comparison(trees):
    path = ROOT / "passes" / "planner.py"
    planted = {**trees, path: ast.parse(path.read_text() + "\nflag = joint_partitioner == 'min_cut'\n")}
    assert compared_compiler_names(planted) == [f"passes/planner.py:{len(path.read_text().splitlines()) + 2}"]
