"""Checks shared by the kernel tests: which implementation of an op actually ran, and whether the
torch.compile custom ops' fakes promise what the kernels return.

A test of the `torch` path that compares the result with the very function the path routes to
cannot fail; asserting which implementation ran can.
"""
import json

import torch

from liger_rt.custom_ops import schema_args
from liger_rt.freshness import source_hash


def record_impls(monkeypatch, op) -> list[str]:
    """Wrap every implementation of `op` so that each run appends its name to the returned list
    (eager calls, the reference fallback and the torch.compile custom ops alike)."""
    source_hash(op)   # computed (and cached) from the real launchers, before any wrapper is in place
    ran: list[str] = []
    for impl in op.impls:
        attr = "fn" if impl.fn is not None else "forward"
        real = getattr(impl, attr)
        monkeypatch.setattr(impl, attr, lambda *a, _real=real, _name=impl.name: ran.append(_name) or _real(*a))
    return ran


def assert_fakes_match(op, case, config) -> None:
    """liger_rt::<op>_fwd and _bwd on `case`: each output's shape, dtype and strides from the fake
    equal the real ones (inductor asserts exactly that at run time; opcheck checks it on CPU).  The backward
    is asked for the gradients autograd would ask for: those of the args that require one."""
    decision = json.dumps({"impl": "triton", "config": config.to_dict()}, sort_keys=True)
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in case.args]
    is_tensor = [t.startswith("Tensor") for t, _ in schema_args(op.schema)]
    fwd = getattr(torch.ops.liger_rt, f"{op.name}_fwd").default
    torch.library.opcheck(fwd, (*args, decision), test_utils=("test_faketensor",))
    saved = fwd(*args, decision)[op.outputs:]
    tensors = [a for a, t in zip(args, is_tensor) if t]
    needs = [bool(a is not None and a.requires_grad) for a, t in zip(case.args, is_tensor) if t]
    scalars = [a for a, t in zip(args, is_tensor) if not t]
    bwd = getattr(torch.ops.liger_rt, f"{op.name}_bwd").default
    torch.library.opcheck(bwd, (tensors, list(saved), list(case.grads), *scalars, needs, decision),
                          test_utils=("test_faketensor",))


class OpCalls:
    """Counts calls of liger_rt.ops.<name> (the patched layers look the op up at call time)."""

    def __init__(self, monkeypatch, name):
        import liger_rt.ops
        self.fn, self.n = getattr(liger_rt.ops, name), 0
        monkeypatch.setattr(liger_rt.ops, name, self)

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.fn(*args, **kwargs)


def release_patches() -> None:
    """Unpatch every class-level patch and check no module-wide swap is left (an autouse teardown)."""
    import gc

    from liger_rt import _swaps
    from liger_rt.patch import core
    for model_type in list(core._CLASS_RECORDS):
        core.unpatch(model_type)
    gc.collect()                 # instance patches hold module-wide swaps (rope) until their model dies
    assert not _swaps.LEDGER
