"""The freshness hash of an op's kernels: what a tuning-DB row records as ``source_hash``, so that a row
measured on other kernel code counts as stale.

    source_hash(OP)      # "fb1d402a4fba089c": computed when the op registers, then cached

It covers every function and Triton kernel reachable from the op's tuned implementations' forward and
backward, each as its qualified name and its AST (no comments, no docstrings, no formatting, no module
path: moving code between modules keeps the rows fresh, editing a kernel or a launcher stales them).
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
import threading
import types

_HASHES: dict = {}          # op -> its hash, from the launchers as registered
_LOCK = threading.Lock()


def source_hash(op) -> str:
    """The op's kernel hash (16 hex digits), cached per op: the registry computes it at registration, so a
    later monkeypatch of a launcher's global cannot change it."""
    found = _HASHES.get(op)
    if found is None:
        roots = [f for i in op.impls for f in (i.forward, i.backward) if f is not None]
        text = "\n".join(sorted(map(_normalised_source, _reachable(roots)))) or op.name
        with _LOCK:
            found = _HASHES.setdefault(op, hashlib.sha256(f"{op.schema_version}\n{text}".encode()).hexdigest()[:16])
    return found


def _reachable(roots: list) -> list:
    """Functions and Triton kernels reachable from `roots` through module globals, in the roots'
    modules and in liger_rt (library code of torch or triton does not count); a class reached there
    brings its methods (a launcher's helper class, e.g. MoE routing, changes behaviour too)."""
    home = {getattr(r, "__module__", "") for r in roots}
    seen, order, todo = set(), [], list(roots)
    while todo:
        fn = todo.pop()
        fn = getattr(fn, "fn", fn)               # triton JITFunction -> the Python function
        if (not isinstance(fn, (types.FunctionType, type)) or id(fn) in seen
                or not (fn.__module__ in home or fn.__module__.startswith("liger_rt."))):
            continue
        seen.add(id(fn))
        if isinstance(fn, type):
            todo += [m for m in map(_method_function, vars(fn).values()) if m is not None]
            continue
        order.append(fn)
        todo += [fn.__globals__.get(name) for name in set(_code_names(fn.__code__))]
    return sorted(order, key=lambda f: f.__qualname__)


def _method_function(member):
    """The plain function behind a class member (method, static/class method, property), else None."""
    member = getattr(member, "__func__", None) or getattr(member, "fget", None) or member
    return member if isinstance(member, types.FunctionType) else None


def _code_names(code) -> list[str]:
    out = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out += _code_names(c)
    return out


def _normalised_source(fn) -> str:
    """The function's qualified name and its code as the AST sees it: no comments, no docstrings, no
    formatting, no module."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return f"{fn.__qualname__}\n{ast.unparse(tree)}"
