"""rms_norm through the Triton interpreter: tiny shapes, fp32 references (the contract every op keeps:
tests/test_op_contract.py)."""
import pytest
import torch

from liger_rt.autograd import call_impl
import liger_rt.ops
from liger_rt import backend, dispatch
from liger_rt.kernels import rms_norm as rn
from liger_rt.numerics import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = backend.profile("cpu")
# wide tiles: few programs, so the larger odd shapes stay cheap in the interpreter
WIDE = {"num_warps": 4, "ROWS": 32, "bwd_num_warps": 4, "bwd_progs_per_sm": 2, "bwd_prefetch": 1, "bwd_rows": 1}
TILED = dict(WIDE, bwd_rows=16, bwd_prefetch=0)   # the backward on (16, hidden) tiles


def _inputs(shape, dtype, seed=0, w_scale=0.5, w_mean=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 2.0).to(dtype)
    w = (w_mean + w_scale * torch.randn(shape[-1], generator=g)).to(dtype)
    dy = torch.randn(*shape, generator=g).to(dtype)
    return x, w, dy


def _fwd_bwd(fn, x, w, dy, **kw):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w, **kw)
    return [y, *torch.autograd.grad(y, (x, w), dy)]


def _triton(config):
    return lambda x, w, eps=1e-6, offset=0.0: call_impl(rn.OP, "triton", config, x, w, eps, offset)


def _check(outs, refs, dtype, rows, what=""):
    assert outs[0].dtype == refs[0].dtype and outs[1].dtype == refs[1].dtype and outs[2].dtype == refs[2].dtype
    assert_close(outs[0], refs[0], dtype, name=f"{what} y")
    assert_close(outs[1], refs[1], dtype, name=f"{what} dx")
    assert_close(outs[2], refs[2], dtype, reduce_len=rows, name=f"{what} dw")


def _heuristic(hidden):
    return rn._heuristic(CPU, {"rows": 1, "hidden": hidden}, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype):
    x, w, dy = _inputs((3, 5, 100), dtype)
    outs = _fwd_bwd(_triton(_heuristic(100)), x, w, dy)
    # the reference module's own casting (fp32 statistics, normalised x rounded to dtype)...
    _check(outs, _fwd_bwd(rn.rms_norm_ref, x, w, dy), dtype, 15, f"{dtype} vs ref")
    # ...and exact fp32 math on the same values, within the dtype's tolerance
    exact = _fwd_bwd(rn.rms_norm_ref, x.float(), w.float(), dy.float())
    for i, (o, r) in enumerate(zip(outs, exact)):
        assert_close(o, r, dtype, reduce_len=15 if i == 2 else 1, name=f"{dtype} vs fp32 output {i}")


def test_hand_computed():
    """A formula check independent of rms_norm_ref."""
    x, w, dy = _inputs((4, 24), torch.float32, seed=3)
    y = _triton(_heuristic(24))(x, w, eps=1e-5)
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    assert_close(y, expect, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_gemma(dtype):
    x, w, dy = _inputs((9, 72), dtype, seed=1, w_scale=0.3, w_mean=0.0)   # Gemma stores w - 1
    outs = _fwd_bwd(_triton(_heuristic(72)), x, w, dy, offset=1.0)
    refs = _fwd_bwd(rn.rms_norm_ref, x, w, dy, offset=1.0)
    _check(outs, refs, dtype, 9, "offset=1")
    plain = _fwd_bwd(rn.rms_norm_ref, x, w, dy)
    assert (outs[0].float() - plain[0].float()).abs().max() > 0.1   # the offset is not ignored


def test_weight_fp32_input_bf16_promotes():
    x, w, dy = _inputs((6, 40), torch.bfloat16, seed=2)
    w = w.float()
    outs = _fwd_bwd(_triton(_heuristic(40)), x, w, dy.float())
    refs = _fwd_bwd(rn.rms_norm_ref, x, w, dy.float())
    assert outs[0].dtype == torch.float32 and outs[1].dtype == torch.bfloat16 and outs[2].dtype == torch.float32
    _check(outs, refs, torch.bfloat16, 6, "mixed")


def test_one_row():
    x, w, dy = _inputs((1, 64), torch.float32, seed=4)
    _check(_fwd_bwd(_triton(_heuristic(64)), x, w, dy), _fwd_bwd(rn.rms_norm_ref, x, w, dy), torch.float32, 1)


@pytest.mark.parametrize("rows,hidden,dtype,config", [(199, 760, torch.bfloat16, WIDE), (1151, 1000, torch.float32, WIDE),
                                                      (199, 60, torch.bfloat16, TILED), (1151, 100, torch.float32, TILED)])
def test_odd_sizes(rows, hidden, dtype, config):
    """Odd rows and hidden: the last row tile and the column tail are masked (1-D walk and tiles)."""
    x, w, dy = _inputs((rows, hidden), dtype, seed=5)
    _check(_fwd_bwd(_triton(config), x, w, dy), _fwd_bwd(rn.rms_norm_ref, x, w, dy), dtype, rows, f"{rows}x{hidden}")


def test_non_contiguous():
    g = torch.Generator().manual_seed(6)
    base = torch.randn(4, 6, 200, generator=g)
    w = torch.randn(100, generator=g) + 1.0
    dy = torch.randn(4, 6, 100, generator=g)
    views = {
        "row-strided view (no copy)": base[..., :100],                     # rows 200 apart
        "column stride 2 (copied)": base[..., ::2],
        "transposed leading dims": base[..., 100:].transpose(0, 1),        # dy transposed to match below
    }
    for name, x in views.items():
        d = dy.transpose(0, 1) if "transposed" in name else dy
        outs = _fwd_bwd(lambda a, b: liger_rt.ops.rms_norm(a, b), x, w, d)
        refs = _fwd_bwd(rn.rms_norm_ref, x, w, d)
        assert outs[0].shape == x.shape and outs[1].shape == x.shape
        _check(outs, refs, torch.float32, 24, name)
    # a non-contiguous upstream gradient
    x = base[..., :100]
    dy_t = torch.randn(100, 6, 4, generator=g).permute(2, 1, 0)
    _check(_fwd_bwd(lambda a, b: liger_rt.ops.rms_norm(a, b), x, w, dy_t), _fwd_bwd(rn.rms_norm_ref, x, w, dy_t),
           torch.float32, 24, "strided dy")


def test_unsupported_hidden_goes_to_torch_and_launcher_raises():
    d = dispatch.select("rms_norm", dtype="bf16", arch="cpu", rows=4, hidden=rn.MAX_HIDDEN + 1)
    assert d.impl == "torch"
    x = torch.randn(2, rn.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match="hidden <= 32768"):
        rn.rms_norm_fwd(x, torch.ones(rn.MAX_HIDDEN + 1), 1e-6, 0.0, {})
    with pytest.raises(ValueError, match="weight must have shape"):
        liger_rt.ops.rms_norm(torch.randn(2, 8), torch.ones(9))


def test_other_dtypes_and_empty_use_reference():
    x = torch.randn(3, 16, dtype=torch.float64)
    w = torch.rand(16, dtype=torch.float64) + 0.5
    assert torch.equal(liger_rt.ops.rms_norm(x, w), rn.rms_norm_ref(x, w))
    assert liger_rt.ops.rms_norm(torch.randn(0, 16), torch.ones(16)).shape == (0, 16)
