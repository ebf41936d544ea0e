"""short_conv and moe_router on the GPU at LFM2 sizes, bf16/fp32 against fp32 references.

    python -m pytest -m gpu tests/gpu/test_lfm2_ops_gpu.py -q
"""
import pytest
import torch

from liger_rt import backend, dispatch
from liger_rt.autograd import call_impl
from liger_rt.kernels import moe_router as mr
from liger_rt.kernels import short_conv as sc
from liger_rt.numerics import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_mem(gib=8)]
DEV = "cuda"


@pytest.fixture
def force_triton(monkeypatch):
    """The Triton kernels whatever a (shipped or swept) DB would pick for the shape."""
    monkeypatch.setenv("LIGER_RT_IMPL_SHORT_CONV", "triton")
    monkeypatch.setenv("LIGER_RT_IMPL_MOE_ROUTER", "triton")
    dispatch.reset()


def _rel_rmse(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


# -- short_conv ----------------------------------------------------------------------------------

def _conv_inputs(B, T, H, K, bias, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    bcx = torch.randn(B, T, 3 * H, device=DEV, generator=g).to(dtype)
    w = (torch.randn(H, K, device=DEV, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(H, device=DEV, generator=g).to(dtype) if bias else None
    dy = torch.randn(B, T, H, device=DEV, generator=g).to(dtype)
    return bcx, w, b, dy


def _conv_run(fn, bcx, w, b, dy, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (bcx, w) + ((b,) if b is not None else ())]
    y = fn(leaves[0], leaves[1], leaves[2] if b is not None else None, **kw)
    return [y, *torch.autograd.grad(y, leaves, dy)]


def _conv_check(outs, bcx, w, b, dy, seq_idx=None, what=""):
    f = lambda t: t.float() if t is not None else None  # noqa: E731
    refs = _conv_run(lambda x, ww, bb: sc.short_conv_ref(x, ww, bb, seq_idx), f(bcx), f(w), f(b), f(dy))
    B, T, H = outs[0].shape
    dtype = bcx.dtype
    names = ["y", "dbcx", "dweight", "dbias"]
    for i, (o, r) in enumerate(zip(outs, refs)):
        if i == 1:
            for j, part in enumerate("BCx"):
                assert_close(o[..., j * H:(j + 1) * H], r[..., j * H:(j + 1) * H], dtype, name=f"{what} d{part}")
        else:
            assert_close(o, r, dtype, reduce_len=1 if i == 0 else B * T, name=f"{what} {names[i]}")
        assert _rel_rmse(o, r) < (1e-5 if dtype == torch.float32 else 8e-3), f"{what} {names[i]} rel rmse"


# B*T = 65536 tokens: bcx (65536 x 6144) in fp32 for the reference and its gradient (1.6 GB each), the
# reference's saved products (0.5 GB each) and the comparison's fp32 copies of dbcx
BIG = pytest.mark.gpu_mem(gib=16)


@pytest.mark.parametrize("B,T,H,K,bias", [(1, 4096, 2048, 3, False), pytest.param(8, 4096, 2048, 3, True, marks=BIG),
                                          pytest.param(1, 65536, 2048, 3, False, marks=BIG), (3, 1000, 1536, 4, True),
                                          (5, 333, 67, 2, False), (4, 1, 2048, 3, True)])
def test_short_conv_bf16_real_sizes(B, T, H, K, bias, force_triton):
    bcx, w, b, dy = _conv_inputs(B, T, H, K, bias, torch.bfloat16)
    d = dispatch.decision(sc.OP, bcx, batch=B, seq=T, hidden=H, kernel=K)
    assert d.impl == "triton", d
    _conv_check(_conv_run(sc.short_conv, bcx, w, b, dy), bcx, w, b, dy, what=f"B{B} T{T} H{H} K{K}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_short_conv_other_dtypes(dtype, force_triton):
    bcx, w, b, dy = _conv_inputs(2, 4096, 2048, 3, True, dtype)
    _conv_check(_conv_run(sc.short_conv, bcx, w, b, dy), bcx, w, b, dy, what=str(dtype))


def test_short_conv_packed_sequences(force_triton):
    lengths = [1000, 1, 2047, 1048]     # 4096 tokens in one row, one single-token sequence
    pos = torch.cat([torch.arange(n) for n in lengths])[None].repeat(2, 1).to(DEV)
    seq_idx = sc.seq_idx_from_position_ids(pos)
    bcx, w, b, dy = _conv_inputs(2, 4096, 2048, 3, True, torch.bfloat16, seed=1)
    outs = _conv_run(lambda *a: sc.short_conv(*a, seq_idx=seq_idx), bcx, w, b, dy)
    _conv_check(outs, bcx, w, b, dy, seq_idx, "packed")
    start = 0
    for n in lengths:   # each sequence alone gives the same output rows
        sl = slice(start, start + n)
        alone = sc.short_conv(bcx[:, sl].contiguous(), w, b)
        assert_close(outs[0][:, sl], alone, torch.bfloat16, name=f"sequence at {start}")
        start += n


def test_short_conv_strided_view(force_triton):
    big = torch.randn(2, 4100, 3 * 2048 + 64, device=DEV).bfloat16()
    bcx = big[:, 4:, 32:32 + 3 * 2048]
    _, w, b, dy = _conv_inputs(2, 4096, 2048, 3, False, torch.bfloat16)
    _conv_check(_conv_run(sc.short_conv, bcx, w, b, dy), bcx, w, b, dy, what="strided")


def test_short_conv_every_hopper_config_compiles_and_matches():
    prof = backend.detect()
    dims = {"batch": 2, "seq": 3000, "hidden": 2048, "kernel": 3}
    bcx, w, b, dy = _conv_inputs(2, 3000, 2048, 3, False, torch.bfloat16, seed=2)
    for cfg in sc.OP.candidates_for(sc.OP.impl("triton"), prof, dims, torch.bfloat16):
        outs = _conv_run(lambda x, ww, bb: call_impl(sc.OP, "triton", cfg, x, ww, bb, None), bcx, w, b, dy)
        _conv_check(outs, bcx, w, b, dy, what=str(cfg))


def test_short_conv_matches_hf_module_bf16(force_triton):
    from transformers.models.lfm2.configuration_lfm2 import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
    torch.manual_seed(0)
    cfg = Lfm2Config(hidden_size=2048, num_hidden_layers=2, layer_types=["conv", "full_attention"])
    hf = Lfm2ShortConv(cfg, 0).to(DEV, torch.bfloat16)
    x = torch.randn(2, 2048, 2048, device=DEV, dtype=torch.bfloat16)
    ref = hf(x)
    ours = hf.out_proj(sc.short_conv(hf.in_proj(x), hf.conv.weight.squeeze(1), hf.conv.bias))
    # both round differently (HF rounds B*x and the conv to bf16), both near the fp32 truth
    assert _rel_rmse(ours, ref) < 1e-2


# -- moe_router -----------------------------------------------------------------------------------

def _router_inputs(T, E, k, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(T, E, device=DEV, generator=g).mul(2).to(dtype)
    bias = 0.05 * torch.randn(E, device=DEV, generator=g)
    dw = torch.randn(T, k, device=DEV, generator=g).to(dtype)
    return logits, bias, dw


def _router_run(fn, logits, k, bias, norm, scale, dw):
    x = logits.detach().clone().requires_grad_()
    w, idx = fn(x, k, bias, norm, scale)
    return w, idx, torch.autograd.grad(w, x, dw)[0]


def _hf_route(logits, k, bias, norm, scale):
    p = logits.sigmoid()
    if bias is not None:
        _, idx = torch.topk(p + bias, k, dim=-1)
        w = torch.gather(p, 1, idx).type_as(logits)
    else:
        w, idx = torch.topk(p, k, dim=-1)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-6)
    return w * scale, idx


@pytest.mark.parametrize("T,E,k", [(65536, 32, 4), (4096, 32, 4), (65536, 64, 4), (4096, 256, 8), (999, 67, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,norm,scale", [(True, True, 1.0), (False, False, 2.5)])
def test_router_real_sizes(T, E, k, dtype, bias, norm, scale, force_triton):
    logits, eb, dw = _router_inputs(T, E, k, dtype)
    eb = eb if bias else None
    assert dispatch.decision(mr.OP, logits, tokens=T, experts=E, top_k=k).impl == "triton"
    w, idx, dl = _router_run(mr.moe_router, logits, k, eb, norm, scale, dw)
    wr, ir, dlr = _router_run(mr.moe_router_ref, logits, k, eb, norm, scale, dw)
    # the kernel's sigmoid is torch's (1/(1+expf(-x)), IEEE division): the same experts in the same order
    assert torch.equal(idx, ir), f"{int((idx != ir).any(-1).sum())} rows differ"
    assert_close(w, wr, dtype, reduce_len=k, name="weights")
    assert_close(dl, dlr, dtype, reduce_len=k, name="dlogits")
    # and the expert sets equal HF's torch.topk on CUDA (radix select: ties fill in index order;
    # bf16 scores tie often).  On CPU torch.topk picks among ties arbitrarily.
    _, ih = _hf_route(logits, k, eb, norm, scale)
    if logits.is_cuda:
        assert torch.equal(idx.sort(-1).values, ih.sort(-1).values)


def test_router_ties_match_cuda_topk_set(force_triton):
    g = torch.Generator(device=DEV).manual_seed(3)
    logits = torch.randint(0, 3, (65536, 32), device=DEV, generator=g).float()
    w, idx = mr.moe_router(logits, 4)
    _, ih = torch.topk(logits.sigmoid(), 4, dim=-1)      # CUDA radix select: ties fill in index order
    assert torch.equal(idx.sort(-1).values, ih.sort(-1).values)
    ir = mr.moe_router_ref(logits, 4)[1]
    assert torch.equal(idx, ir)


def test_router_every_config():
    prof = backend.detect()
    dims = {"tokens": 4096, "experts": 32, "top_k": 4}
    logits, eb, dw = _router_inputs(4096, 32, 4, torch.bfloat16, seed=4)
    wr, ir, dlr = _router_run(mr.moe_router_ref, logits, 4, eb, True, 1.0, dw)
    for cfg in mr.OP.candidates_for(mr.OP.impl("triton"), prof, dims, torch.bfloat16):
        w, idx, dl = _router_run(lambda *a, cfg=cfg: call_impl(mr.OP, "triton", cfg, *a), logits, 4, eb, True, 1.0, dw)
        assert torch.equal(idx, ir), cfg
        assert_close(w, wr, torch.bfloat16, reduce_len=4, name=str(cfg))
        assert_close(dl, dlr, torch.bfloat16, reduce_len=4, name=str(cfg))


def test_env_forces_torch(monkeypatch):
    logits, eb, dw = _router_inputs(4096, 32, 4, torch.bfloat16)
    monkeypatch.setenv("LIGER_RT_IMPL_MOE_ROUTER", "torch")
    monkeypatch.setenv("LIGER_RT_IMPL_SHORT_CONV", "torch")
    dispatch.reset()
    assert dispatch.decision(mr.OP, logits, tokens=4096, experts=32, top_k=4).impl == "torch"
    bcx = torch.randn(1, 64, 3 * 2048, device=DEV, dtype=torch.bfloat16)
    assert dispatch.decision(sc.OP, bcx, batch=1, seq=64, hidden=2048, kernel=3).impl == "torch"
