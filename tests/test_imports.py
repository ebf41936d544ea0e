"""No import cycle inside liger_rt: a static walk of every module's imports (module level and
inside functions), so a cycle that a lazy import hides today fails here too."""
from __future__ import annotations

import ast
from pathlib import Path

import liger_rt

ROOT = Path(liger_rt.__file__).parent
PACKAGE = "liger_rt"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement, and importlib.import_module("<literal>") call, outside
    ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """module -> the liger_rt modules it imports.  ``from X import name`` is an edge to X.name
    when that is a module, else to X; importing a submodule is not counted as importing its
    parent packages (Python does run them, but they import their children, not the importer)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.Call):
                targets = [node.args[0].value]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
            for target in targets:
                while target and target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]      # import a.b.c where c is a name
                if target in mods and target != mod:
                    graph[mod].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_walk_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "liger_rt.layers.loss" in graph and "liger_rt._swaps" in graph
    assert "liger_rt.ops" in graph["liger_rt.layers.norms"]                 # from .. import ops
    assert "liger_rt.layers.loss" in graph["liger_rt.patch.core"]           # inside a function
    assert "liger_rt.patch.core" in graph["liger_rt.patch"]                 # from . import core


def test_find_cycle_reports_the_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_layers_never_import_patch():
    graph = import_graph()
    offenders = {m: sorted(t for t in ts if t == "liger_rt.patch" or t.startswith("liger_rt.patch."))
                 for m, ts in graph.items() if m.startswith("liger_rt.layers")}
    assert not any(offenders.values()), offenders


def test_no_import_cycle_in_liger_rt():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
