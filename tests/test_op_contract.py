"""The contract every registered op keeps, checked once for all of them (tiny shapes, the interpreter):

- candidates: every config of every arch profile constructs, is the op's config type and fits the arch's
  warps, stages and shared memory; arch pruning drops exactly the configs that do not fit;
- every candidate of every arch computes what the op's torch reference does, on the cpu sweep case;
- the cpu sweep (`autotune.sweep`) validates every cpu candidate of every available implementation, and
  dispatch finds its winner in the DB;
- plans are non-empty lists of the op's dims (tiny on cpu); model presets' plans are what the table says;
- the torch.compile custom ops' fakes promise the shapes, dtypes and strides the kernels return;
- torch.compile(fullgraph=True, dynamic=True) of the public functional: no graph break (but in a reference
  REFERENCE_BREAKS names), no recompile for a second token count, forward and backward match the eager reference, on the kernel path (the Triton
  pair as custom ops, once per call) and on the reference path (traced torch, no kernel); the compile
  policy hands the op to the compiler exactly when it declares compiler_fuses and no LIGER_RT_IMPL_<OP>
  decides;
- dispatch: the default decision on cpu (TRITON_INTERPRET=1) runs a kernel, LIGER_RT_IMPL_<OP>=torch
  runs the reference;
- a tuning row holding the heuristic (and pinned) config of each arch passes the DB's row validation.

Each op's own test file checks its numerics against an independent reference (fp64 formulas, Hugging
Face modules) and what only that op does.
"""
import pytest
import torch
from routing import assert_fakes_match, record_impls

from liger_rt import autotune, backend, dispatch, ops
from liger_rt.autograd import run_case
from liger_rt.config import config_dict
from liger_rt.custom_ops import schema_args
from liger_rt.freshness import source_hash
from liger_rt.kernels._common import next_pow2
from liger_rt.numerics import validation_report
from liger_rt.op import Case
from liger_rt.registry import OP_MODULES, REGISTRY
from liger_rt.tools.presets import get_preset
from liger_rt.tuning_db import open_store, rows

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
    """What `liger-tune sweep --arch cpu --quick` does (bf16): every candidate of every implementation available
    on cpu passes validation against the torch reference, each implementation has a best row, and the winner
    lands in the user DB, where dispatch finds it."""
    op = REGISTRY.get(name)
    dims = _tiny(op)
    with open_store() as store:
        out = autotune.sweep([(op, dims, "bf16", "")], CPU_TARGET, store, quick=True)
    assert not out["skipped"], out["skipped"]
    (result,) = out["results"]
    bad = [m for m in result["measurements"] if not m["ok"]]
    assert not bad, bad
    assert result["winner"] is not None
    assert set(op.available_impls(CPU_TARGET, dims, torch.bfloat16)) <= set(result["best"])
    dispatch.reset()
    d = dispatch.select(name, dtype="bf16", arch="cpu", **dims)
    assert (d.origin, d.impl) == ("db", result["winner"]["impl"]), d


@pytest.mark.parametrize("name", OPS)
def test_plans_are_lists_of_the_ops_dims(name):
    op = REGISTRY.get(name)
    for arch_name in ARCHES:
        for quick in (True, False):
            plan = op.plan(None, backend.profile(arch_name), quick)
            assert plan, (arch_name, quick)
            for dims in plan:
                assert op.check_dims(dims) == dims and all(isinstance(v, int) and v > 0 for v in dims.values())
    bounds = CPU_PLAN_MAX.get(name, {})       # cpu plans stay tiny: the interpreter runs them
    assert all(v <= bounds.get(k, 65536) for d in op.plan(None, CPU, False) for k, v in d.items())


def _rope(heads_q, heads_k, head_dim, tokens) -> dict:
    return {"heads_q": heads_q, "heads_k": heads_k, "head_dim": head_dim, "tokens": tokens}


# the largest value a dim takes in an op's full cpu plan, where tighter than 65536
CPU_PLAN_MAX = {"rms_norm": {"rows": 32, "hidden": 128}, "layer_norm": {"rows": 32, "hidden": 128},
                "swiglu": {"rows": 32, "cols": 128}, "geglu": {"rows": 32, "cols": 128}, "rope": {"tokens": 32}}
# what a sweep measures: (op, preset, arch, quick, the whole plan (a list) or dims it holds (a dict))
PLANS = [
    ("rms_norm", "qwen3-tiny", "cpu", True, [{"rows": 8, "hidden": 64}]),
    ("rms_norm", "qwen3-4b", "hopper", True, [{"rows": 4096, "hidden": 2560}]),
    ("rms_norm", "qwen3-4b", "hopper", False, {"rows": 16384, "hidden": 2560}),
    ("layer_norm", "lfm2-vl-tiny", "cpu", True, [{"rows": 8, "hidden": 48}]),
    ("layer_norm", "lfm2-vl-1.6b", "hopper", True, [{"rows": 4096, "hidden": 1152}]),
    ("layer_norm", "qwen3-4b", "hopper", True, [{"rows": 4096, "hidden": 2560}]),
    ("layer_norm", None, "hopper", False, {"rows": 16384, "hidden": 1152}),
    ("swiglu", "llama-tiny", "cpu", True, [{"rows": 8, "cols": 96}]),
    ("swiglu", "qwen3-4b", "hopper", True, [{"rows": 4096, "cols": 9728}]),
    ("swiglu", None, "hopper", False, {"rows": 16384, "cols": 12288}),
    ("rope", None, "cpu", True, [_rope(4, 2, 16, 8)]),
    ("rope", "qwen3-4b-tiny", "cpu", True, [_rope(4, 2, 20, 8)]),
    ("rope", None, "hopper", True, [_rope(16, 8, 128, 8192), _rope(32, 8, 128, 8192)]),
    ("rope", None, "hopper", False, _rope(16, 8, 128, 4096)),
    ("rope", None, "hopper", False, _rope(16, 8, 128, 8192)),
    ("rope", "qwen3-1.7b", "hopper", True, [_rope(16, 8, 128, 4096)]),
]
# a preset's full hopper plan keeps the model's widths
PRESET_WIDTHS = [("rms_norm", "qwen3-4b", {"hidden": 2560}), ("rope", "llama-3.2-1b", {"head_dim": 64})]


def test_plans_of_presets():
    for name, preset, arch, quick, want in PLANS:
        plan = REGISTRY.get(name).plan(preset and get_preset(preset), backend.profile(arch), quick)
        assert plan == want if isinstance(want, list) else want in plan, (name, preset, arch, quick, plan)
    for name, preset, widths in PRESET_WIDTHS:
        plan = REGISTRY.get(name).plan(get_preset(preset), backend.profile("hopper"), False)
        assert plan and all(d | widths == d for d in plan), (name, preset, plan)


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


# each op's public functional called with its tuning case's args (the op-level args `dispatch.call` takes)
FUNCTIONALS = {
    "rope": lambda q, k, cos, sin, unsqueeze_dim: ops.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim),
    "short_conv": lambda bcx, w, b, seq_idx: ops.short_conv(bcx, w, b, seq_idx=seq_idx),
    "moe_experts": lambda x, gate_up, down, idx, w, _save: ops.moe_experts(x, gate_up, down, idx, w),
    "cross_entropy": lambda logits, target, ignore, reduction, smoothing, lse, softcap, n, inplace: ops.cross_entropy(
        logits, target, ignore, reduction, label_smoothing=smoothing, lse_square_scale=lse, softcap=softcap,
        num_items_in_batch=n, inplace_backward=inplace),
    "fused_linear_cross_entropy": lambda x, w, target, b, ignore, reduction, smoothing, lse, softcap, n, _grads,
    _inplace: ops.fused_linear_cross_entropy(x, w, target, b, ignore, reduction, label_smoothing=smoothing,
                                             lse_square_scale=lse, softcap=softcap, num_items_in_batch=n),
    "fused_linear_logprobs": lambda x, w, target, b, temperature, ignore: ops.fused_linear_logprobs(
        x, w, target, b, temperature=temperature, ignore_index=ignore, return_entropy=True),
}


# references that dynamo cannot trace whole: their torch path compiles with graph breaks
REFERENCE_BREAKS = {"moe_experts"}      # the HF experts loop: the rows routed to each expert (data-dependent sizes)


def _doubled_outs_and_grads(fn, case) -> list:
    """fn(*case.args) on fresh copies of the args, its floating outputs doubled (an op beside it in the
    graph), then the gradients of the args that want one under case.grads."""
    args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
            for a in case.args]
    outs = fn(*args)
    outs = [o * 2.0 if o.is_floating_point() else o for o in (outs if isinstance(outs, tuple) else (outs,))]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    pairs = [(o, g) for o, g in zip(outs, case.grads) if g is not None]
    return [*outs, *torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True,
                                        materialize_grads=True)]


def _record_kernels(monkeypatch, op) -> list[str]:
    """Wrap every implementation but the reference so that each run appends its name to the returned list.
    The reference is left as it is: under torch.compile it is traced, and so would be a recorder there
    (its list guarded on)."""
    ran: list[str] = []
    source_hash(op)       # computed (and cached) from the real launchers, before any wrapper is in place
    for impl in op.impls:
        attr = "forward" if impl.tuned else "fn"
        if impl.name != "torch":
            monkeypatch.setattr(impl, attr, lambda *a, _real=getattr(impl, attr), _name=impl.name:
                                ran.append(_name) or _real(*a))
    return ran


def _compiled_matches_eager(op, fullgraph=True, drop=()) -> None:
    """The op's functional compiled (dynamic shapes) and run at two token counts, the second without a
    recompile: outputs and gradients match the eager torch reference's.  `drop`: args passed as None."""
    torch._dynamo.reset()
    compiled = torch.compile(FUNCTIONALS.get(op.name, getattr(ops, op.name)), backend="aot_eager",
                             fullgraph=fullgraph, dynamic=True)
    dims = _tiny(op)
    last = op.dynamic[-1]        # the token count (a batch dim beside it stays: dynamo specialises size 1)
    for i, count in enumerate((6, 10)):       # sizes no other dim of a tiny case has (dynamo would pair them)
        at = {**dims, last: count}
        case = op.new_case(at, torch.float32, "cpu")
        case = Case(args=tuple(None if j in drop else a for j, a in enumerate(case.args)), grads=case.grads)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            outs = _doubled_outs_and_grads(compiled, case)
        refs = _doubled_outs_and_grads(op.reference, case)
        assert len(outs) == len(refs), at
        for j, (o, r) in enumerate(zip(outs, refs)):
            assert (o.dtype, o.shape) == (r.dtype, r.shape), (at, j)
            assert validation_report(o, r, torch.float32, op.reduce_len(at)) is None, (at, j)


@pytest.mark.parametrize("name", OPS)
def test_compile_policy(monkeypatch, name):
    """Under LIGER_RT_COMPILE_POLICY=fuse (the default) a trace hands the op to the compiler (its torch
    implementation) exactly when it declares compiler_fuses and no LIGER_RT_IMPL_<OP> decides; under
    `kernels` never."""
    op = REGISTRY.get(name)
    assert dispatch.compiler_takes(op) == op.compiler_fuses
    for impl in op.impl_names:
        monkeypatch.setenv(f"LIGER_RT_IMPL_{name.upper()}", impl)
        assert not dispatch.compiler_takes(op), impl
    monkeypatch.delenv(f"LIGER_RT_IMPL_{name.upper()}")
    monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", "kernels")
    assert not dispatch.compiler_takes(op)


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("name", OPS)
def test_compiles_fullgraph_dynamic(monkeypatch, name, path):
    """The decision taken at trace time is what runs.  kernel: the op's Triton pair runs as the generated
    custom ops, once per call (also with each optional tensor the case passes, a bias, left out), under the
    default policy for an op the compiler does not fuse and under LIGER_RT_COMPILE_POLICY=kernels for one it
    does.  reference: its torch implementation is traced and no kernel runs, by the default policy for an
    op the compiler fuses and by LIGER_RT_IMPL_<OP>=torch for the others (test_compile_policy: either
    setting decides for every op)."""
    op = REGISTRY.get(name)
    if path == "kernel" and op.compiler_fuses:
        monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", "kernels")
    if path == "reference" and not op.compiler_fuses:
        monkeypatch.setenv(f"LIGER_RT_IMPL_{name.upper()}", "torch")
    dispatch.reset()
    ran = _record_kernels(monkeypatch, op)
    _compiled_matches_eager(op, fullgraph=path == "kernel" or name not in REFERENCE_BREAKS)
    if path == "reference":
        assert ran == [], ran
        return
    assert len(ran) == 2 and ran[0] == ran[1] and op.impl(ran[0]).tuned, ran
    args = op.new_case(_tiny(op), torch.float32, "cpu").args
    optional = [i for i, (kind, _) in enumerate(schema_args(op.schema)) if kind == "Tensor?" and args[i] is not None]
    if optional:
        _compiled_matches_eager(op, drop=optional)
        assert ran == ran[:1] * 4, ran


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
