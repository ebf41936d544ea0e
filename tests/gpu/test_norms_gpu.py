"""rms_norm, fused_add_rms_norm, swiglu and layer_norm on the GPU at real sizes, bf16 against fp32/fp64 references.

    python -m pytest -m gpu tests/gpu/test_norms_gpu.py -q

Besides accuracy at real sizes, every candidate config of this GPU's arch is compiled, run and
validated through the autotuner (on this Triton version), so no config can fail or win wrongly.
"""
import pytest
import torch
import torch.nn.functional as F

import liger_rt.ops
from liger_rt import autotune, backend, dispatch
from liger_rt.backend import interpreter_on
from liger_rt.kernels import fused_add_rms_norm as fa
from liger_rt.kernels import layer_norm as ln
from liger_rt.kernels import rms_norm as rn
from liger_rt.kernels import swiglu as sw
from liger_rt.numerics import assert_close
from liger_rt.registry import REGISTRY

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_mem(gib=8)]
DEV = "cuda"

if torch.cuda.is_available() and interpreter_on():
    pytest.skip("TRITON_INTERPRET=1 is set: unset it to run the GPU tests", allow_module_level=True)


@pytest.fixture
def force_triton(monkeypatch):
    """Our kernels whatever a (shipped or swept) DB would pick for the shape."""
    for op in ("RMS_NORM", "FUSED_ADD_RMS_NORM", "SWIGLU", "LAYER_NORM"):
        monkeypatch.setenv(f"LIGER_RT_IMPL_{op}", "triton")
    dispatch.reset()


def _rel_rmse(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _run(fn, tensors, dy):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    return [y, *torch.autograd.grad(y, leaves, dy)]


def _check(outs, refs, dtype, rows, names, reduce_from=2):
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.shape == r.shape, names[i]
        assert_close(o, r, dtype, reduce_len=rows if i >= reduce_from else 1, name=names[i])
        assert _rel_rmse(o, r) < (1e-5 if dtype == torch.float32 else 8e-3), f"{names[i]} rel rmse"


def _rand(*shape, scale=1.0, shift=0.0, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (shift + scale * torch.randn(*shape, device=DEV, generator=g)).to(dtype)


def _hf_rms_norm(x, w, eps, offset):
    """LlamaRMSNorm.forward (offset 0) / the Gemma-style (offset + w) variant, eager, in x.dtype."""
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w + offset) * h.to(dt) if offset else w * h.to(dt)


def _bf16_ulp(v: float) -> float:
    import math
    return 2.0 ** (math.floor(math.log2(v)) - 7) if v > 0 else 0.0


def _no_worse_than_eager(out, eager, exact, name):
    """Our error vs exact fp32 math must not exceed eager PyTorch's (same bf16 inputs) by more than
    a small margin: relative RMSE <= 1.25x eager's + 1e-3, max abs err <= 2x eager's + 1 bf16 ulp
    of max |exact|."""
    assert out.shape == exact.shape, name
    o, e, r = out.detach().float(), eager.detach().float(), exact.detach().float()
    assert torch.isfinite(o).all(), f"{name}: non-finite values"
    rm_o, rm_e = _rel_rmse(o, r), _rel_rmse(e, r)
    assert rm_o <= 1.25 * rm_e + 1e-3, f"{name}: rel rmse {rm_o:.3g} vs eager {rm_e:.3g}"
    mx_o, mx_e = float((o - r).abs().max()), float((e - r).abs().max())
    bound = 2 * mx_e + _bf16_ulp(float(r.abs().max()))
    assert mx_o <= bound, f"{name}: max abs err {mx_o:.3g} > {bound:.3g} (eager {mx_e:.3g})"


# -- rms_norm ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("M,N", [(4096, 4096), (16384, 2048), (1151, 1000), (1, 4096), (2048, 8192),
                                 (262144, 64), (131071, 128)])   # per-head q/k norms: the tiled backward
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_bf16_real_sizes(M, N, offset, force_triton):
    x, w, dy = _rand(M, N, scale=2.0), _rand(N, scale=0.3, shift=0.0 if offset else 1.0, seed=1), _rand(M, N, seed=2)
    d = dispatch.decision(rn.OP, x, rows=M, hidden=N)
    assert d.impl == "triton", d
    outs = _run(lambda a, b: liger_rt.ops.rms_norm(a, b, 1e-6, offset), (x, w), dy)
    names = ["y", "dx", "dw"]
    # the module's casting on the same bf16 values, and exact fp32 math
    _check(outs, _run(lambda a, b: rn.rms_norm_ref(a, b, 1e-6, offset), (x, w), dy), torch.bfloat16, M, names)
    # against exact fp32 math: the Llama casting (normalised x rounded to bf16 before the weight
    # multiply) puts inherent rounding into dW (dW ~ 100 at 4096 rows: bf16 ulp 0.5), so the bar is
    # eager PyTorch's HF-style module in bf16 on the same inputs: no worse than its error
    exact = _run(lambda a, b: rn.rms_norm_ref(a, b, 1e-6, offset), (x.float(), w.float()), dy.float())
    eager = _run(lambda a, b: _hf_rms_norm(a, b, 1e-6, offset), (x, w), dy)
    for name, o, e, r in zip(names, outs, eager, exact):
        _no_worse_than_eager(o, e, r, name)


def test_rms_norm_fp32_and_3d_noncontiguous(force_triton):
    base = _rand(4, 1024, 2 * 2048, dtype=torch.float32)
    x = base[..., :2048]                                         # rows 4096 apart: read in place
    w, dy = _rand(2048, shift=1.0, dtype=torch.float32, seed=1), _rand(4, 1024, 2048, dtype=torch.float32, seed=2)
    outs = _run(liger_rt.ops.rms_norm, (x, w), dy)
    _check(outs, _run(rn.rms_norm_ref, (x, w), dy), torch.float32, 4096, ["y", "dx", "dw"])


# -- fused_add_rms_norm ----------------------------------------------------------------------------------

def _run_pair(fn, tensors, dy, ds):
    """[y, s, d of each tensor] of fn(*tensors) -> (y, s) for upstream gradients dy and ds."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y, s = fn(*leaves)
    return [y, s, *torch.autograd.grad((y, s), leaves, (dy, ds))]


def _fused_add_fp64(x, r, w, eps, offset):
    """s = x + r and RMSNorm(s) by the formula (run on fp64 copies: exact up to fp64 rounding)."""
    s = x + r
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (w + offset), s


FUSED_ADD_NAMES = ["y", "s", "dx", "dresidual", "dw"]


@pytest.mark.parametrize("M,N", [(4096, 4096), (16384, 2048), (1151, 1000), (1, 4096), (2048, 8192)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_add_rms_norm_bf16_real_sizes(M, N, offset, force_triton):
    x, r = _rand(M, N), _rand(M, N, scale=4.0, seed=3)
    w = _rand(N, scale=0.3, shift=0.0 if offset else 1.0, seed=1)
    dy, ds = _rand(M, N, seed=2), _rand(M, N, seed=4)
    d = dispatch.decision(fa.OP, x, rows=M, hidden=N)
    assert d.impl == "triton", d
    outs = _run_pair(lambda a, b, c: liger_rt.ops.fused_add_rms_norm(a, b, c, 1e-6, offset), (x, r, w), dy, ds)
    assert torch.equal(outs[1], x + r)                               # s: the add's own bf16 rounding
    # the module's casting on the same bf16 values...
    ref = _run_pair(lambda a, b, c: fa.fused_add_rms_norm_ref(a, b, c, 1e-6, offset), (x, r, w), dy, ds)
    _check(outs, ref, torch.bfloat16, M, FUSED_ADD_NAMES, reduce_from=4)
    # ...and the formula in fp64, held to eager PyTorch's error (the add, then the HF-style norm, in bf16)
    exact = _run_pair(lambda a, b, c: _fused_add_fp64(a, b, c, 1e-6, offset), (x.double(), r.double(), w.double()),
                      dy.double(), ds.double())
    eager = _run_pair(lambda a, b, c: (_hf_rms_norm(a + b, c, 1e-6, offset), a + b), (x, r, w), dy, ds)
    for name, o, e, ex in zip(FUSED_ADD_NAMES, outs, eager, exact):
        _no_worse_than_eager(o, e, ex, name)
    assert torch.equal(outs[2], outs[3])                             # one gradient for x and the residual


def test_fused_add_rms_norm_fp32_3d_noncontiguous(force_triton):
    base = _rand(4, 1024, 2 * 2048, dtype=torch.float32)
    x, r = base[..., :2048], base[..., 2048:].transpose(0, 1).contiguous().transpose(0, 1)   # rows strided, permuted
    w = _rand(2048, shift=1.0, dtype=torch.float32, seed=1)
    dy, ds = _rand(4, 1024, 2048, dtype=torch.float32, seed=2), _rand(4, 1024, 2048, dtype=torch.float32, seed=3)
    outs = _run_pair(liger_rt.ops.fused_add_rms_norm, (x, r, w), dy, ds)
    exact = _run_pair(lambda a, b, c: _fused_add_fp64(a, b, c, 1e-6, 0.0), (x.double(), r.double(), w.double()),
                      dy.double(), ds.double())
    _check(outs, exact, torch.float32, 4096, FUSED_ADD_NAMES, reduce_from=4)


def test_fused_add_rms_norm_compiled_kernels_policy(monkeypatch):
    """Under inductor with LIGER_RT_COMPILE_POLICY=kernels: s feeds the layer's next add (inductor may write that
    add into s's buffer) while the backward reads s, and one gradient serves both addends; fp32 against fp64."""
    monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", "kernels")
    dispatch.reset()
    torch._dynamo.reset()
    M, N = 4096, 2048
    x, r = _rand(M, N, dtype=torch.float32), _rand(M, N, scale=4.0, dtype=torch.float32, seed=1)
    w, proj = _rand(N, shift=1.0, dtype=torch.float32, seed=2), _rand(N, N, scale=0.02, dtype=torch.float32, seed=3)
    dy = _rand(M, N, dtype=torch.float32, seed=4)

    def layer(x, r, w, op, p):
        y, s = op(x, r, w)
        return s + y @ p

    comp = torch.compile(lambda a, b, c: layer(a, b, c, liger_rt.ops.fused_add_rms_norm, proj), fullgraph=True)
    outs = _run(comp, (x, r, w), dy)
    exact = _run(lambda a, b, c: layer(a, b, c, lambda *t: _fused_add_fp64(*t, 1e-6, 0.0), proj.double()),
                 (x.double(), r.double(), w.double()), dy.double())
    # dw sums 4096 rows of terms that cancel (its gradient comes through the fp32 GEMM y @ proj): an element's error
    # scales with its terms, not with the sum, so dw is compared in units of its RMS (an aliasing bug is off by O(1))
    scale = exact[3].pow(2).mean().sqrt()
    outs[3], exact[3] = outs[3] / scale, exact[3] / scale
    _check(outs, exact, torch.float32, M, ["out", "dx", "dresidual", "dw"], reduce_from=3)
    torch._dynamo.reset()


# -- swiglu ------------------------------------------------------------------------------------------

# 8192 x 12288: the fp64 formula's inputs, intermediates and outputs (0.8 GB each, about ten)
@pytest.mark.gpu_mem(gib=12)
@pytest.mark.parametrize("M,N", [(4096, 8192), (8192, 12288), (1151, 1000), (1, 6144), (2048, 4304)])
def test_swiglu_bf16_real_sizes(M, N, force_triton):
    gate, up, dy = _rand(M, N, scale=3.0), _rand(M, N, seed=1), _rand(M, N, seed=2)
    d = dispatch.decision(sw.OP, gate, rows=M, cols=N)
    assert d.impl == "triton", d
    outs = _run(liger_rt.ops.swiglu, (gate, up), dy)
    # the eager module's two roundings: bit for bit except where exp's last fp32 ulp flips one
    eager = F.silu(gate) * up
    assert (outs[0] != eager).float().mean() < 1e-3
    assert_close(outs[0], eager, torch.bfloat16, name="y vs eager")
    names = ["y", "dgate", "dup"]
    _check(outs, _run(sw.swiglu_ref, (gate, up), dy), torch.bfloat16, 1, names)
    _check(outs, _swiglu_fp64(gate, up, dy), torch.bfloat16, 1, names)


def _swiglu_fp64(gate, up, dy):
    """y, dgate, dup by the formula in fp64, independent of swiglu_ref and of autograd."""
    g, u, d = gate.double(), up.double(), dy.double()
    sig = torch.sigmoid(g)
    return [g * sig * u, d * u * sig * (1 + g * (1 - sig)), d * g * sig]


def test_swiglu_fused_gate_up_halves(force_triton):
    gate_up = _rand(2, 2048, 2 * 8192, scale=2.0)
    dy = _rand(2, 2048, 8192, seed=1)
    leaf = gate_up.detach().clone().requires_grad_()
    y = liger_rt.ops.swiglu(*leaf.chunk(2, -1))
    (dgu,) = torch.autograd.grad(y, leaf, dy)
    y_ref, dg, du = _swiglu_fp64(*gate_up.chunk(2, -1), dy)
    assert_close(y, y_ref, torch.bfloat16, name="y")
    assert_close(dgu, torch.cat((dg, du), -1), torch.bfloat16, name="dgate_up")


# -- layer_norm ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("M,N", [(4096, 1152), (23328, 1152), (4096, 4096), (1151, 1000), (1, 2048)])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_bf16_real_sizes(M, N, bias, force_triton):
    x = _rand(M, N, scale=2.0, shift=1.5)
    w, dy = _rand(N, scale=0.5, shift=1.0, seed=1), _rand(M, N, seed=2)
    b = _rand(N, scale=0.5, seed=3) if bias else None
    leaves = (x, w, b) if bias else (x, w)
    fn = (lambda a, ww, bb: liger_rt.ops.layer_norm(a, ww, bb, 1e-6)) if bias else \
        (lambda a, ww: liger_rt.ops.layer_norm(a, ww, None, 1e-6))
    ref = (lambda a, ww, bb: ln.layer_norm_ref(a, ww, bb, 1e-6)) if bias else \
        (lambda a, ww: ln.layer_norm_ref(a, ww, None, 1e-6))
    d = dispatch.decision(ln.OP, x, rows=M, hidden=N)   # forced: a DB may legitimately pick torch at SigLIP sizes
    assert d.impl == "triton", d
    outs = _run(fn, leaves, dy)
    names = ["y", "dx", "dw", "db"]
    _check(outs, _run(ref, leaves, dy), torch.bfloat16, M, names)
    # PyTorch's LayerNorm in fp64 on the same values: independent of layer_norm_ref's fp32 path
    fp64 = (lambda a, *wb: F.layer_norm(a, (N,), *wb, 1e-6)) if bias else \
        (lambda a, ww: F.layer_norm(a, (N,), ww, None, 1e-6))
    _check(outs, _run(fp64, tuple(t.double() for t in leaves), dy.double()), torch.bfloat16, M, names)


# -- every candidate config, through the autotuner ------------------------------------------------------

@pytest.mark.parametrize("op,dims,dtype", [
    ("rms_norm", {"rows": 4096, "hidden": 4096}, torch.bfloat16),
    ("rms_norm", {"rows": 8192, "hidden": 2048}, torch.bfloat16),
    ("rms_norm", {"rows": 32768, "hidden": 128}, torch.float32),
    ("rms_norm", {"rows": 65536, "hidden": 64}, torch.bfloat16),
    ("fused_add_rms_norm", {"rows": 16384, "hidden": 4096}, torch.bfloat16),
    ("fused_add_rms_norm", {"rows": 4096, "hidden": 2048}, torch.float32),
    ("swiglu", {"rows": 4096, "cols": 8192}, torch.bfloat16),
    ("swiglu", {"rows": 2048, "cols": 12288}, torch.float32),
    ("layer_norm", {"rows": 4096, "hidden": 1152}, torch.bfloat16),
    ("layer_norm", {"rows": 4096, "hidden": 4096}, torch.float32),
])
def test_every_candidate_compiles_and_validates(op, dims, dtype):
    the_op = REGISTRY.get(op)
    target = dispatch.current_target("cuda")
    result = autotune.tune(the_op, target, dtype, dims, quick=True)
    bad = [(m["config"], m["error"]) for m in result["measurements"] if not m["ok"]]
    assert not bad, bad
    n = len(the_op.candidates_for(the_op.impl("triton"), target.arch, dims, dtype))
    assert sum(m["impl"] == "triton" for m in result["measurements"]) == n
    # report what won (visible with -s): this GPU's optimum
    win = result["winner"]
    print(f"\n{op} {dims} {dtype}: winner {win['impl']} {win['config']} {win['median_ms']:.4g} ms "
          f"(torch {result['baseline_ms']:.4g} ms)")


def test_decisions_for_this_arch():
    """Decisions name this GPU's arch; without a DB row they are the triton heuristic."""
    arch = backend.detect()
    for op, dims in (("rms_norm", {"rows": 16384, "hidden": 4096}),
                     ("fused_add_rms_norm", {"rows": 16384, "hidden": 4096}), ("swiglu", {"rows": 16384, "cols": 8192}),
                     ("layer_norm", {"rows": 4096, "hidden": 1152})):
        d = dispatch.select(op, dtype="bf16", **dims)
        assert d.arch == arch.name, d
        assert d.origin != "heuristic" or d.impl == "triton", d


# -- torch.compile (inductor) around our custom ops -----------------------------------------------------

# A compiled block and the eager one may round in different places and orders (inductor fuses the
# code around our custom ops; cuBLAS may pick another algorithm), so they are not compared with each
# other elementwise: both are compared with the block in fp64 on the same bf16 values.
EPS_BF16 = 2.0 ** -7      # one rounding to bf16 moves a value by at most EPS_BF16 * |value|, in any rounding mode
EPS_FP32 = 2.0 ** -23


def _block_fp64(x, w, lw, lb, wg, wu):
    """rms_norm -> layer_norm -> SwiGLU of two projections, exact up to fp64 rounding."""
    r = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    h = F.layer_norm(r, r.shape[-1:], lw, lb, 1e-6)
    return F.silu(h @ wg) * (h @ wu)


def _block_error_bound(x, w, lw, lb, wg, wu):
    """|y - y_exact| that a correct bf16 evaluation of the block cannot exceed, element by element,
    whatever the order of its roundings and sums (all arguments fp64 copies of the bf16 values).

    First-order propagation of every rounding the block may make, each at most EPS_BF16 relative:
    - rms_norm rounds the normalised x and its product with w: e_r = ((1 + eps)^2 - 1) |r|;
    - layer_norm maps an input error d to lw / sigma * (d - mean(d) - xhat * mean(xhat * d)), at most
      |lw| / sigma * (e_r + mean(e_r) + |xhat| mean(|xhat| e_r)) elementwise, then rounds: + eps |h|;
    - each projection sums H products of bf16 values (exact in fp32) in fp32 in any order, at most
      H * EPS_FP32 * (|h| @ |W|) (fp32 accumulation: reduced-precision reductions are off), carries
      e_h @ |W| and rounds: + eps |g|;
    - SwiGLU rounds silu(g) and the product: e_s = |silu'(g)| e_g + eps |silu(g)|,
      e_y = e_s |u| + |silu(g)| e_u + e_s e_u + eps |y|.
    The 1.25 covers the second-order terms and the kernels' own fp32 arithmetic (reductions over
    2048 terms: about 1.2e-4 relative, against 7.8e-3 per bf16 rounding)."""
    eps = EPS_BF16
    r = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    e_r = ((1 + eps) ** 2 - 1) * r.abs()
    mu, sigma = r.mean(-1, keepdim=True), torch.sqrt(r.var(-1, unbiased=False, keepdim=True) + 1e-6)
    xhat = ((r - mu) / sigma).abs()
    h = F.layer_norm(r, r.shape[-1:], lw, lb, 1e-6)
    e_h = (lw.abs() / sigma * (e_r + e_r.mean(-1, keepdim=True) + xhat * (xhat * e_r).mean(-1, keepdim=True))
           + eps * h.abs())
    g, u = h @ wg, h @ wu
    acc = h.shape[-1] * EPS_FP32
    e_g = e_h @ wg.abs() + acc * (h.abs() @ wg.abs()) + eps * g.abs()
    e_u = e_h @ wu.abs() + acc * (h.abs() @ wu.abs()) + eps * u.abs()
    sig = torch.sigmoid(g)
    silu, dsilu = g * sig, sig * (1 + g * (1 - sig))
    e_s = dsilu.abs() * e_g + eps * silu.abs()
    e_y = e_s * u.abs() + silu.abs() * e_u + e_s * e_u + eps * (silu * u).abs()
    return 1.25 * e_y


def _errors(out, ref):
    """(relative RMSE, max abs error) of `out` against the fp64 `ref`."""
    d = out.detach().double() - ref
    return float(d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300)), float(d.abs().max())


def test_compiled_model_block_bf16(monkeypatch):
    """A norm -> SwiGLU block under torch.compile(fullgraph, dynamic): the custom ops in a compiled
    graph as accurate as eager.  Compiled and eager are each held to the fp64 block of the same bf16
    values: y elementwise to _block_error_bound (it holds for any correct rounding order), and every
    output and gradient by its error norms: relative RMSE within 1.5x eager's, max abs error within
    2x eager's + one bf16 ulp of the largest |reference|."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    M, H, I = 2048, 2048, 8192
    x, w = _rand(M, H, scale=2.0), _rand(H, scale=0.3, shift=1.0, seed=1)
    wg, wu = _rand(H, I, scale=0.02, seed=2), _rand(H, I, scale=0.02, seed=3)
    lw, lb = _rand(H, scale=0.3, shift=1.0, seed=4), _rand(H, scale=0.3, seed=5)
    dy = _rand(M, I, seed=6)

    def block(x, w, lw, lb):
        h = liger_rt.ops.layer_norm(liger_rt.ops.rms_norm(x, w), lw, lb, 1e-6)
        return liger_rt.ops.swiglu(h @ wg, h @ wu)

    comp = torch.compile(block, fullgraph=True, dynamic=True)
    args = (x, w, lw, lb)
    outs = {"compiled": _run(comp, args, dy), "eager": _run(block, args, dy)}
    outs = {what: [t.detach() for t in got] for what, got in outs.items()}
    wg64, wu64 = wg.double(), wu.double()
    args64 = tuple(t.double() for t in args)
    ref = [t.detach() for t in _run(lambda *a: _block_fp64(*a, wg64, wu64), args64, dy.double())]
    with torch.no_grad():
        bound = _block_error_bound(*args64, wg64, wu64)
    for what, got in outs.items():
        over = (got[0].double() - ref[0]).abs() > bound
        assert not over.any(), (f"{what} y: {int(over.sum())} of {over.numel()} elements beyond the rounding "
                                f"bound (worst {float(((got[0].double() - ref[0]).abs() / bound).max()):.3g}x)")
    for i, name in enumerate(["y", "dx", "dw", "dlw", "dlb"]):
        (rel_c, max_c), (rel_e, max_e) = _errors(outs["compiled"][i], ref[i]), _errors(outs["eager"][i], ref[i])
        detail = (f"{name}: compiled rel RMSE {rel_c:.3g}, max abs err {max_c:.3g}; "
                  f"eager {rel_e:.3g}, {max_e:.3g} (vs fp64)")
        assert rel_e < 2e-2, detail                       # a few bf16 roundings: the reference is the same block
        assert rel_c <= 1.5 * rel_e + 1e-4, detail
        assert max_c <= 2 * max_e + _bf16_ulp(float(ref[i].abs().max())), detail


def test_rng_draws_after_a_failed_capture():
    """A capture that fails (here: a host sync inside it) leaves the CUDA generator usable: otherwise
    the next torch.randn raises "Offset increment outside graph capture encountered unexpectedly" (seen
    on an H200 after Liger-Kernel's fused MoE failed its capture in the bench)."""
    x = torch.ones(4, device=DEV)
    with pytest.raises(Exception):
        autotune.graph_ms(lambda: x.sum().item())
    torch.cuda.synchronize()
    torch.manual_seed(0)
    a = torch.randn(8, device=DEV)
    torch.manual_seed(0)
    assert torch.equal(a, torch.randn(8, device=DEV))
