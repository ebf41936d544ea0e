"""rope through the Triton interpreter: tiny shapes, fp64 references (the rotation written out, HF's
apply_rotary_pos_emb)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

from liger_rt.autograd import call_impl
import liger_rt.ops
from liger_rt import backend, dispatch
from liger_rt.kernels import rope as rp
from liger_rt.numerics import assert_close
from routing import record_impls

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = backend.profile("cpu")


def _inputs(b, s, hq, hk, d, dtype, seed=0, cos_batch=1, layout="bhsd"):
    """HF's tensors: q, k transposed views of (B, S, H, D) projections (layout "bhsd"), or the
    (B, S, H, D) tensors themselves ("bshd", unsqueeze_dim=2); cos, sin (cos_batch, S, D) from
    independent random angles (the two halves differ); upstream gradients contiguous in q's
    logical shape, which is not the outputs' memory layout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g).to(dtype)
    k = torch.randn(b, s, hk, d, generator=g).to(dtype)
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    angle = 0.3 + 4.0 * torch.rand(cos_batch, s, d, generator=g)
    cos, sin = angle.cos().to(dtype), (1.7 * angle).sin().to(dtype)
    dq = torch.randn(q.shape, generator=g).to(dtype)
    dk = torch.randn(k.shape, generator=g).to(dtype)
    return q, k, cos, sin, dq, dk


def _fwd_bwd(fn, q, k, cos, sin, dq, dk):
    q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()   # clone keeps strides
    qe, ke = fn(q, k, cos, sin)
    return [qe, ke, *torch.autograd.grad((qe, ke), (q, k), (dq, dk))]


def _exact(q, k, cos, sin, dq, dk, unsqueeze_dim=1):
    """q_embed, k_embed, dq, dk: the rotation and its transpose written out in fp64 on the same
    (rounded) values, independent of rope_ref and of autograd, cast to the op's dtypes."""
    c, s = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    h = q.shape[-1] // 2
    c1, c2, s1, s2 = c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    out = []
    for x in (q, k):
        x1, x2 = x.double()[..., :h], x.double()[..., h:]
        dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
        out.append(torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), -1).to(dtype))
    for x, dy in ((q, dq), (k, dk)):
        g1, g2 = dy.double()[..., :h], dy.double()[..., h:]
        out.append(torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), -1).to(x.dtype))
    return out


def _triton(config, unsqueeze_dim=1):
    return lambda q, k, c, s: call_impl(rp.OP, "triton", config, q, k, c, s, unsqueeze_dim)


NAMES = ("q_embed", "k_embed", "dq", "dk")


def _check(outs, refs, dtype, what=""):
    for o, r, name in zip(outs, refs, NAMES):
        assert o.shape == r.shape, f"{what} {name}"
        assert_close(o, r, dtype, name=f"{what} {name}")


def _dims(hq, hk, d, tokens):
    return {"heads_q": hq, "heads_k": hk, "head_dim": d, "tokens": tokens}


def _heuristic(hq, hk, d):
    return rp._heuristic(CPU, _dims(hq, hk, d, 1), torch.float32)


@pytest.fixture
def ran(monkeypatch):
    """The implementations that ran, in order ("triton", "torch")."""
    return record_impls(monkeypatch, rp.OP)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype):
    """GQA (6 q heads, 3 kv heads: neither a power of two), D 20 (half 10: masked tiles), odd seq,
    full-batch cos, transposed q/k views."""
    q, k, cos, sin, dq, dk = _inputs(2, 7, 6, 3, 20, dtype, cos_batch=2)
    assert not q.is_contiguous() and q.stride(-1) == 1
    outs = _fwd_bwd(_triton(_heuristic(6, 3, 20)), q, k, cos, sin, dq, dk)
    assert [o.dtype for o in outs] == [dtype] * 4
    _check(outs, _exact(q, k, cos, sin, dq, dk), dtype, f"{dtype}")
    # fp32 compute rounded once: the same numbers as the fp32 reference cast to dtype (interpreter:
    # the same fp32 products and sums; RNE_BF16 rounds like the GPU)
    qe, ke = rp.rope_ref(q, k, cos, sin)
    assert torch.equal(outs[0], qe) and torch.equal(outs[1], ke)
    # outputs are fresh, laid out (B, S, H, D) in memory like HF's q/k
    assert outs[0].transpose(1, 2).is_contiguous() and outs[0].data_ptr() != q.data_ptr()


def test_cos_halves_unequal():
    """Each half of cos/sin is read where it belongs: a kernel that reused the first half fails."""
    q, k, cos, sin, dq, dk = _inputs(1, 4, 2, 2, 16, torch.float32, seed=2)
    assert (cos[..., :8] != cos[..., 8:]).all() and (sin[..., :8] != sin[..., 8:]).all()
    outs = _fwd_bwd(liger_rt.ops.rope, q, k, cos, sin, dq, dk)
    _check(outs, _exact(q, k, cos, sin, dq, dk), torch.float32)
    tied = lambda t: torch.cat((t[..., :8], t[..., :8]), -1)   # noqa: E731
    wrong = _exact(q, k, tied(cos), tied(sin), dq, dk)
    assert all((o - w).abs().max() > 0.1 for o, w in zip(outs, wrong))


@pytest.mark.parametrize("cos_batch", [1, 3])
@pytest.mark.parametrize("seq", [1, 7])
def test_cos_batch_and_seq_lengths(cos_batch, seq):
    q, k, cos, sin, dq, dk = _inputs(3, seq, 4, 2, 16, torch.float32, seed=3, cos_batch=cos_batch)
    outs = _fwd_bwd(liger_rt.ops.rope, q, k, cos, sin, dq, dk)
    _check(outs, _exact(q, k, cos, sin, dq, dk), torch.float32, f"cos batch {cos_batch}, seq {seq}")
    if cos_batch == 3:   # a per-batch table is not read as batch 0's
        wrong = _exact(q, k, cos[:1], sin[:1], dq, dk)
        assert (outs[0] - wrong[0]).abs().max() > 0.1


def test_fp32_inputs_bf16_tables_promote_and_strided_views():
    q, k, _, _, dq, dk = _inputs(2, 5, 4, 2, 16, torch.float32, seed=4)
    _, _, cos, sin, _, _ = _inputs(2, 5, 4, 2, 16, torch.bfloat16, seed=5)
    outs = _fwd_bwd(liger_rt.ops.rope, q, k, cos, sin, dq, dk)
    assert [o.dtype for o in outs] == [torch.float32] * 4      # eager: promote(fp32, bf16)
    _check(outs, _exact(q, k, cos, sin, dq, dk), torch.float32, "mixed")
    # head-dim stride 2 (copied), q/k slices of one fused projection, cos/sin and dy strided
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(2, 5, 4 + 2 + 2, 2 * 16, generator=g)[..., ::2]    # (B, S, Hq + 2 Hk, D), stride_d 2
    qs, ks = qkv[:, :, :4].transpose(1, 2), qkv[:, :, 4:6].transpose(1, 2)
    cos_w = torch.randn(1, 5, 32, generator=g)[..., 16:]                  # row stride 32
    sin_w = torch.randn(1, 5, 16, 2, generator=g)[..., 0]                 # stride_d 2 (copied)
    dq_t = torch.randn(2, 4, 16, 5, generator=g).transpose(-1, -2)        # stride_d 5 (copied)
    outs = _fwd_bwd(liger_rt.ops.rope, qs, ks, cos_w, sin_w, dq_t, dk)
    _check(outs, _exact(qs, ks, cos_w, sin_w, dq_t, dk), torch.float32, "strided")


def test_unused_k_embed_gives_zero_dk(ran):
    q, k, cos, sin, dq, _ = _inputs(1, 3, 2, 2, 8, torch.float32, seed=7)
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    qe, _ = liger_rt.ops.rope(q, k, cos, sin)
    gq, gk = torch.autograd.grad(qe, (q, k), dq)
    assert ran == ["triton"] and torch.equal(gk, torch.zeros_like(k))
    assert_close(gq, _exact(q, k, cos, sin, dq, torch.zeros_like(k))[2], torch.float32)


@pytest.mark.parametrize("unsqueeze_dim", [2, -2])
def test_unsqueeze_dim_2_layout(unsqueeze_dim, ran):
    """(B, S, H, D) tensors, cos.unsqueeze(2): the kernel runs through the same strides."""
    q, k, cos, sin, dq, dk = _inputs(2, 5, 4, 2, 16, torch.bfloat16, seed=8, layout="bshd")
    outs = _fwd_bwd(lambda a, b, c, s: liger_rt.ops.rope(a, b, c, s, unsqueeze_dim=unsqueeze_dim), q, k, cos, sin,
                    dq, dk)
    assert ran == ["triton"] and outs[0].shape == (2, 5, 4, 16)
    _check(outs, _exact(q, k, cos, sin, dq, dk, unsqueeze_dim=2), torch.bfloat16, "unsqueeze_dim=2")
    assert torch.equal(outs[0], rp.rope_ref(q, k, cos, sin, unsqueeze_dim=2)[0])


def test_position_ids_ignored_and_torch_broadcasts(ran):
    q, k, cos, sin, dq, dk = _inputs(2, 4, 2, 2, 8, torch.float32, seed=9)
    a = liger_rt.ops.rope(q, k, cos, sin, position_ids=torch.arange(4)[None])
    b = liger_rt.ops.rope(q, k, cos, sin)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and ran == ["triton", "triton"]
    # shapes the kernel does not take (a 4-D cos already unsqueezed by the caller) run HF's formula
    outs = liger_rt.ops.rope(q, k, cos[:, None], sin[:, None], unsqueeze_dim=0)
    assert ran[2:] == ["torch"]
    _check(outs, [r[None] for r in _exact(q, k, cos, sin, dq, dk)[:2]], torch.float32, "unsqueeze_dim=0")


def test_cos_requiring_grad_falls_back_to_autograd(ran):
    q, k, cos, sin, dq, dk = _inputs(2, 5, 4, 2, 16, torch.float32, seed=10)
    leaves = [t.clone().requires_grad_() for t in (q, k, cos, sin)]
    qe, ke = liger_rt.ops.rope(*leaves)
    grads = torch.autograd.grad((qe, ke), leaves, (dq, dk))
    assert ran == ["torch"]
    assert hf_rope.__module__.startswith("transformers")           # HF's own function, in fp64
    ref_leaves = [t.double().requires_grad_() for t in (q, k, cos, sin)]
    rq, rk = hf_rope(*ref_leaves)
    refs = torch.autograd.grad((rq, rk), ref_leaves, (dq.double(), dk.double()))
    for name, o, r in zip(("dq", "dk", "dcos", "dsin"), grads, refs):
        assert_close(o, r, torch.float32, reduce_len=2 * 6, name=name)   # dcos sums over batch and heads
    assert grads[2].abs().max() > 0.1


def test_head_dim_limits():
    q, k, cos, sin, _, _ = _inputs(1, 3, 2, 2, 7, torch.float32)
    cfg = rp.RoPEConfig()
    with pytest.raises(ValueError, match="head_dim must be even"):
        liger_rt.ops.rope(q, k, cos, sin)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rp.rope_fwd(q, k, cos, sin, 1, cfg)
    with pytest.raises(ValueError, match="takes \\(B, H, S, D\\)"):   # the launcher checks shapes too
        rp.rope_fwd(q, k[:, :, :2], cos, sin, 1, cfg)
    assert dispatch.select("rope", dtype="bf16", arch="cpu", **_dims(2, 2, 7, 3)).impl == "torch"
    # larger than the kernel's registers: dispatch says torch, the launcher refuses
    d = dispatch.select("rope", dtype="bf16", arch="cpu", **_dims(2, 2, 512, 3))
    assert d.impl == "torch"
    q, k, cos, sin, dq, dk = _inputs(1, 2, 2, 1, 512, torch.float32)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        rp.rope_fwd(q, k, cos, sin, 1, cfg)
    qe, _ = liger_rt.ops.rope(q, k, cos, sin)
    assert_close(qe, _exact(q, k, cos, sin, dq, dk)[0], torch.float32)


def test_fallback_and_interpreter_off_use_torch(fallback, monkeypatch, ran):
    q, k, cos, sin, _, _ = _inputs(2, 3, 4, 2, 16, torch.float32, seed=13)
    liger_rt.ops.rope(q, k, cos, sin)
    assert dispatch.decision(rp.OP, q, **_dims(4, 2, 16, 6)).reason == "LIGER_RT_DISABLE=1" and ran == ["torch"]
    monkeypatch.delenv("LIGER_RT_DISABLE")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # CPU tensors without the interpreter
    dispatch.reset()
    liger_rt.ops.rope(q, k, cos, sin)
    d = dispatch.decision(rp.OP, q, **_dims(4, 2, 16, 6))
    assert (d.impl, d.origin) == ("torch", "heuristic") and ran == ["torch", "torch"]


def test_other_dtypes_and_empty_use_torch(ran):
    q, k, cos, sin, dq, dk = _inputs(1, 3, 2, 2, 8, torch.float64, seed=14)
    qe, ke = liger_rt.ops.rope(q, k, cos, sin)
    assert qe.dtype == torch.float64
    torch.testing.assert_close([qe, ke], _exact(q, k, cos, sin, dq, dk)[:2])
    liger_rt.ops.rope(q.float(), k, cos.float(), sin.float())       # an fp64 k: torch too
    q, k, cos, sin, _, _ = _inputs(1, 0, 2, 2, 8, torch.float32)
    assert liger_rt.ops.rope(q, k, cos, sin)[0].shape == (1, 2, 0, 8)
    assert ran == ["torch"] * 3
    with pytest.raises(TypeError, match="accepted"):
        liger_rt.ops.rope(*(t.to(torch.int32) for t in _inputs(1, 3, 2, 2, 8, torch.float32)[:4]))


def test_backward_keeps_q_and_k_free():
    """HF's eager rope keeps only cos and sin for the backward, and so does the kernel:
    q and k, the projections' outputs, are freed after the forward."""
    q, k, cos, sin, _, _ = _inputs(2, 5, 4, 2, 16, torch.float32, seed=15)
    q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        liger_rt.ops.rope(q, k, cos, sin)
    assert saved and not {q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr()} & set(saved)
