"""cross_entropy through the Triton interpreter against the fp32 PyTorch reference."""
import pytest
import torch
import torch.nn.functional as F

import liger_rt
from liger_rt import backend, dispatch
from liger_rt.kernels import cross_entropy as ce
from liger_rt.kernels._common import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FEATURES = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "zloss": {"lse_square_scale": 1e-2},
    "softcap": {"softcap": 4.0},
    "all": {"label_smoothing": 0.2, "lse_square_scale": 1e-1, "softcap": 3.0},
}


def _case(rows, vocab, dtype, seed=0, ignore_frac=0.25, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < ignore_frac] = -100
    target[0] = min(1, vocab - 1)  # never all-ignored by accident
    return logits, target


def _dy(loss, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(loss.shape, generator=g) + 0.5   # != 1: exercises the backward scale


def _check(logits, target, reduction="mean", config=None, **kw):
    """Ours vs the fp32 reference on the same input values: loss and dlogits."""
    x = logits.clone().requires_grad_()
    if config is None:
        loss = ce.cross_entropy(x, target, reduction=reduction, **kw)
    else:
        loss = ce.CrossEntropyFunction.apply(x, target, -100, reduction, kw.get("label_smoothing", 0.0),
                                             kw.get("lse_square_scale", 0.0), kw.get("softcap"), None, False, config)
    dy = _dy(loss)
    (g,) = torch.autograd.grad(loss, x, dy)
    xr = logits.float().requires_grad_()
    ref = ce.cross_entropy_ref(xr, target, reduction=reduction, **kw)
    (gr,) = torch.autograd.grad(ref, xr, dy)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref, torch.float32, reduce_len=logits.shape[-1], name="loss")
    assert g.dtype == logits.dtype
    # the gradient is rounded once to the logits dtype (twice for "none": stored, then scaled)
    assert_close(g, gr.to(logits.dtype), logits.dtype, reduce_len=4 if reduction == "none" else 1, name="dlogits")
    return loss, g


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_matches_reference(dtype, reduction, feature):
    logits, target = _case(9, 199, dtype)
    _check(logits, target, reduction, **FEATURES[feature])


@pytest.mark.parametrize("vocab", [1, 7, 1000, 1151])
def test_odd_vocab_and_multi_block(vocab):
    # BLOCK_V 64: the online softmax runs over many blocks with a ragged tail
    logits, target = _case(5, vocab, torch.float32, scale=6.0)
    _check(logits, target, "sum", config={"BLOCK_V": 64, "num_warps": 4}, label_smoothing=0.1, softcap=10.0)
    _check(logits, target, "mean")


def test_single_row_and_leading_dims():
    logits, target = _case(1, 300, torch.bfloat16, ignore_frac=0.0)
    _check(logits, target, "mean", softcap=2.0)
    logits, target = _case(6, 160, torch.float32)
    x = logits.reshape(2, 3, 160).requires_grad_()
    loss = liger_rt.ops.cross_entropy(x, target.reshape(2, 3), reduction="none")
    assert loss.shape == (2, 3)
    ref = ce.cross_entropy_ref(logits, target, reduction="none")
    assert_close(loss.reshape(-1), ref, torch.float32)


def test_non_contiguous_logits():
    logits, target = _case(7, 2 * 211, torch.float32)
    view = logits[:, ::2]                          # stride 2 in the vocab dim: copied by the launcher
    assert not view.is_contiguous()
    _check(view, target.clamp(max=210), "sum", label_smoothing=0.05)
    tview = torch.randn(211, 7).t()               # a transposed view
    _check(tview, target.clamp(max=210), "mean")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_grads(reduction):
    logits, _ = _case(6, 199, torch.bfloat16)
    target = torch.full((6,), -100)
    x = logits.clone().requires_grad_()
    loss = ce.cross_entropy(x, target, reduction=reduction, lse_square_scale=1e-2, label_smoothing=0.1)
    (g,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    assert torch.isfinite(loss).all() and (loss == 0).all()
    assert torch.isfinite(g.float()).all() and (g == 0).all()
    ref = ce.cross_entropy_ref(logits, target, reduction=reduction)
    assert (ref == 0).all()


def test_ignore_index_rows_have_zero_grad_and_custom_ignore_index():
    logits, target = _case(8, 199, torch.float32, ignore_frac=0.0)
    target[[2, 5]] = 7
    x = logits.clone().requires_grad_()
    loss = ce.cross_entropy(x, target, ignore_index=7)
    (g,) = torch.autograd.grad(loss, x)
    assert (g[[2, 5]] == 0).all() and (g[[0, 1]] != 0).any()
    ref = F.cross_entropy(logits, target, ignore_index=7)
    assert_close(loss, ref, torch.float32)


def test_reference_is_pytorch_semantics():
    # the reference itself: PyTorch's mean/sum (with label smoothing and ignore_index) where defined
    logits, target = _case(10, 50, torch.float32)
    for red in ("mean", "sum"):
        got = ce.cross_entropy_ref(logits, target, reduction=red, label_smoothing=0.3)
        assert_close(got, F.cross_entropy(logits, target, reduction=red, label_smoothing=0.3), torch.float32)
    capped = ce.cross_entropy_ref(logits, target, softcap=2.0)
    assert_close(capped, F.cross_entropy(2.0 * torch.tanh(logits / 2.0), target), torch.float32)
    z = ce.cross_entropy_ref(logits, target, reduction="sum", lse_square_scale=0.5)
    valid = target != -100
    want = F.cross_entropy(logits, target, reduction="sum") + 0.5 * (torch.logsumexp(logits, -1)[valid] ** 2).sum()
    assert_close(z, want, torch.float32)


@pytest.mark.parametrize("n", [13, "tensor", 0])
def test_num_items_in_batch(n):
    logits, target = _case(9, 199, torch.float32)
    num = torch.tensor(13) if n == "tensor" else n
    x = logits.clone().requires_grad_()
    loss = ce.cross_entropy(x, target, reduction="sum", num_items_in_batch=num)
    (g,) = torch.autograd.grad(loss, x)
    xr = logits.clone().requires_grad_()
    denom = 13 if n != 0 else 1
    ref = F.cross_entropy(xr, target, reduction="sum") / denom
    (gr,) = torch.autograd.grad(ref, xr)
    assert_close(loss, ref, torch.float32)
    assert_close(g, gr, torch.float32)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        ce.cross_entropy(logits, target, reduction="none", num_items_in_batch=3)


def test_inplace_backward_overwrites_logits_only_when_safe():
    logits, target = _case(6, 199, torch.bfloat16)
    base = logits.float().requires_grad_()
    x = base.to(torch.bfloat16)                    # non-leaf: an lm_head output, say
    loss = ce.cross_entropy(x, target, inplace_backward=True, label_smoothing=0.1)
    dlogits = x.detach().clone()                   # the forward left the gradient in the buffer
    (g,) = torch.autograd.grad(loss, base)
    xr = logits.float().requires_grad_()
    (gr,) = torch.autograd.grad(ce.cross_entropy_ref(xr, target, label_smoothing=0.1), xr)
    assert_close(g, gr.to(torch.bfloat16).float(), torch.bfloat16)
    assert_close(dlogits.float(), gr.to(torch.bfloat16).float(), torch.bfloat16)
    # a leaf is never overwritten
    leaf = logits.clone().requires_grad_()
    ce.cross_entropy(leaf, target, inplace_backward=True).backward()
    assert torch.equal(leaf.detach(), logits)
    # the default keeps the values of a non-leaf too
    y = base.to(torch.bfloat16)
    ce.cross_entropy(y, target)
    assert torch.equal(y.detach(), logits)


def test_inplace_backward_raises_when_logits_are_saved_elsewhere():
    logits, target = _case(4, 64, torch.float32)
    base = logits.clone().requires_grad_()
    x = base * 1.0
    other = (x * x).sum()                           # mul saves x for its backward
    loss = ce.cross_entropy(x, target, inplace_backward=True)
    with pytest.raises(RuntimeError, match="inplace"):
        (loss + other).backward()


def test_no_grad_writes_nothing():
    logits, target = _case(5, 199, torch.float32)
    x = logits.clone().requires_grad_()
    y = x * 1.0
    with torch.no_grad():
        loss = ce.cross_entropy(y, target, inplace_backward=True)
    assert torch.equal(y, logits)
    assert_close(loss, ce.cross_entropy_ref(logits, target), torch.float32)


def test_double_backward_is_refused():
    logits, target = _case(4, 64, torch.float32)
    x = logits.clone().requires_grad_()
    loss = ce.cross_entropy(x, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()


def test_every_candidate_config_hopper_mi325x_cpu():
    # every (BLOCK_V, num_warps) the sweep may pick, each at a vocab where its block loops (1.5 blocks)
    seen, cases = set(), {}
    for name in ("hopper", "mi325x", "cpu"):
        arch = backend.profile(name)
        impl = ce.OP.impl("triton")
        cands = ce.OP.candidates(impl, arch, {"rows": 8192, "vocab": 151936}, torch.bfloat16)
        assert cands and all(c["num_warps"] <= arch.max_num_warps for c in cands)
        assert ce._heuristic(arch, {"rows": 8192, "vocab": 151936}, torch.bfloat16) in cands
        for cfg in cands:
            key = (cfg["BLOCK_V"], cfg["num_warps"])
            if key in seen:
                continue
            seen.add(key)
            block = cfg["BLOCK_V"]
            if block not in cases:
                cases[block] = _case(2, block + block // 2 + 3, torch.float32, ignore_frac=0.0)
            _check(*cases[block], "sum", config=cfg, softcap=30.0)
    assert len(seen) >= 8


def test_dispatch_override_and_heuristic(monkeypatch):
    logits, target = _case(6, 199, torch.float32)
    d = ce.OP.select(logits, rows=6, vocab=199)
    assert d.impl == "triton" and d.origin == "heuristic"
    monkeypatch.setenv("LIGER_RT_IMPL_CROSS_ENTROPY", "torch")
    dispatch.reset()
    d = ce.OP.select(logits, rows=6, vocab=199)
    assert d.impl == "torch" and d.origin == "env"
    x = logits.clone().requires_grad_()
    loss = liger_rt.ops.cross_entropy(x, target)
    assert loss.grad_fn is not None and "CrossEntropyFunction" not in type(loss.grad_fn).__name__
    assert_close(loss, ce.cross_entropy_ref(logits, target), torch.float32)


def test_tune_on_cpu_validates_every_candidate():
    from liger_rt import autotune
    target = dispatch.target_for_arch("cpu")
    res = autotune.tune(ce.OP, target, torch.float32, {"rows": 8, "vocab": 199}, quick=True)
    bad = [m for m in res["measurements"] if not m["ok"]]
    assert not bad, bad
    assert res["winner"] is not None


def test_plan_and_errors():
    cpu = backend.profile("cpu")
    assert all(p["rows"] <= 64 and p["vocab"] < 1000 for p in ce._plan(None, cpu, False))
    from liger_rt.tools.presets import get_preset
    plan = ce._plan(get_preset("qwen3-4b"), backend.profile("hopper"), True)
    assert plan == [{"rows": 4096, "vocab": 151936}]
    assert ce._plan(None, backend.profile("hopper"), True)
    logits, target = _case(4, 10, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        ce.cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="target"):
        ce.cross_entropy(logits, target[:3])
    with pytest.raises(ValueError, match="softcap"):
        ce.cross_entropy(logits, target, softcap=0.0)
