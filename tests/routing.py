"""Routing checks shared by the kernel tests: which implementation of an op actually ran.

A test of the `torch` path that compares the result with the very function the path routes to
cannot fail; asserting which implementation ran can.
"""


def record_impls(monkeypatch, op) -> list[str]:
    """Wrap every implementation of `op` so that each run appends its name to the returned list
    (eager calls, the reference fallback and the torch.compile custom ops alike)."""
    op.source_hash   # computed (and cached) from the real launchers, before any wrapper is in place
    ran: list[str] = []
    for impl in op.impls:
        attr = "fn" if impl.fn is not None else "forward"
        real = getattr(impl, attr)
        monkeypatch.setattr(impl, attr, lambda *a, _real=real, _name=impl.name: ran.append(_name) or _real(*a))
    return ran
