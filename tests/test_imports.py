"""Imports inside liger_rt only go down the layers that docs/architecture.md lists ("Layers"), read
from that table: a static walk of every module's imports (module level and inside functions), so an
import that runs up the order fails here even where no cycle (yet) closes, and a lazy import hides
nothing.  Within one layer imports may go either way, but never in a cycle."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import liger_rt

ROOT = Path(liger_rt.__file__).parent
PACKAGE = "liger_rt"
DOC = ROOT.parent / "docs" / "architecture.md"


def layers() -> list[list[str]]:
    """The "Layers" table of docs/architecture.md, bottom first: each row `| n | `mod` `mod` | ... |`."""
    rows = re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", DOC.read_text(), flags=re.M)
    assert rows, f"{DOC} has no layer table"
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1)), "layers are numbered 1, 2, ... in order"
    return [[f"{PACKAGE}.{m}" for m in re.findall(r"`([\w.]+)`", mods)] for _, mods in rows]


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
    ``if TYPE_CHECKING:`` blocks (annotations only), with whether it sits inside a function."""
    stack = [(tree, False)]
    while stack:
        node, local = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend((n, local) for n in node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, local
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node, local
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _package_attribute_uses(tree: ast.AST):
    """``liger_rt.a.b`` attribute chains (after ``import liger_rt``: the root loads its submodules lazily, so
    such a use imports them as surely as an import statement), with whether each sits inside a function."""
    stack = [(tree, False)]
    while stack:
        node, local = stack.pop()
        if isinstance(node, ast.Attribute):
            parts, inner = [], node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == PACKAGE:
                yield ".".join([PACKAGE, *reversed(parts)]), local
                continue
        inner_local = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner_local) for child in ast.iter_child_nodes(node))


def import_edges() -> dict[str, dict[str, bool]]:
    """module -> {liger_rt module it imports: whether only inside functions}.  ``from X import name`` is
    an edge to X.name when that is a module, else to X; importing a submodule is not counted as importing
    its parent packages (Python does run them, but they import their children, not the importer)."""
    mods = _modules()
    edges: dict[str, dict[str, bool]] = {m: {} for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, local in _import_nodes(tree):
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
            if PACKAGE in targets:              # import liger_rt: what it then reaches through the root counts
                targets += [t for t, in_fn in _package_attribute_uses(tree) if in_fn or not local]
            for target in targets:
                while target and target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]      # import a.b.c where c is a name
                if target in mods and target != mod:
                    edges[mod][target] = edges[mod].get(target, True) and local
    return edges


def import_graph() -> dict[str, set[str]]:
    return {m: set(ts) for m, ts in import_edges().items()}


def layer_of(module: str, table: list[list[str]]) -> int | None:
    """The layer of the longest listed name that is `module` or a package above it."""
    best = None
    for i, names in enumerate(table):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    return None if best is None else best[0]


def upward_imports(edges: dict[str, dict[str, bool]], table: list[list[str]]) -> list[str]:
    """Each import of a module in a higher layer than the importer's, as "a (layer n) -> b (layer m)"."""
    out = []
    for mod, targets in sorted(edges.items()):
        if mod == PACKAGE:
            continue
        for target, local in sorted(targets.items()):
            if target == PACKAGE:
                continue       # the root imports nothing at import (below): importing it costs no layer
            a, b = layer_of(mod, table), layer_of(target, table)
            if b > a:
                out.append(f"{mod} (layer {a + 1}) -> {target} (layer {b + 1}){' inside a function' if local else ''}")
    return out


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
    edges = import_edges()
    assert "liger_rt.layers.loss" in edges and "liger_rt._swaps" in edges
    assert edges["liger_rt.layers.norms"]["liger_rt.ops"] is False             # from .. import ops
    assert edges["liger_rt.patch.core"]["liger_rt.layers.loss"] is True         # inside a function
    assert "liger_rt.patch.core" in edges["liger_rt.patch"]                     # from . import core
    assert "liger_rt.dispatch" not in edges["liger_rt.op"]                      # annotations only (TYPE_CHECKING)


def test_the_walk_sees_what_import_liger_rt_reaches_through_the_root():
    tree = ast.parse("import liger_rt\nX = liger_rt.env\ndef f():\n    return liger_rt.ops.rms_norm\n")
    assert sorted(_package_attribute_uses(tree)) == [("liger_rt.env", False), ("liger_rt.ops.rms_norm", True)]


def test_find_cycle_and_upward_imports_report_what_breaks_the_order():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    table = [["liger_rt.env"], ["liger_rt.kernels"]]
    edges = {"liger_rt.env": {"liger_rt.kernels.rms_norm": True}, "liger_rt.kernels.rms_norm": {"liger_rt.env": False}}
    assert upward_imports(edges, table) == [
        "liger_rt.env (layer 1) -> liger_rt.kernels.rms_norm (layer 2) inside a function"]


def test_every_module_has_a_layer():
    table = layers()
    listed = [name for names in table for name in names]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    missing = sorted(m for m in _modules() if m != PACKAGE and layer_of(m, table) is None)
    assert not missing, f"add these to the layer table of {DOC.name}: {missing}"
    unknown = sorted(n for n in listed if n not in _modules())
    assert not unknown, f"{DOC.name} lists modules that do not exist: {unknown}"


def test_no_import_runs_up_the_layers():
    bad = upward_imports(import_edges(), layers())
    assert not bad, "imports that run up the layers of docs/architecture.md:\n" + "\n".join(bad)


def test_the_runtime_core_imports_at_module_level():
    """Up to `ops` (the runtime a call goes through) every import of a liger_rt module is at module level,
    where a reader sees it; one inside a function needs a comment naming the cycle or the import time it
    avoids."""
    table = layers()
    core = table.index([f"{PACKAGE}.ops"])
    bad = []
    for mod, path in sorted(_modules().items()):
        if mod == PACKAGE or layer_of(mod, table) > core:
            continue
        lines = path.read_text().splitlines()
        for node, local in _import_nodes(ast.parse("\n".join(lines))):
            named = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [PACKAGE])
            ours = isinstance(node, ast.Call) or any(n == PACKAGE or n.startswith(PACKAGE + ".") for n in named)
            if local and ours and not re.search(r"#.*(cycle|import time)", lines[node.lineno - 1]):
                bad.append(f"{mod}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bad, "function-local imports without a reason:\n" + "\n".join(bad)


def test_the_package_root_imports_nothing_at_import():
    """`import liger_rt` stays cheap: the root's attributes (ops, patch, ...) load on first access."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    # but liger_rt.patch: a module of plain functions importing nothing at import, bound at import so that
    # `liger_rt.patch` stays the function whatever imports the submodule later (tests/test_patch.py)
    assert not [n for n, local in _import_nodes(tree) if not local and
                (isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith(PACKAGE)))
                and not (n.level == 1 and n.module == "patch")]


def test_no_import_cycle_in_liger_rt():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
