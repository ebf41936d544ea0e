"""fused_linear_cross_entropy through the Triton interpreter against an fp64 formula, the PyTorch
loss in the same dtype and Hugging Face's ForCausalLMLoss."""
import pytest
import torch
import torch.nn.functional as F
from loss_checks import flce_fp64, fwd_bwd
from routing import record_impls

import liger_rt
from liger_rt import backend, dispatch
from liger_rt.autograd import call_impl
from liger_rt.kernels import fused_linear_cross_entropy as flce
from liger_rt.numerics import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
# relative RMSE against the fp64 loss: rounding the logits and dlogits to the dtype is all that may
# differ; a wrong mask or a missing chunk gives O(1)
REL_RMSE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
CFG = flce.FusedLinearCrossEntropyConfig


def _case(tokens, hidden, vocab, dtype, *, bias=False, seed=0, ignore_frac=0.25, lead=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (2.0 / hidden ** 0.5)
    b = torch.randn(vocab, generator=g) if bias else None
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[torch.rand(tokens, generator=g) < ignore_frac] = -100
    y[0] = 1
    if lead is not None:
        x, y = x.reshape(*lead, hidden), y.reshape(lead)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(x), cast(w), cast(b), y


def _rel_rmse(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _triton(config, grads=3):
    def run(x, w, y, b=None, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0, softcap=None,
            num_items_in_batch=None):
        return call_impl(flce.OP, "triton", config, x, w, y, b, -100, reduction, label_smoothing, lse_square_scale,
                                 softcap, num_items_in_batch, grads | (4 if b is not None else 0), True)
    return run


def _check(x, w, b, y, config=None, **kw):
    """Ours vs the torch implementation in the same dtype (tight) and vs the fp64 formula (rel. RMSE)."""
    dtype, tokens = x.dtype, y.numel()
    outs = []
    for fn in (liger_rt.ops.fused_linear_cross_entropy if config is None else _triton(config),
               flce.fused_linear_cross_entropy_ref, flce_fp64):
        outs.append(fwd_bwd(lambda x_, w_, b_, fn=fn, **k: fn(x_, w_, y, b_, **k), (x, w, b), **kw))
    (loss, grads), (ref_loss, ref_grads), (exact_loss, exact_grads) = outs
    assert loss.dtype == torch.float32 and loss.shape == exact_loss.shape
    assert_close(loss, ref_loss, torch.float32 if dtype == torch.float32 else dtype, reduce_len=tokens, name="loss")
    assert _rel_rmse(loss, exact_loss) < REL_RMSE[dtype]
    for name, g, r, e in zip(("dx", "dw", "db"), grads, ref_grads, exact_grads):
        assert g.dtype == dtype and g.shape == r.shape
        assert_close(g, r, dtype, reduce_len=tokens, name=name)
        assert _rel_rmse(g, e) < REL_RMSE[dtype], (name, _rel_rmse(g, e))
    return loss, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_reference(dtype, reduction):
    # 18 tokens with the cpu heuristic's chunk of 4 (fp32) / 8 (16-bit): a ragged last chunk
    x, w, b, y = _case(18, 24, 199, dtype, bias=True)
    d = dispatch.decision(flce.OP, x, tokens=18, hidden=24, vocab=199)
    assert 0 < d.config.chunk < 18 and 18 % d.config.chunk != 0
    _check(x, w, b, y, reduction=reduction)


@pytest.mark.parametrize("feature", [{"label_smoothing": 0.1}, {"lse_square_scale": 1e-2}, {"softcap": 3.0},
                                     {"label_smoothing": 0.2, "lse_square_scale": 0.1, "softcap": 2.0}],
                         ids=["smoothing", "zloss", "softcap", "all"])
def test_features(feature):
    x, w, b, y = _case(10, 16, 1000, torch.float32)
    _check(x, w, b, y, reduction="mean", **feature)


@pytest.mark.parametrize("chunk", [1, 7, 0])
def test_chunk_sizes_that_do_not_divide(chunk):
    x, w, b, y = _case(17, 16, 211, torch.float32, bias=True)
    _check(x, w, b, y, config=CFG(chunk=chunk, BLOCK_V=64, num_warps=4), reduction="sum", label_smoothing=0.1)


def test_leading_dims_and_single_token():
    x, w, b, y = _case(12, 16, 160, torch.bfloat16, lead=(3, 4))
    loss, (gx, gw) = _check(x, w, b, y, reduction="none")
    assert loss.shape == (3, 4) and gx.shape == (3, 4, 16)
    x, w, b, y = _case(1, 8, 300, torch.float32, ignore_frac=0.0)
    _check(x, w, b, y, reduction="mean")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_all_ignored(reduction):
    x, w, b, y = _case(9, 16, 199, torch.bfloat16, bias=True)
    ins = [t.clone().requires_grad_() for t in (x, w, b)]
    loss = liger_rt.ops.fused_linear_cross_entropy(ins[0], ins[1], torch.full_like(y, -100), ins[2],
                                                   reduction=reduction, lse_square_scale=1e-2)
    grads = torch.autograd.grad(loss, ins, torch.ones_like(loss))
    assert torch.isfinite(loss).all() and (loss == 0).all()
    assert all(torch.isfinite(g.float()).all() and (g == 0).all() for g in grads)


def test_out_of_range_targets_give_nan():
    x, w, _, y = _case(6, 8, 50, torch.float32, ignore_frac=0.0)
    y[3] = 50
    for reduction in ("mean", "none"):
        loss, (gx, gw) = fwd_bwd(liger_rt.ops.fused_linear_cross_entropy, (x, w), y, reduction=reduction)
        assert loss.isnan().any() and gx[3].isnan().all() and gw.isnan().any()
    rows = liger_rt.ops.fused_linear_cross_entropy(x, w, y, reduction="none")
    ok = [0, 1, 2, 4, 5]
    assert rows[3].isnan() and torch.isfinite(rows[ok]).all()
    assert_close(rows[ok], flce_fp64(x[ok], w, y[ok], reduction="none"), torch.float32)


def test_fp16_small_gradients_do_not_underflow():
    # mean over a large count: p / n sits below fp16's normal range, so the dlogits are stored
    # unscaled and dX/dW scaled afterwards (scaling in-kernel would give ~3.5x the dX error here)
    x, w, _, y = _case(16, 16, 199, torch.float16)
    kw = {"num_items_in_batch": 100000}
    _, (gx, gw) = fwd_bwd(liger_rt.ops.fused_linear_cross_entropy, (x, w * 4), y, **kw)
    _, (fx, fw) = fwd_bwd(lambda a, b, **k: flce_fp64(a, b, y, **k), (x, w * 4), **kw)
    assert _rel_rmse(gx, fx) < 2e-3 and _rel_rmse(gw, fw) < 4.5e-3


def test_tied_weights_accumulate():
    # the lm_head weight is also the input embedding: both gradients must land in one .grad
    g = torch.Generator().manual_seed(3)
    vocab, hidden, tokens = 199, 16, 14
    emb0 = torch.randn(vocab, hidden, generator=g) * 0.5
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    proj0 = torch.randn(hidden, hidden, generator=g) * 0.3
    labels = torch.roll(ids, -1)
    labels[-1] = -100

    def run(fn, dtype):
        emb = emb0.to(dtype, copy=True).requires_grad_()
        proj = proj0.to(dtype, copy=True).requires_grad_()
        loss = fn(torch.tanh(F.embedding(ids, emb) @ proj), emb, labels)
        loss.backward()
        return loss, emb.grad, proj.grad

    ours = run(liger_rt.ops.fused_linear_cross_entropy, torch.float32)
    exact = run(flce_fp64, torch.float64)
    for a, r in zip(ours, exact):
        assert_close(a, r, torch.float32, reduce_len=tokens)
    assert ours[1][ids].abs().sum() > 0


def test_hf_causal_lm_loss_mapping():
    from transformers.loss.loss_utils import ForCausalLMLoss
    x, w, _, labels = _case(2 * 9, 16, 199, torch.float32, lead=(2, 9), ignore_frac=0.2)
    for num_items in (None, torch.tensor(11), 11):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = ForCausalLMLoss(xr @ wr.t(), labels, vocab_size=199, num_items_in_batch=num_items)
        ref.backward()
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = liger_rt.ops.fused_linear_cross_entropy(xo, wo, shifted, num_items_in_batch=num_items)
        loss.backward()
        assert_close(loss, ref, torch.float32)
        assert_close(xo.grad, xr.grad, torch.float32)
        assert_close(wo.grad, wr.grad, torch.float32, reduce_len=18)


@pytest.mark.parametrize("which", ["x", "w", "none"])
def test_partial_requires_grad_and_no_grad(monkeypatch, which):
    x, w, b, y = _case(10, 16, 199, torch.float32)
    xg, wg = x.clone().requires_grad_(which == "x"), w.clone().requires_grad_(which == "w")
    masks = []
    real = flce._stored
    monkeypatch.setattr(flce, "_stored", lambda grads, *a: masks.append(grads) or real(grads, *a))
    loss = liger_rt.ops.fused_linear_cross_entropy(xg, wg, y)
    assert masks[0] == {"x": 1, "w": 2, "none": 0}[which]     # the forward computes only what is asked
    assert_close(loss, flce_fp64(x, w, y), torch.float32)
    if which == "none":
        assert loss.grad_fn is None
        return
    loss.backward()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    flce_fp64(x64, w64, y).backward()
    got, want = (xg.grad, x64.grad) if which == "x" else (wg.grad, w64.grad)
    assert_close(got, want, torch.float32, reduce_len=10)
    assert (wg.grad if which == "x" else xg.grad) is None
    with torch.no_grad():
        l2 = liger_rt.ops.fused_linear_cross_entropy(xg, wg, y)
    assert l2.grad_fn is None and torch.equal(l2, loss.detach()) and masks[-1] == 0


def test_weight_in_another_dtype():
    # fp32 master weight with bf16 activations: the weight is cast differentiably, its grad is fp32
    x, w, _, y = _case(10, 16, 199, torch.bfloat16)
    w32 = w.float().requires_grad_()
    xg = x.clone().requires_grad_()
    liger_rt.ops.fused_linear_cross_entropy(xg, w32, y, reduction="sum").backward()
    wr = w.float().requires_grad_()
    flce.fused_linear_cross_entropy_ref(x.clone(), wr.to(torch.bfloat16), y, reduction="sum").backward()
    assert w32.grad.dtype == torch.float32
    assert_close(w32.grad, wr.grad, torch.bfloat16, reduce_len=10)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_under_autocast(reduction):
    # fp32 params and activations under bf16 autocast: the lm_head GEMM runs in bf16, as F.linear would
    x, w, _, y = _case(10, 16, 199, torch.float32)
    outs = []
    for fn in (liger_rt.ops.fused_linear_cross_entropy, flce.fused_linear_cross_entropy_ref):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(xg, wg, y, reduction=reduction)
            (loss.sum() if reduction == "none" else loss).backward()
        outs.append((loss, xg.grad, wg.grad))
    for a, r in zip(*outs):
        assert a.dtype == r.dtype
        assert_close(a, r, torch.bfloat16, reduce_len=10)


def test_second_backward_raises():
    # the gradients computed in forward are scaled in place and handed out once
    x, w, _, y = _case(6, 8, 64, torch.float32)
    loss = liger_rt.ops.fused_linear_cross_entropy(x.clone().requires_grad_(), w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


GB = 1e9


def test_memory_budget_mi325x_and_hopper(no_shipped_defaults):
    mib128 = 128 * 2 ** 20
    for name in ("mi325x", "mi300x", "mi355x"):
        d = dispatch.select("fused_linear_cross_entropy", arch=name, dtype="bf16",
                            tokens=8192, hidden=2560, vocab=151936)
        assert d.origin == "heuristic" and d.impl == "triton"
        assert 256 <= d.config.chunk and d.config.chunk * 151936 * 2 <= mib128, d.config
        for cfg in flce.OP.candidates_for(flce.OP.impl("triton"), backend.profile(name),
                                          {"tokens": 8192, "hidden": 2560, "vocab": 151936}, torch.bfloat16):
            assert cfg.chunk * 151936 * 2 <= mib128
    # hopper: its budget (1024-row chunks at V151936, what the step-time measurement chose), and the peak beyond
    # the inputs (dW + dX + one chunk of logits) under 1.15 GB and 0.65 GB (torch.compile's: 3.31 and 1.38 GB)
    hopper = backend.profile("hopper")
    assert flce._heuristic(hopper, {"tokens": 8192, "hidden": 2560, "vocab": 151936}, torch.bfloat16).chunk == 1024
    for (h, v, target_gb) in ((2048, 65536, 0.65), (2560, 151936, 1.15)):
        chunk = flce._heuristic(hopper, {"tokens": 8192, "hidden": h, "vocab": v}, torch.bfloat16).chunk
        assert chunk >= 256 and chunk * v * 2 <= flce.logits_budget(hopper)
        extra = (v * h + 8192 * h + chunk * v) * 2
        assert extra <= target_gb * GB, (h, v, chunk, extra / GB)
    # a huge vocab keeps the floor; few tokens use one chunk ("all"); fp32 logits take half the rows
    assert flce._heuristic(hopper, {"tokens": 8192, "hidden": 4096, "vocab": 2 ** 20}, torch.bfloat16).chunk == 256
    assert flce._heuristic(hopper, {"tokens": 64, "hidden": 2048, "vocab": 65536}, torch.bfloat16).chunk == 0
    dims = {"tokens": 8192, "hidden": 2048, "vocab": 65536}
    c16, c32 = (flce._heuristic(hopper, dims, dt).chunk for dt in (torch.bfloat16, torch.float32))
    assert c32 * 2 <= c16


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph(monkeypatch, reduction):
    """A custom op under torch.compile (zero graph breaks), gradients (random grad_output) as the
    fp64 formula's. "mean" scales the gradients computed in forward with torch ops in the backward
    graph (no backward op, so inductor may reuse their buffers); "none" recomputes in the op."""
    from torch._dynamo.backends.common import aot_autograd
    ran = record_impls(monkeypatch, flce.OP)
    torch._dynamo.reset()
    x, w, b, y = _case(8, 16, 199, torch.float32, bias=True)
    graphs = []

    def keep(gm, _):
        graphs.append(str(gm.graph))
        return gm.forward

    def f(x_, w_, b_):
        return flce.fused_linear_cross_entropy(torch.tanh(x_) * 2, w_, y, b_, reduction=reduction, softcap=5.0)

    fc = torch.compile(f, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    got, grads = fwd_bwd(fc, (x, w, b))
    assert len(graphs) == 2 and "fused_linear_cross_entropy_fwd" in graphs[0]
    assert ("fused_linear_cross_entropy_bwd" in graphs[1]) == (reduction == "none"), graphs[1]
    want, exact = fwd_bwd(lambda x_, w_, b_: flce_fp64(torch.tanh(x_) * 2, w_, y, b_, reduction=reduction,
                                                       softcap=5.0), (x, w, b))
    assert ran == ["triton"]
    for a, e in zip((got, *grads), (want, *exact)):
        assert_close(a, e, torch.float32, reduce_len=8)


def test_plan_and_errors():
    from liger_rt.tools.presets import get_preset
    cpu = backend.profile("cpu")
    assert flce._plan(None, cpu, True) == [{"tokens": 16, "hidden": 32, "vocab": 199}]
    tiny = get_preset("qwen3-4b-tiny")
    assert flce._plan(tiny, cpu, False) == [{"tokens": 16, "hidden": 80, "vocab": 199},
                                           {"tokens": 64, "hidden": 80, "vocab": 199}]
    plan = flce._plan(get_preset("qwen3-4b"), backend.profile("hopper"), False)
    assert {"tokens": 16384, "hidden": 2560, "vocab": 151936} in plan
    assert {"tokens": 8192, "hidden": 2560, "vocab": 151936} in flce._plan(None, backend.profile("mi325x"), True)
    x, w, _, y = _case(4, 8, 10, torch.float32)
    with pytest.raises(ValueError, match="shift labels"):
        liger_rt.ops.fused_linear_cross_entropy(x, w, y[:3])
    with pytest.raises(ValueError, match="vocab, hidden"):
        liger_rt.ops.fused_linear_cross_entropy(x, w.t(), y)
    with pytest.raises(ValueError, match="reduction"):
        liger_rt.ops.fused_linear_cross_entropy(x, w, y, reduction="avg")
    with pytest.raises(TypeError, match="integer class ids"):
        liger_rt.ops.fused_linear_cross_entropy(x, w, y.float())
