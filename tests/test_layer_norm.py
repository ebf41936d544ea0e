"""layer_norm through the Triton interpreter: tiny shapes, fp64 references (the contract every op keeps:
tests/test_op_contract.py)."""
import pytest
import torch
import torch.nn.functional as F

from liger_rt.autograd import call_impl
from liger_rt.freshness import source_hash
import liger_rt.ops
from liger_rt import backend, dispatch
from liger_rt.kernels import layer_norm as ln
from liger_rt.numerics import assert_close
from routing import record_impls

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = backend.profile("cpu")
WIDE = ln.LayerNormConfig(num_warps=4, ROWS=32, bwd_num_warps=4, bwd_progs_per_sm=2, bwd_prefetch=1)


def _inputs(shape, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = (1.5 + 2.0 * torch.randn(*shape, generator=g)).to(dtype)           # nonzero mean
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    b = (0.5 * torch.randn(shape[-1], generator=g)).to(dtype) if bias else None
    dy = torch.randn(*shape, generator=g).to(dtype)
    return x, w, b, dy


def _fwd_bwd(fn, x, w, b, dy, eps=1e-5):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    y = fn(leaves[0], leaves[1], leaves[2] if b is not None else None, eps)
    return [y, *torch.autograd.grad(y, leaves, dy)]


def _ref(x, w, b, dy):
    """LayerNorm evaluated in float64 on the same values, rounded to their dtypes: PyTorch's
    fp32 CPU LayerNorm backward is itself ~4x less accurate than the kernel at 1151 rows."""
    d = lambda t: t.double() if t is not None else None  # noqa: E731
    outs = _fwd_bwd(lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps), d(x), d(w), d(b), d(dy))
    return [o.to(t.dtype) for o, t in zip(outs, [x, x, w, b] if b is not None else [x, x, w])]


def _triton(config):
    return lambda x, w, b, eps: call_impl(ln.OP, "triton", config, x, w, b, eps)


def _check(outs, refs, dtype, rows, what=""):
    names = ("y", "dx", "dw", "db")
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.dtype == r.dtype and o.shape == r.shape, names[i]
        assert_close(o, r, dtype, reduce_len=rows if i >= 2 else 1, name=f"{what} {names[i]}")


def _heuristic(hidden):
    return ln._heuristic(CPU, {"rows": 1, "hidden": hidden}, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype):
    x, w, b, dy = _inputs((3, 5, 100), dtype)
    outs = _fwd_bwd(_triton(_heuristic(100)), x, w, b, dy)
    _check(outs, _ref(x, w, b, dy), dtype, 15, f"{dtype} vs ref")
    exact = _fwd_bwd(ln.layer_norm_ref, x.float(), w.float(), b.float(), dy.float())
    for i, (o, r) in enumerate(zip(outs, exact)):
        assert_close(o, r, dtype, reduce_len=15 if i >= 2 else 1, name=f"{dtype} vs fp32 output {i}")


def test_hand_computed():
    x, w, b, dy = _inputs((4, 24), torch.float32, seed=1)
    y = _triton(_heuristic(24))(x, w, b, 1e-6)
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    assert_close(y, (x - mu) / torch.sqrt(var + 1e-6) * w + b, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_bias(dtype):
    x, w, _, dy = _inputs((9, 72), dtype, seed=2, bias=False)
    outs = _fwd_bwd(_triton(_heuristic(72)), x, w, None, dy)
    assert len(outs) == 3
    _check(outs, _ref(x, w, None, dy), dtype, 9, "no bias")


def test_one_row():
    x, w, b, dy = _inputs((1, 64), torch.float32, seed=3)
    _check(_fwd_bwd(_triton(_heuristic(64)), x, w, b, dy), _ref(x, w, b, dy),
           torch.float32, 1)


@pytest.mark.parametrize("rows,hidden,dtype", [(199, 760, torch.bfloat16), (1151, 1000, torch.float32)])
def test_odd_sizes(rows, hidden, dtype):
    x, w, b, dy = _inputs((rows, hidden), dtype, seed=4)
    _check(_fwd_bwd(_triton(WIDE), x, w, b, dy), _ref(x, w, b, dy), dtype, rows,
           f"{rows}x{hidden}")


def test_siglip_width_bf16():
    x, w, b, dy = _inputs((3, 1152), torch.bfloat16, seed=5)
    _check(_fwd_bwd(_triton(_heuristic(1152)), x, w, b, dy), _ref(x, w, b, dy),
           torch.bfloat16, 3, "1152")


def test_non_contiguous():
    g = torch.Generator().manual_seed(6)
    base = torch.randn(4, 6, 200, generator=g) + 1.0
    w = torch.randn(100, generator=g) + 1.0
    b = torch.randn(100, generator=g)
    dy = torch.randn(4, 6, 100, generator=g)
    fn = lambda x, w, b, eps: liger_rt.ops.layer_norm(x, w, b, eps)  # noqa: E731
    for name, x in {"row-strided view": base[..., :100], "column stride 2": base[..., ::2],
                    "transposed": base[..., 100:].transpose(0, 1)}.items():
        d = dy.transpose(0, 1) if name == "transposed" else dy
        _check(_fwd_bwd(fn, x, w, b, d), _ref(x, w, b, d), torch.float32, 24, name)
    dy_t = torch.randn(100, 6, 4, generator=g).permute(2, 1, 0)
    x = base[..., :100]
    _check(_fwd_bwd(fn, x, w, b, dy_t), _ref(x, w, b, dy_t), torch.float32, 24, "strided dy")


def test_a_db_row_where_torch_is_faster_picks_torch():
    """torch is a measured candidate of layer_norm: a DB row in which it is faster makes dispatch pick it."""
    x = torch.randn(6, 48, dtype=torch.bfloat16)
    from liger_rt.tuning_db import open_store
    store = open_store()
    for impl, ms in (("torch", 0.01), ("triton", 0.02)):
        store.put_tuning(dict(op="layer_norm", variant="fwdbwd", arch="cpu", dtype="bf16",
                              static_key=ln.OP.static_key({"hidden": 48}), bucket=ln.OP.bucket_key({"rows": 6}),
                              impl=impl, config={} if impl == "torch" else _heuristic(48).to_dict(), median_ms=ms,
                              baseline_ms=0.01, source_hash=source_hash(ln.OP), config_schema=ln.OP.schema_version,
                              origin="sweep", method="cpu-wall"))
    store.close()
    dispatch.reset()
    d = dispatch.decision(ln.OP, x, rows=6, hidden=48)
    assert (d.impl, d.origin) == ("torch", "db")


def test_errors_and_fallbacks(monkeypatch):
    d = dispatch.select("layer_norm", dtype="bf16", arch="cpu", rows=4, hidden=ln.MAX_HIDDEN + 1)
    assert d.impl == "torch"
    with pytest.raises(ValueError, match="hidden <= 32768"):
        ln.layer_norm_fwd(torch.randn(2, ln.MAX_HIDDEN + 1), torch.ones(ln.MAX_HIDDEN + 1), None, 1e-5, WIDE)
    with pytest.raises(ValueError, match="bias must have shape"):
        liger_rt.ops.layer_norm(torch.randn(2, 8), torch.ones(8), torch.ones(7))
    with pytest.raises(ValueError, match="at least one dim"):
        liger_rt.ops.layer_norm(torch.tensor(1.0), torch.ones(1), None)
    with pytest.raises(TypeError, match="accepted"):   # integers are refused, not truncated
        liger_rt.ops.layer_norm(torch.ones(2, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32), None)
    with pytest.raises(TypeError, match="accepted"):
        liger_rt.ops.layer_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.int64), None)
    ran = record_impls(monkeypatch, ln.OP)
    x = torch.randn(3, 8, dtype=torch.float64)
    no_affine = liger_rt.ops.layer_norm(x, None, None)                      # weight None: torch
    torch.testing.assert_close(no_affine, (x - x.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False, keepdim=True)
                                                                           + 1e-5).sqrt())
    fp64 = liger_rt.ops.layer_norm(x, torch.ones(8, dtype=torch.float64), None)  # fp64: torch
    torch.testing.assert_close(fp64, no_affine)
    assert liger_rt.ops.layer_norm(torch.randn(0, 8), torch.ones(8), torch.zeros(8)).shape == (0, 8)
    assert ran == ["torch"] * 3
