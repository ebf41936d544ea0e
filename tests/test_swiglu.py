"""swiglu through the Triton interpreter: tiny shapes, fp64 formulas and the op's reference."""
import pytest
import torch
import torch.nn.functional as F

import liger_rt.ops
from liger_rt import dispatch
from liger_rt.kernels import swiglu as sw
from liger_rt.numerics import assert_close
from gated_checks import check, check_reference_and_fp64, cpu_heuristic, fwd_bwd, inputs, triton
from routing import record_impls

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WIDE = sw.SwiGLUConfig(BLOCK_N=1024, ROWS=16, num_warps=4, bwd_num_warps=4)


def _exact(gate, up, dy):
    """y, dgate, dup by the formula in fp64 (independent of swiglu_ref and of autograd), cast to
    the dtypes the op returns."""
    g, u, d = gate.double(), up.double(), dy.double()
    sig = torch.sigmoid(g)
    y, dg, du = g * sig * u, d * u * sig * (1 + g * (1 - sig)), d * g * sig
    return [y.to(torch.promote_types(gate.dtype, up.dtype)), dg.to(gate.dtype), du.to(up.dtype)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype):
    """The eager module's casting (silu rounded to the gate dtype) and the fp64 formula."""
    check_reference_and_fp64(sw.OP, sw.swiglu_ref, _exact, dtype)


def test_matches_eager_module_numerics_bf16():
    """Same two roundings as F.silu(g) * u in bf16: the forward matches eager to the bit."""
    gate, up, _ = inputs((8, 64), torch.bfloat16, seed=2)
    y = sw.swiglu_fwd(gate, up, cpu_heuristic(sw.OP, 64))
    assert torch.equal(y, F.silu(gate) * up)


def test_one_row():
    gate, up, dy = inputs((1, 64), torch.float32, seed=3)
    check(fwd_bwd(triton(sw.OP, cpu_heuristic(sw.OP, 64)), gate, up, dy), _exact(gate, up, dy), torch.float32)


@pytest.mark.parametrize("rows,cols,dtype", [(199, 760, torch.bfloat16), (1151, 1000, torch.float32)])
def test_odd_sizes(rows, cols, dtype):
    gate, up, dy = inputs((rows, cols), dtype, seed=4)
    check(fwd_bwd(triton(sw.OP, WIDE), gate, up, dy), _exact(gate, up, dy), dtype, f"{rows}x{cols}")


def test_mixed_dtypes_promote():
    gate, up, dy = inputs((6, 40), torch.bfloat16, seed=9)
    up = up.float()
    outs = fwd_bwd(triton(sw.OP, cpu_heuristic(sw.OP, 40)), gate, up, dy.float())
    assert [o.dtype for o in outs] == [torch.float32, torch.bfloat16, torch.float32]
    check(outs, fwd_bwd(sw.swiglu_ref, gate, up, dy.float()), torch.bfloat16, "mixed")


def test_fused_gate_up_halves_and_strided_views():
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(2, 7, 2 * 96, generator=g)
    dy = torch.randn(2, 7, 96, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)                     # rows 192 apart: read in place
    check(fwd_bwd(liger_rt.ops.swiglu, gate, up, dy), _exact(gate, up, dy), torch.float32, "chunked")
    # column stride 2 (copied), transposed leading dims, strided dy
    base = torch.randn(7, 2, 192, generator=g)
    gate2, up2 = base[..., ::2].transpose(0, 1), base[..., 1::2].transpose(0, 1)
    dy2 = torch.randn(96, 7, 2, generator=g).permute(2, 1, 0)
    check(fwd_bwd(liger_rt.ops.swiglu, gate2, up2, dy2), _exact(gate2, up2, dy2), torch.float32, "strided")


def test_gradients_reach_a_fused_projection():
    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(5, 2 * 48, generator=g, requires_grad=True)
    dy = torch.randn(5, 48, generator=g)
    y = liger_rt.ops.swiglu(*gate_up.chunk(2, -1))
    (dgu,) = torch.autograd.grad(y, gate_up, dy)
    _, dg, du = _exact(*gate_up.detach().chunk(2, -1), dy)
    assert_close(dgu, torch.cat((dg, du), -1), torch.float32)


def test_errors_and_fallbacks(monkeypatch):
    with pytest.raises(ValueError, match="same shape"):
        liger_rt.ops.swiglu(torch.randn(2, 8), torch.randn(2, 9))
    with pytest.raises(ValueError, match="same shape"):   # no broadcasting on the fp64 path either
        liger_rt.ops.swiglu(torch.randn(2, 8), torch.randn(1, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="accepted"):
        liger_rt.ops.swiglu(torch.ones(2, 8, dtype=torch.int32), torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="accepted"):
        liger_rt.ops.swiglu(torch.randn(2, 8), torch.ones(2, 8, dtype=torch.int64))
    ran = record_impls(monkeypatch, sw.OP)
    g64, u64 = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    for gate, up in ((g64, u64), (g64.float(), u64)):   # fp64 anywhere: torch, in fp64
        y = liger_rt.ops.swiglu(gate, up)
        assert y.dtype == torch.float64
        torch.testing.assert_close(y, _exact(gate, up, u64)[0], rtol=1e-6, atol=1e-6)
    assert liger_rt.ops.swiglu(torch.randn(0, 8), torch.randn(0, 8)).shape == (0, 8)
    assert ran == ["torch"] * 3


# -- LIGER_RT_RECOMPUTE_SWIGLU: down(swiglu(gate, up)) keeping gate and up only (layers/mlp.py) ----------------

def _mlp(bias: bool, seed: int):
    """A SwiGLU MLP with the HF layout (gate_proj, up_proj, down_proj) at odd widths, fp32."""
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.gate_proj, m.up_proj = torch.nn.Linear(24, 40, bias=bias), torch.nn.Linear(24, 40, bias=bias)
    m.down_proj = torch.nn.Linear(40, 24, bias=bias)
    return m


def _step(m, x, dy):
    """out, and the gradients of x and every weight, of the liger_rt MLP forward, with the bytes autograd kept
    (each storage once, the weights' not)."""
    from liger_rt.layers.mlp import swiglu_forward
    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = x.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = swiglu_forward(m, x)
    grads = torch.autograd.grad(out, (x, *m.parameters()), dy)
    return [out.detach(), *grads], sum(kept.values())


@pytest.mark.parametrize("bias", [False, True])
def test_recompute_swiglu_matches_the_module_and_keeps_less(bias, monkeypatch):
    """Under LIGER_RT_RECOMPUTE_SWIGLU=1: the output and every gradient match an fp64 run of the MLP formula, equal
    the plain path's bit for bit (the same kernels, the product recomputed), and autograd keeps one (rows,
    intermediate) fp32 tensor less."""
    m = _mlp(bias, seed=1)
    x, dy = torch.randn(3, 7, 24), torch.randn(3, 7, 24)
    plain, kept_plain = _step(m, x, dy)
    monkeypatch.setenv("LIGER_RT_RECOMPUTE_SWIGLU", "1")
    dispatch.reset()                    # the switch is read once, as a decision reads the environment
    lean, kept_lean = _step(m, x, dy)
    assert all(torch.equal(a, b) for a, b in zip(plain, lean))
    assert kept_plain - kept_lean == 3 * 7 * 40 * 4
    m64 = _mlp(bias, seed=1).double()
    x64 = x.double().requires_grad_()
    out64 = m64.down_proj(F.silu(m64.gate_proj(x64)) * m64.up_proj(x64))
    ref = [out64.detach(), *torch.autograd.grad(out64, (x64, *m64.parameters()), dy.double())]
    for got, want in zip(lean, ref):
        assert_close(got, want.float(), torch.float32)


def test_recompute_swiglu_leaves_a_hooked_down_projection_to_its_module(monkeypatch):
    """A forward hook on down_proj (a wrapper's, a profiler's) still runs: the plain path takes that call."""
    monkeypatch.setenv("LIGER_RT_RECOMPUTE_SWIGLU", "1")
    m, calls = _mlp(False, seed=2), []
    m.down_proj.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    out, _ = _step(m, torch.randn(5, 24), torch.randn(5, 24))
    assert calls == [torch.Size([5, 24])] and out[0].shape == (5, 24)


def test_recompute_swiglu_rejects_a_bad_value(monkeypatch):
    from liger_rt.env import EnvError
    monkeypatch.setenv("LIGER_RT_RECOMPUTE_SWIGLU", "maybe")
    with pytest.raises(EnvError, match="LIGER_RT_RECOMPUTE_SWIGLU='maybe' is not valid; accepted values: 0 or 1"):
        _step(_mlp(False, seed=3), torch.randn(2, 24), torch.randn(2, 24))
