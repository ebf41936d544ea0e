"""The op registry: every op by name, its kernel module imported on first use.

    from liger_rt.registry import REGISTRY
    op = REGISTRY.get("rms_norm")        # imports liger_rt.kernels.rms_norm, which registers its Op
    REGISTRY.names()                     # every op name, nothing imported

A new op adds one line to OP_MODULES; its kernel file ends with ``OP = dispatch.register(Op(...))``.
"""
from __future__ import annotations

import importlib
import threading
from typing import Mapping

from . import env
from .freshness import source_hash
from .op import Op

# op name -> the module that registers it
OP_MODULES = {name: f"liger_rt.kernels.{name}" for name in (
    "rms_norm", "swiglu", "layer_norm", "short_conv", "moe_router", "moe_experts", "cross_entropy",
    "fused_linear_cross_entropy", "fused_linear_logprobs", "rope", "geglu", "fused_add_rms_norm")}


class Registry:
    """Ops by name: the declared table of modules, and the ops registered so far (the table's, once their
    modules are imported, and any other, such as the tests' toy op)."""

    def __init__(self, modules: Mapping[str, str]):
        self._modules = dict(modules)
        self._ops: dict[str, Op] = {}
        self._lock = threading.Lock()
        env.declare_ops(dict.fromkeys(self._modules))

    def register(self, op: Op) -> Op:
        """Record `op` under its name and hash its kernels now (a later monkeypatch of a launcher's
        global cannot change the hash); ``dispatch.register`` calls this."""
        source_hash(op)
        with self._lock:
            self._ops[op.name] = op
        env.declare_ops({op.name: op.impl_names})
        return op

    def get(self, name: str) -> Op:
        """The op registered as `name`, importing its module on first use; ValueError naming the valid ops."""
        op = self._ops.get(name)
        if op is None:
            if name not in self._modules:
                raise ValueError(f"unknown op {name!r}; valid ops: {', '.join(self.names())}")
            importlib.import_module(self._modules[name])
            op = self._ops[name]
        return op

    def module(self, name: str) -> str:
        """The module that registers op `name`."""
        if name not in self._modules:
            raise ValueError(f"unknown op {name!r}; valid ops: {', '.join(self.names())}")
        return self._modules[name]

    def names(self) -> list[str]:
        """Every op name (the table's first), nothing imported."""
        return [*self._modules, *(n for n in self._ops if n not in self._modules)]

    def ops(self) -> list[Op]:
        """Every op, its module imported."""
        return [self.get(name) for name in self.names()]

    def registered(self) -> list[Op]:
        """The ops registered so far (nothing imported)."""
        return list(self._ops.values())


REGISTRY = Registry(OP_MODULES)
