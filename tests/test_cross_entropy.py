"""cross_entropy through the Triton interpreter against an fp64 formula and the PyTorch loss."""
import pytest
import torch
import torch.nn.functional as F
from loss_checks import ce_fp64
from routing import record_impls

import liger_rt
from liger_rt import backend, dispatch
from liger_rt.autograd import call_impl
from liger_rt.config import ConfigError
from liger_rt.kernels import cross_entropy as ce
from liger_rt.numerics import assert_close

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


def _triton(config):
    def run(x, target, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0, softcap=None):
        return call_impl(ce.OP, "triton", config, x, target, -100, reduction, label_smoothing, lse_square_scale,
                               softcap, None, False)
    return run


def _check(logits, target, reduction="mean", config=None, **kw):
    """Ours vs the fp64 formula and the op's fp32 reference on the same input values: loss and dlogits."""
    x = logits.clone().requires_grad_()
    fn = ce.cross_entropy if config is None else _triton(config)
    loss = fn(x, target, reduction=reduction, **kw)
    dy = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1)) + 0.5   # != 1: the scale runs
    (g,) = torch.autograd.grad(loss, x, dy)
    x64 = logits.double().requires_grad_()
    want = ce_fp64(x64, target, reduction=reduction, **kw)
    (g64,) = torch.autograd.grad(want, x64, dy.double())
    xr = logits.float().requires_grad_()
    ref = ce.cross_entropy_ref(xr, target, reduction=reduction, **kw)
    (gr,) = torch.autograd.grad(ref, xr, dy)
    assert loss.dtype == torch.float32 and loss.shape == want.shape and g.dtype == logits.dtype
    for name, w in (("fp64", want), ("ref", ref)):
        assert_close(loss, w, torch.float32, reduce_len=logits.shape[-1], name=f"loss vs {name}")
    for name, w in (("fp64", g64), ("ref", gr)):   # the gradient is rounded once to the logits dtype
        assert_close(g, w.to(logits.dtype), logits.dtype, reduce_len=4, name=f"dlogits vs {name}")
    return loss, g


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_matches_fp64_formula(reduction, feature):
    _check(*_case(9, 199, torch.float32), reduction, **FEATURES[feature])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_half_dtypes(dtype, reduction):
    _check(*_case(9, 199, dtype), reduction, **FEATURES["all"])


@pytest.mark.parametrize("vocab", [1, 7, 1151])
def test_odd_vocab_and_multi_block(vocab):
    # BLOCK_V 64: the online softmax runs over many blocks with a ragged tail
    logits, target = _case(5, vocab, torch.float32, scale=6.0)
    _check(logits, target, "sum", config=ce.CrossEntropyConfig(BLOCK_V=64, num_warps=4), label_smoothing=0.1,
           softcap=10.0)
    _check(logits, target, "mean")


def test_single_row_leading_dims_and_non_contiguous():
    logits, target = _case(1, 300, torch.bfloat16, ignore_frac=0.0)
    _check(logits, target, "mean", softcap=2.0)
    logits, target = _case(6, 160, torch.float32)
    loss = liger_rt.ops.cross_entropy(logits.reshape(2, 3, 160), target.reshape(2, 3), reduction="none")
    assert loss.shape == (2, 3)
    assert_close(loss.reshape(-1), ce_fp64(logits, target, reduction="none"), torch.float32)
    logits, target = _case(7, 2 * 211, torch.float32)
    view = logits[:, ::2]                          # stride 2 in the vocab dim: copied by the functional
    assert not view.is_contiguous()
    _check(view, target.clamp(max=210), "sum", label_smoothing=0.05)
    _check(torch.randn(211, 7).t(), target.clamp(max=210), "mean")    # a transposed view


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_grads(reduction):
    logits, _ = _case(6, 199, torch.bfloat16)
    target = torch.full((6,), -100)
    x = logits.clone().requires_grad_()
    loss = ce.cross_entropy(x, target, reduction=reduction, lse_square_scale=1e-2, label_smoothing=0.1)
    (g,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    assert torch.isfinite(loss).all() and (loss == 0).all()
    assert torch.isfinite(g.float()).all() and (g == 0).all()


def test_custom_ignore_index_against_pytorch():
    logits, target = _case(8, 199, torch.float32, ignore_frac=0.0)
    target[[2, 5]] = 7
    x, xr = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = ce.cross_entropy(x, target, ignore_index=7)
    (g,) = torch.autograd.grad(loss, x)
    ref = F.cross_entropy(xr, target, ignore_index=7)
    (gr,) = torch.autograd.grad(ref, xr)
    assert (g[[2, 5]] == 0).all() and (g[[0, 1]] != 0).any()
    assert_close(loss, ref, torch.float32)
    assert_close(g, gr, torch.float32)


def test_reference_is_pytorch_semantics():
    # the reference itself: PyTorch's mean/sum (with label smoothing and ignore_index) where defined
    logits, target = _case(10, 50, torch.float32)
    for red in ("mean", "sum"):
        got = ce.cross_entropy_ref(logits, target, reduction=red, label_smoothing=0.3)
        assert_close(got, F.cross_entropy(logits, target, reduction=red, label_smoothing=0.3), torch.float32)
        assert_close(got, ce_fp64(logits, target, reduction=red, label_smoothing=0.3), torch.float32)
    capped = ce.cross_entropy_ref(logits, target, softcap=2.0, lse_square_scale=0.5)
    assert_close(capped, ce_fp64(logits, target, softcap=2.0, lse_square_scale=0.5), torch.float32)


@pytest.mark.parametrize("n", [13, "tensor", 0])
def test_num_items_in_batch(n):
    logits, target = _case(9, 199, torch.float32)
    num = torch.tensor(13) if n == "tensor" else n
    x, xr = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = ce.cross_entropy(x, target, reduction="sum", num_items_in_batch=num)
    (g,) = torch.autograd.grad(loss, x)
    ref = F.cross_entropy(xr, target, reduction="sum") / (13 if n != 0 else 1)
    (gr,) = torch.autograd.grad(ref, xr)
    assert_close(loss, ref, torch.float32)
    assert_close(g, gr, torch.float32)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        ce.cross_entropy(logits, target, reduction="none", num_items_in_batch=3)


def test_out_of_range_targets_give_nan_never_a_finite_loss():
    logits, target = _case(6, 50, torch.float32, ignore_frac=0.0)
    bad = target.clone()
    bad[2], bad[4] = 50, -1                     # >= vocab, and negative but not ignore_index
    x = logits.clone().requires_grad_()
    rows = ce.cross_entropy(x, bad, reduction="none")
    (g,) = torch.autograd.grad(rows.nansum(), x)
    assert rows[[2, 4]].isnan().all() and g[[2, 4]].isnan().all()
    ok = [0, 1, 3, 5]                          # the other rows are untouched
    assert_close(rows[ok], ce_fp64(logits[ok], target[ok], reduction="none"), torch.float32)
    assert torch.isfinite(g[ok]).all()
    for red in ("mean", "sum"):
        assert ce.cross_entropy(logits, bad, reduction=red).isnan()
    torch_rows = call_impl(ce.OP, "torch", None, logits, bad, -100, "none", 0.0, 0.0, None, None, False)
    assert torch.equal(torch_rows.isnan(), rows.isnan())    # the torch implementation gives the same NaN rows


def test_inplace_backward_writes_the_gradient_over_the_logits_only_when_safe():
    logits, target = _case(6, 199, torch.bfloat16)
    base = logits.float().requires_grad_()
    x = base.to(torch.bfloat16)                    # non-leaf: an lm_head output, say
    loss = ce.cross_entropy(x, target, inplace_backward=True, label_smoothing=0.1)
    assert torch.equal(x.detach(), logits)         # the forward writes nothing
    (g,) = torch.autograd.grad(loss, base)
    x64 = logits.double().requires_grad_()
    (g64,) = torch.autograd.grad(ce_fp64(x64, target, label_smoothing=0.1), x64)
    want = g64.to(torch.bfloat16).float()
    assert_close(g, want, torch.bfloat16)
    assert_close(x.detach().float(), want, torch.bfloat16)     # the buffer now holds the gradient
    leaf = logits.clone().requires_grad_()                     # a leaf is never overwritten
    ce.cross_entropy(leaf, target, inplace_backward=True).backward()
    assert torch.equal(leaf.detach(), logits)
    y = base.to(torch.bfloat16)                                # the default keeps a non-leaf's values
    ce.cross_entropy(y, target).backward()
    assert torch.equal(y.detach(), logits)


def test_inplace_backward_raises_when_logits_are_saved_elsewhere():
    logits, target = _case(4, 64, torch.float32)
    x = logits.clone().requires_grad_() * 1.0
    other = (x * x).sum()                           # mul saves x for its backward, which runs after ours
    loss = ce.cross_entropy(x, target, inplace_backward=True)
    with pytest.raises(RuntimeError, match="inplace"):
        (loss + other).backward()


def test_no_grad_writes_nothing():
    logits, target = _case(5, 199, torch.float32)
    y = logits.clone().requires_grad_() * 1.0
    with torch.no_grad():
        loss = ce.cross_entropy(y, target, inplace_backward=True)
    assert torch.equal(y, logits) and loss.grad_fn is None
    assert_close(loss, ce_fp64(logits, target), torch.float32)


def test_second_backward_works_unless_in_place():
    logits, target = _case(4, 64, torch.float32)
    x = logits.clone().requires_grad_()
    loss = ce.cross_entropy(x, target)
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, x)
    assert torch.equal(g1, g2)
    y = logits.clone().requires_grad_() * 1.0
    loss = ce.cross_entropy(y, target, inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_block_v_must_be_a_power_of_two():
    with pytest.raises(ConfigError, match="BLOCK_V"):
        ce.CrossEntropyConfig(BLOCK_V=100)


@pytest.mark.parametrize("impl", ["triton", "torch", "fuse"])
def test_torch_compile_fullgraph(monkeypatch, impl):
    """A custom op under torch.compile (zero graph breaks), and inplace_backward never mutates there;
    LIGER_RT_COMPILE_POLICY=fuse leaves it on its kernel (it is not an op the compiler fuses)."""
    if impl == "torch":
        monkeypatch.setenv("LIGER_RT_IMPL_CROSS_ENTROPY", "torch")
    if impl == "fuse":
        monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", "fuse")
    dispatch.reset()
    ran = record_impls(monkeypatch, ce.OP)
    torch._dynamo.reset()
    kw = {"label_smoothing": 0.1, "softcap": 5.0}

    def f(h, y):
        logits = h * 2.0
        return ce.cross_entropy(logits, y, inplace_backward=True, **kw), logits

    fc = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (3, 5):    # a second bucket recompiles with its own decision
        logits, target = _case(rows, 40, torch.float32, seed=rows)
        h = logits.clone().requires_grad_()
        loss, out = fc(h, target)
        (g,) = torch.autograd.grad(loss, h)
        assert torch.equal(out, logits * 2.0)      # eager would have written the gradient there
        h64 = logits.double().requires_grad_()
        (g64,) = torch.autograd.grad(ce_fp64(h64 * 2.0, target, **kw), h64)
        assert_close(loss, ce_fp64(logits * 2.0, target, **kw), torch.float32)
        assert_close(g, g64, torch.float32)
    want = "triton" if impl == "fuse" else impl
    assert ran == [want, want]


def test_plan_and_errors():
    cpu = backend.profile("cpu")
    assert all(p["rows"] <= 64 and p["vocab"] < 1000 for p in ce._plan(None, cpu, False))
    from liger_rt.tools.presets import get_preset
    assert ce._plan(get_preset("qwen3-4b"), backend.profile("hopper"), True) == [{"rows": 4096, "vocab": 151936}]
    logits, target = _case(4, 10, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        ce.cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="target"):
        ce.cross_entropy(logits, target[:3])
    with pytest.raises(ValueError, match="softcap"):
        ce.cross_entropy(logits, target, softcap=0.0)
    with pytest.raises(TypeError, match="integer class ids"):
        ce.cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match="move the target"):
        ce.cross_entropy(logits, target.to("meta"))
    with pytest.raises(TypeError, match="unsupported dtype"):
        ce.cross_entropy(logits.long(), target)
