"""The contract every registered op keeps, checked once for all of them (tiny shapes, the interpreter):

- candidates: every config of every arch profile constructs, is the op's config type and fits the arch's
  warps, stages and shared memory; arch pruning drops exactly the configs that do not fit;
- every candidate of every arch computes what the op's torch reference does, on the cpu sweep case;
- the cpu sweep (`autotune.tune`) validates every cpu candidate of every available implementation;
- plans are non-empty lists of the op's dims;
- the torch.compile custom ops' fakes promise the shapes, dtypes and strides the kernels return;
- dispatch: the default decision on cpu (TRITON_INTERPRET=1) runs a kernel, LIGER_RT_IMPL_<OP>=torch
  runs the reference;
- a tuning row holding the heuristic (and pinned) config of each arch passes the DB's row validation.

Each op's own test file checks its numerics against an independent reference (fp64 formulas, Hugging
Face modules) and what only that op does.
"""
import pytest
import torch
from routing import assert_fakes_match, record_impls

from liger_rt import autotune, backend, dispatch
from liger_rt.autograd import run_case
from liger_rt.config import config_dict
from liger_rt.freshness import source_hash
from liger_rt.kernels._common import next_pow2
from liger_rt.numerics import validation_report
from liger_rt.op import Case
from liger_rt.registry import OP_MODULES, REGISTRY
from liger_rt.tuning_db import rows

OPS = list(OP_MODULES)
ARCHES = ("hopper", "ampere", "mi325x", "cpu")
CPU = backend.profile("cpu")
CPU_TARGET = dispatch.Target(arch=CPU, device_type="cpu", interpret=True)


# shapes beyond the plans that each op's candidates must still take (the extremes of its dims)
EDGE_DIMS = {
    "rms_norm": [{"rows": 16384, "hidden": h} for h in (1, 8, 1152, 32768)],
    "layer_norm": [{"rows": 16384, "hidden": h} for h in (1, 8, 1152, 32768)],
    "swiglu": [{"rows": 16384, "cols": c} for c in (1, 8, 4304, 12288)],
    "geglu": [{"rows": 16384, "cols": c} for c in (1, 8, 4304, 12288)],
    "rope": [{"heads_q": q, "heads_k": k, "head_dim": d, "tokens": 8192}
             for q, k, d in ((1, 1, 2), (64, 8, 256), (8, 8, 80), (128, 1, 512))],
    "short_conv": [{"batch": 8, "seq": 4096, "hidden": 67, "kernel": 4}],
    "moe_router": [{"tokens": 65536, "experts": e, "top_k": k} for e, k in ((1, 1), (67, 8), (256, 8))],
}
MAX_CANDIDATES = 36          # per shape, arch and dtype: what one sweep point may cost
# register tiles: elements per program the kernels hold (a config beyond it spills)
TILE_BOUNDS = {
    "swiglu": lambda c, d: c.ROWS * min(c.BLOCK_N, next_pow2(d["cols"])) <= 16384,
    "geglu": lambda c, d: c.ROWS * min(c.BLOCK_N, next_pow2(d["cols"])) <= 16384,
    "rope": lambda c, d: c.BLOCK_H * next_pow2(d["head_dim"] // 2) <= 4096,
}


def _tiny(op) -> dict:
    """The cpu quick sweep's first shape: what `liger-tune sweep --arch cpu --quick` measures."""
    return op.plan(None, CPU, True)[0]


def _arch_dims(op, arch) -> list[dict]:
    """The shapes a sweep on `arch` measures (its quick plan), and the cpu sweep shape."""
    return [*op.plan(None, arch, True), _tiny(op), *EDGE_DIMS.get(op.name, ())]


def _tuned(op, dims, dtype) -> list:
    return [i for i in op.impls if i.tuned and (i.supports is None or i.supports(dims, dtype) is None)]


def _fits(op, cfg, arch, dims, dtype) -> bool:
    warps, stages = cfg.limits()
    return (warps <= arch.max_num_warps and stages <= arch.max_num_stages
            and (op.smem is None or op.smem(cfg, dims, dtype) <= arch.smem_bytes))


@pytest.mark.parametrize("name", OPS)
def test_candidates_construct_and_fit_every_arch(name):
    op = REGISTRY.get(name)
    for arch_name in ARCHES:
        arch = backend.profile(arch_name)
        for dims in _arch_dims(op, arch):
            for dtype in (torch.bfloat16, torch.float32):
                for impl in _tuned(op, dims, dtype):
                    where = (arch_name, dims, dtype, impl.name)
                    raw = op.candidates(arch, dims, dtype)
                    kept = op.candidates_for(impl, arch, dims, dtype)
                    assert 1 <= len(kept) <= MAX_CANDIDATES, where
                    assert kept == list(dict.fromkeys(c for c in raw if _fits(op, c, arch, dims, dtype))), where
                    fixed = [op.heuristic(arch, dims, dtype)] + ([op.pinned(arch, dims, dtype)] if op.pinned else [])
                    for cfg in kept + fixed:
                        assert isinstance(cfg, op.config), (where, cfg)
                        assert op.parse_config(config_dict(cfg), impl.name) == cfg, (where, cfg)
                        why = rows.launch_problem(op, impl.name, cfg, dims, arch, "bf16" if dtype == torch.bfloat16
                                                  else "fp32")
                        assert why is None, (where, cfg, why)
                        assert TILE_BOUNDS.get(name, lambda c, d: True)(cfg, dims), (where, cfg)


@pytest.mark.parametrize("name", OPS)
def test_every_candidate_of_every_arch_matches_the_reference(name):
    """Each config any arch's sweep may pick runs on the cpu sweep case (fp32) and matches the torch
    implementation by the sweep's own validation."""
    op = REGISTRY.get(name)
    dims = _tiny(op)
    case = op.new_case(dims, torch.float32, "cpu")
    reference = [r.detach() for r in run_case(op, op.impl("torch"), case, {})]
    seen = set()
    for arch_name in ARCHES:
        arch = backend.profile(arch_name)
        for impl in _tuned(op, dims, torch.float32):
            for cfg in op.candidates_for(impl, arch, _arch_dims(op, arch)[0], torch.bfloat16):
                if (impl.name, cfg) in seen:
                    continue
                seen.add((impl.name, cfg))
                outs = run_case(op, impl, case, cfg)
                assert len(outs) == len(reference), (impl.name, cfg)
                bad = [f"output {i}: {msg}" for i, (o, r) in enumerate(zip(outs, reference))
                       if (msg := validation_report(o, r, torch.float32, op.reduce_len(dims)))]
                assert not bad, (impl.name, cfg, bad)
    assert seen


@pytest.mark.parametrize("name", OPS)
def test_cpu_sweep_validates_every_candidate(name):
    """What `liger-tune sweep --arch cpu` does (bf16): every candidate of every implementation available on
    cpu passes validation against the torch reference, and each implementation has a best row."""
    op = REGISTRY.get(name)
    dims = _tiny(op)
    result = autotune.tune(op, CPU_TARGET, torch.bfloat16, dims, quick=True)
    bad = [m for m in result["measurements"] if not m["ok"]]
    assert not bad, bad
    assert result["winner"] is not None
    assert set(op.available_impls(CPU_TARGET, dims, torch.bfloat16)) <= set(result["best"])


@pytest.mark.parametrize("name", OPS)
def test_plans_are_lists_of_the_ops_dims(name):
    op = REGISTRY.get(name)
    for arch_name in ARCHES:
        for quick in (True, False):
            plan = op.plan(None, backend.profile(arch_name), quick)
            assert plan, (arch_name, quick)
            for dims in plan:
                assert op.check_dims(dims) == dims and all(isinstance(v, int) and v > 0 for v in dims.values())
    assert all(v <= 65536 for d in op.plan(None, CPU, False) for v in d.values())    # cpu plans stay tiny


# the args the functional passes under torch.compile where they differ from an eager call's
TRACED_ARGS = {"fused_linear_cross_entropy": lambda args: (*args[:-1], False)}    # inplace=False when compiling


@pytest.mark.parametrize("name", OPS)
def test_custom_op_fakes_match_the_kernels(name):
    op = REGISTRY.get(name)
    dims = _tiny(op)
    case = op.new_case(dims, torch.float32, "cpu")
    if name in TRACED_ARGS:
        case = Case(args=TRACED_ARGS[name](case.args), grads=case.grads)
    assert_fakes_match(op, case, op.heuristic(CPU, dims, torch.float32))


@pytest.mark.parametrize("name", OPS)
def test_dispatch_heuristic_then_env(monkeypatch, name):
    """On cpu with the interpreter the default decision (no DB row) runs a kernel with the cpu heuristic's
    config; LIGER_RT_IMPL_<OP>=torch runs the reference, and the kernel's result matches it."""
    op = REGISTRY.get(name)
    dims = _tiny(op)
    case = op.new_case(dims, torch.float32, "cpu")
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in case.args]
    d = dispatch.decide(op, dispatch.current_target("cpu"), torch.float32, dims)
    assert op.impl(d.impl).tuned and d.origin in ("heuristic", "db", "crossover"), d
    if d.origin == "heuristic":
        assert d.config == op.heuristic(CPU, dims, torch.float32)
    ran = record_impls(monkeypatch, op)
    with torch.no_grad():
        out = dispatch.call(op, *args)
    assert ran == [d.impl]

    monkeypatch.setenv(f"LIGER_RT_IMPL_{name.upper()}", "torch")
    dispatch.reset()
    d = dispatch.decide(op, dispatch.current_target("cpu"), torch.float32, dims)
    assert (d.impl, d.origin) == ("torch", "env")
    with torch.no_grad():
        ref = dispatch.call(op, *args)
    assert ran[1:] == ["torch"]
    outs, refs = (x if isinstance(x, tuple) else (x,) for x in (out, ref))
    for o, r in zip(outs, refs):
        assert validation_report(o, r, torch.float32, op.reduce_len(dims)) is None


@pytest.mark.parametrize("name", OPS)
def test_heuristic_rows_pass_row_validation(name):
    """A tuning row holding the heuristic (or pinned) config of an arch at its sweep shapes is accepted by
    the DB's row check (the config parses and launches there); one with an undeclared field is refused."""
    op = REGISTRY.get(name)
    for arch_name in ARCHES:
        arch = backend.profile(arch_name)
        for dims in _arch_dims(op, arch):
            for impl in _tuned(op, dims, torch.bfloat16):
                fixed = [op.heuristic(arch, dims, torch.bfloat16)]
                fixed += [op.pinned(arch, dims, torch.bfloat16)] if op.pinned else []
                for cfg in fixed:
                    rec = dict(op=name, variant=op.variant, arch=arch_name, dtype="bf16",
                               static_key=op.static_key(dims), bucket=op.bucket_key(dims), impl=impl.name,
                               config=config_dict(cfg), median_ms=1.0, source_hash=source_hash(op),
                               config_schema=op.schema_version, origin="sweep", method="cpu-wall")
                    row = rows.check("tuning", rec)
                    assert op.parse_config(row["config"], impl.name) == cfg, (arch_name, dims)
    with pytest.raises(rows.RowError, match="not valid for"):
        rows.check("tuning", dict(rec, config=dict(config_dict(cfg), not_a_knob=1)))
