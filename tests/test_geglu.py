"""geglu through the Triton interpreter: tiny shapes, an fp64 formula (tanh written out, independent
of F.gelu and of autograd), the op's reference, HF's GELUTanh module."""
import math

import pytest
import torch

import liger_rt.ops
from liger_rt.kernels import geglu as gg
from liger_rt.numerics import assert_close
from gated_checks import check, check_reference_and_fp64, cpu_heuristic, fwd_bwd, inputs, triton
from routing import record_impls

# the interpreter's numpy exp warns where sigmoid(2z) saturates (large negative gates); the result is exact
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WIDE = gg.GeGLUConfig(BLOCK_N=1024, ROWS=16, num_warps=4, bwd_num_warps=4)


def _exact(gate, up, dy):
    """y, dgate, dup of 0.5 g (1 + tanh(k (g + c g^3))) * u in fp64, derivative by hand."""
    g, u, d = gate.double(), up.double(), dy.double()
    k, c = math.sqrt(2.0 / math.pi), 0.044715
    t = torch.tanh(k * (g + c * g ** 3))
    a = 0.5 * g * (1.0 + t)
    da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * c * g * g)
    return [(a * u).to(torch.promote_types(gate.dtype, up.dtype)), (d * u * da).to(gate.dtype), (d * a).to(up.dtype)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_and_fp64(dtype):
    check_reference_and_fp64(gg.OP, gg.geglu_ref, _exact, dtype)


def test_matches_the_hugging_face_activation():
    """Gemma's act_fn(gate) * up (transformers' GELUTanh, gelu_pytorch_tanh) in fp32 and bf16."""
    from transformers.activations import ACT2FN
    act = ACT2FN["gelu_pytorch_tanh"]
    for dtype in (torch.float32, torch.bfloat16):
        gate, up, dy = inputs((7, 64), dtype, seed=2)
        check(fwd_bwd(liger_rt.ops.geglu, gate, up, dy), fwd_bwd(lambda g, u: act(g) * u, gate, up, dy),
               dtype, f"HF {dtype}")


def test_large_gates_do_not_overflow():
    gate = torch.tensor([[-200.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0, 5.0]])
    up, dy = torch.ones_like(gate), torch.ones_like(gate)
    outs = fwd_bwd(triton(gg.OP, cpu_heuristic(gg.OP, 8)), gate, up, dy)
    assert all(torch.isfinite(o).all() for o in outs)
    check(outs, _exact(gate, up, dy), torch.float32, "extremes")


@pytest.mark.parametrize("rows,cols,dtype", [(1, 64, torch.float32), (199, 760, torch.float16),
                                             (151, 1000, torch.float32)])
def test_odd_sizes(rows, cols, dtype):
    gate, up, dy = inputs((rows, cols), dtype, seed=4)
    check(fwd_bwd(triton(gg.OP, WIDE), gate, up, dy), _exact(gate, up, dy), dtype, f"{rows}x{cols}")


def test_fused_halves_strided_views_and_mixed_dtypes():
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(2, 7, 2 * 96, generator=g, requires_grad=True)
    dy = torch.randn(2, 7, 96, generator=g)
    y = liger_rt.ops.geglu(*gate_up.chunk(2, dim=-1))                # rows 192 apart: read in place
    (dgu,) = torch.autograd.grad(y, gate_up, dy)
    ref = _exact(*gate_up.detach().chunk(2, -1), dy)
    assert_close(y, ref[0], torch.float32)
    assert_close(dgu, torch.cat(ref[1:], -1), torch.float32)
    base = torch.randn(7, 2, 192, generator=g)                       # column stride 2, transposed dims
    gate2, up2 = base[..., ::2].transpose(0, 1), base[..., 1::2].transpose(0, 1)
    dy2 = torch.randn(96, 7, 2, generator=g).permute(2, 1, 0)
    check(fwd_bwd(liger_rt.ops.geglu, gate2, up2, dy2), _exact(gate2, up2, dy2), torch.float32, "strided")
    gate3, up3, dy3 = inputs((6, 40), torch.float16, seed=9)
    outs = fwd_bwd(triton(gg.OP, cpu_heuristic(gg.OP, 40)), gate3, up3.float(), dy3.float())
    assert [o.dtype for o in outs] == [torch.float32, torch.float16, torch.float32]


def test_errors_and_fallbacks(monkeypatch):
    with pytest.raises(ValueError, match="geglu: .* same shape"):
        liger_rt.ops.geglu(torch.randn(2, 8), torch.randn(2, 9))
    with pytest.raises(ValueError, match="geglu: .* same shape"):      # fp64 runs the reference: no broadcasting
        liger_rt.ops.geglu(torch.randn(2, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="geglu: .*accepted: floating point"):
        liger_rt.ops.geglu(torch.ones(2, 8, dtype=torch.int32), torch.ones(2, 8, dtype=torch.int32))
    ran = record_impls(monkeypatch, gg.OP)
    g64, u64 = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    y = liger_rt.ops.geglu(g64, u64)                                  # fp64: torch, in fp64
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, _exact(g64, u64, u64)[0], rtol=1e-9, atol=1e-9)
    assert liger_rt.ops.geglu(torch.randn(0, 8), torch.randn(0, 8)).shape == (0, 8)    # empty: torch too
    assert ran == ["torch", "torch"]
