"""moe_router (LFM2-MoE sigmoid top-k routing) through the Triton interpreter: tiny shapes."""
import pytest
import torch

from liger_rt import backend, dispatch
from liger_rt.autograd import call_impl
from liger_rt.kernels import moe_router as mr
from liger_rt.numerics import assert_close
from routing import record_impls

CFG = mr.MoERouterConfig(BLOCK_T=16, num_warps=1)


def _triton(logits, k, bias=None, norm=True, scale=1.0, config=CFG):
    return call_impl(mr.OP, "triton", config, logits, k, bias, norm, scale)


def _formula(logits, k, bias, norm, scale, idx, dw):
    """Independent check, HF's formula: the chosen experts carry the k largest routing scores
    (sigmoid in the logits dtype, + bias in torch's promotion), and the weights and d(logits) for
    them in fp64."""
    route = torch.sigmoid(logits.detach())
    route = (route + bias if bias is not None else route).float()
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all(), "an expert chosen twice"
    assert torch.equal(torch.gather(route, -1, idx), torch.topk(route, k, dim=-1).values)
    x = logits.detach().double().requires_grad_()
    w = torch.gather(torch.sigmoid(x), -1, idx)
    w = (w / (w.sum(-1, keepdim=True) + 1e-6) if norm else w) * scale
    return w, torch.autograd.grad(w, x, dw.double())[0]


def _run(fn, logits, k, bias, norm, scale, dw):
    x = logits.detach().clone().requires_grad_()
    w, idx = fn(x, k, bias, norm, scale)
    (dl,) = torch.autograd.grad(w, x, dw)
    return w, idx, dl


def _check(logits, k, bias=None, norm=True, scale=1.0, fn=_triton, seed=0):
    dtype = logits.dtype
    dw = torch.randn(logits.shape[0], k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    w, idx, dl = _run(fn, logits, k, bias, norm, scale, dw)
    wr, ir, dlr = _run(mr.moe_router_ref, logits, k, bias, norm, scale, dw)
    assert idx.dtype == torch.int64 and w.dtype == dtype and dl.dtype == dtype
    assert torch.equal(idx, ir), (idx != ir).nonzero()[:5]
    assert_close(w, wr, dtype, reduce_len=k, name="weights")
    assert_close(dl, dlr, dtype, reduce_len=k, name="dlogits")
    w64, dl64 = _formula(logits, k, bias, norm, scale, idx, dw)
    assert_close(w, w64, dtype, reduce_len=k, name="weights (fp64 formula)")
    assert_close(dl, dl64, dtype, reduce_len=k, name="dlogits (fp64 formula)")
    # off the selected experts the gradient is exactly zero, on them it is not (random dw)
    sel = torch.zeros_like(dl, dtype=torch.bool).scatter_(1, idx, True)
    assert (dl[~sel] == 0).all() and (dl[sel] != 0).float().mean() > 0.9
    return w, idx, dl


def _logits(T, E, dtype=torch.float32, seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)).mul(2).to(dtype)


@pytest.mark.parametrize("E,k,bias,norm,scale", [
    (32, 4, True, True, 1.0), (32, 4, False, False, 2.5), (67, 8, True, False, 1.0), (67, 8, False, True, 0.7),
    (8, 1, True, True, 1.0), (8, 1, False, False, 2.5), (256, 4, True, False, 1.3), (256, 4, False, True, 1.0)])
def test_matches_reference(E, k, bias, norm, scale):
    logits = _logits(37, E, seed=E)
    eb = 0.3 * torch.randn(E, generator=torch.Generator().manual_seed(1)) if bias else None
    _check(logits, k, eb, norm, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_through_dispatch(dtype):
    logits = _logits(45, 32, dtype)
    eb = 0.1 * torch.randn(32)
    w, idx, _ = _check(logits, 4, eb, True, 2.0, fn=mr.moe_router)
    # the scores are rounded to the logits dtype before selection, as HF's sigmoid is
    route = torch.sigmoid(logits.float()).to(dtype).float() + eb
    assert torch.equal(idx, torch.sort(route, dim=-1, descending=True, stable=True).indices[:, :4])


def test_ties_lower_index_wins():
    # integer logits in {0,1,2}: every row is full of exact ties
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 3, (40, 16), generator=g).float()
    w, idx, _ = _check(logits, 4, None, True, 1.0)
    for r in range(logits.shape[0]):
        expect = sorted(range(16), key=lambda e: (-logits[r, e].item(), e))[:4]
        assert idx[r].tolist() == expect
    # torch.topk selects the same values (its choice among equal values is unspecified on CPU)
    vals = torch.topk(torch.sigmoid(logits), 4).values
    assert torch.equal(torch.gather(torch.sigmoid(logits), 1, idx), vals)


def test_ties_made_by_expert_bias():
    # equal logits per row: only the bias orders experts, and it repeats values (ties in score+bias)
    logits = torch.full((20, 8), 0.25) + torch.arange(20).float()[:, None] * 0.01
    eb = torch.tensor([0.1, 0.3, 0.3, 0.0, 0.3, 0.1, 0.0, 0.2])
    w, idx, _ = _check(logits, 3, eb, True, 1.0)
    assert (idx == torch.tensor([1, 2, 4])).all()
    # weights come from the unbiased scores: all equal here, so 1/3 each after normalisation
    s = torch.sigmoid(logits[:, :1])
    assert_close(w, (s / (3 * s + 1e-6)).expand_as(w), torch.float32)


def test_bf16_rounding_creates_ties_like_hf():
    # distinct fp32 logits whose bf16 sigmoids collide: HF selects on the rounded scores
    base = torch.linspace(1.0, 1.02, 8)
    logits = base.repeat(6, 1).to(torch.bfloat16)
    scores = torch.sigmoid(logits)
    assert scores.unique().numel() < 8      # really tied after rounding
    _, idx, _ = _check(logits, 3)
    expect = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[:, :3]
    assert torch.equal(idx, expect)


def test_bias_dtype_promotion():
    # bf16 scores + bf16 bias sum in bf16 (rounded), with an fp32 bias in fp32: both as torch
    logits = _logits(33, 16, torch.bfloat16, seed=3)
    for eb in (0.2 * torch.randn(16), (0.2 * torch.randn(16)).bfloat16()):
        _, idx, _ = _check(logits, 4, eb)
        route = torch.sigmoid(logits) + eb        # torch's own promotion
        assert torch.equal(idx, torch.sort(route.float(), dim=-1, descending=True, stable=True).indices[:, :4])


def test_epsilon_guard_with_tiny_scores():
    # sigmoid(-14) ~ 8e-7: the 1e-6 in (sum + 1e-6) changes the weights by ~30%, so it must be there
    logits = -14.0 + 0.3 * _logits(21, 16, seed=9)
    w, _, _ = _check(logits, 4, None, True, 1.0)
    assert float(w.detach().sum(-1).max()) < 0.95


def test_leading_dims_and_validation():
    logits = _logits(12, 8).reshape(3, 4, 8)
    w, idx = mr.moe_router(logits, 2)
    wr, ir = mr.moe_router_ref(logits.reshape(-1, 8), 2)
    assert w.shape == (3, 4, 2) and torch.equal(idx.reshape(-1, 2), ir)
    assert_close(w.reshape(-1, 2), wr, torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        mr.moe_router(logits, 9)
    with pytest.raises(ValueError, match="expert_bias"):
        mr.moe_router(logits, 2, torch.zeros(7))
    for k in (1.7, 2.0, True, "2", torch.tensor(2.0)):    # never truncated to an int
        with pytest.raises(TypeError, match="top_k must be an integer"):
            mr.moe_router(logits, k)
    with pytest.raises(TypeError, match="accepted: torch.float32"):
        mr.moe_router(logits.long(), 2)


@pytest.mark.parametrize("E,k,bias,norm,scale,dtype", [
    (32, 4, True, True, 1.0, torch.float32), (67, 8, False, False, 2.5, torch.float32),
    (32, 4, True, True, 1.0, torch.bfloat16), (16, 3, True, False, 1.3, torch.float16),
    (8, 1, False, False, 1.0, torch.bfloat16)])
def test_eager_is_hf_formula_and_matches_the_reference(E, k, bias, norm, scale, dtype):
    """The eager impl (HF's formula in the logits dtype): the reference's experts, its weights and gradients within
    the dtype's tolerance, and HF's router's own outputs."""
    logits = _logits(37, E, dtype, seed=E)
    eb = 0.3 * torch.randn(E, generator=torch.Generator().manual_seed(1)) if bias else None
    w, idx, dl = _check(logits, k, eb, norm, scale, fn=mr.moe_router_eager)
    if bias:
        from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter
        router = Lfm2MoeTopKRouter.__new__(Lfm2MoeTopKRouter)       # its forward after the projection
        torch.nn.Module.__init__(router)
        router.top_k, router.norm_topk_prob, router.routed_scaling_factor, router.use_expert_bias = k, norm, scale, True
        eye = torch.eye(E, dtype=dtype)
        router.weight = torch.nn.Parameter(eye)
        _, w_hf, idx_hf = router(logits, eb)
        route = (torch.sigmoid(logits) + eb).float()
        top = torch.sort(route, -1, descending=True).values[:, :k + 1]
        unique = (top[:, 1:] != top[:, :-1]).all(-1)        # HF's CPU topk orders ties arbitrarily
        assert torch.equal(idx[unique], idx_hf[unique]) and torch.equal(w[unique], w_hf[unique].detach())


def test_ties_and_nan_in_the_eager_impl():
    g = torch.Generator().manual_seed(2)
    _check(torch.randint(0, 3, (40, 16), generator=g).float(), 4, None, True, 1.0, fn=mr.moe_router_eager)
    logits = _logits(6, 8)
    logits[1] = float("nan")
    logits[3, 5] = float("nan")
    w, idx = mr.moe_router_eager(logits, 2, 0.1 * torch.randn(8))
    assert idx[1].tolist() == [0, 1] and idx[3, 0] == 5 and w[1].isnan().all() and w[3].isnan().all()


@pytest.mark.parametrize("dtype,norm", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_nan_logits_propagate_as_in_the_reference(dtype, norm):
    """torch ranks NaN above every number: a NaN row picks experts 0, 1 (not one expert twice), one
    NaN logit is picked first and, normalised, makes its row's weights NaN."""
    logits = _logits(6, 8, dtype)
    logits[1] = float("nan")
    logits[3, 5] = float("nan")
    eb = 0.1 * torch.randn(8, generator=torch.Generator().manual_seed(4))
    dw = torch.randn(6, 2, generator=torch.Generator().manual_seed(5)).to(dtype)
    w, idx, dl = _run(_triton, logits, 2, eb, norm, 1.0, dw)
    wr, ir, dlr = _run(mr.moe_router_ref, logits, 2, eb, norm, 1.0, dw)
    assert torch.equal(idx, ir) and idx[1].tolist() == [0, 1] and idx[3, 0] == 5
    assert torch.equal(w.isnan(), wr.isnan()) and torch.equal(dl.isnan(), dlr.isnan())
    assert w[1].isnan().all() and bool(w[3].isnan().all()) == norm and w[[0, 2, 4, 5]].isfinite().all()
    assert_close(w.nan_to_num(), wr.nan_to_num(), dtype, reduce_len=2)
    assert_close(dl.nan_to_num(), dlr.nan_to_num(), dtype, reduce_len=2)


def test_many_experts_fall_back_to_torch(monkeypatch):
    logits = _logits(5, 300)
    assert dispatch.decision(mr.OP, logits, tokens=5, experts=300, top_k=4).impl == "torch"
    ran = record_impls(monkeypatch, mr.OP)
    _check(logits, 4, None, True, 1.0, fn=mr.moe_router)
    assert ran == ["torch"]


def test_kernels_write_every_element(monkeypatch):
    """No zero-fill anywhere: outputs allocated with torch.empty are poisoned first."""
    real_empty = torch.empty

    def poisoned(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", poisoned)
    logits = _logits(23, 12)
    w, idx, dl = _check(logits, 3, 0.1 * torch.randn(12), True, 1.5,
                       fn=lambda *a: _triton(*a, config=mr.MoERouterConfig(BLOCK_T=8, num_warps=1)))
    assert torch.isfinite(dl).all() and (idx >= 0).all()


def test_amd_heuristic_is_wave64():
    dims = {"tokens": 65536, "experts": 32, "top_k": 4}
    h = mr._heuristic(backend.profile("hopper"), dims, torch.bfloat16)
    a = mr._heuristic(backend.profile("mi325x"), dims, torch.bfloat16)
    assert h.BLOCK_T == a.BLOCK_T and a.num_warps * 64 == h.num_warps * 32


def test_plans():
    from liger_rt.tools.presets import get_preset
    cpu, hop = backend.profile("cpu"), backend.profile("hopper")
    assert mr._plan(None, hop, False) == [{"tokens": t, "experts": 32, "top_k": 4} for t in (1024, 4096, 16384, 65536)]
    p = mr._plan(get_preset("lfm2-24b-a2b"), hop, True)
    assert p == [{"tokens": 4096, "experts": 64, "top_k": 4}]
    assert mr._plan(get_preset("lfm2-1.2b"), hop, False) == []
    assert all(d["tokens"] <= 64 for d in mr._plan(None, cpu, False))
    assert mr._plan(get_preset("lfm2-moe-tiny"), cpu, False)[0]["experts"] == 8


def _hf_router(E, k, norm, scale, use_bias, hidden=16):
    from transformers.models.lfm2_moe.configuration_lfm2_moe import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter
    cfg = Lfm2MoeConfig(hidden_size=hidden, num_experts=E, num_experts_per_tok=k, num_hidden_layers=2,
                        layer_types=["conv", "full_attention"], norm_topk_prob=norm,
                        routed_scaling_factor=scale, use_expert_bias=use_bias)
    router = Lfm2MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    return router


@pytest.mark.parametrize("E,k,norm,scale,use_bias", [(32, 4, True, 1.0, True), (8, 2, False, 2.5, False),
                                                    (64, 4, True, 1.7, True), (16, 3, False, 1.0, True)])
def test_matches_hf_lfm2_moe_router(E, k, norm, scale, use_bias):
    torch.manual_seed(E + k)
    router = _hf_router(E, k, norm, scale, use_bias)
    h = torch.randn(50, 16)
    eb = 0.2 * torch.randn(E) if use_bias else None     # the block's fp32 expert_bias buffer
    dw = torch.randn(50, k)
    hh = h.clone().requires_grad_()
    logits_hf, w_hf, idx_hf = router(hh, eb)
    (dh_hf,) = torch.autograd.grad(w_hf, hh, dw)
    hh = h.clone().requires_grad_()
    logits = torch.nn.functional.linear(hh, router.weight)
    d = dispatch.decision(mr.OP, logits, tokens=50, experts=E, top_k=k)
    assert d.impl == "triton"
    w, idx = mr.moe_router(logits, k, eb, norm, scale)
    (dh,) = torch.autograd.grad(w, hh, dw)
    assert torch.equal(idx, idx_hf)          # same experts, same order
    assert w.dtype == w_hf.dtype
    assert_close(w, w_hf, torch.float32, reduce_len=k, name="weights")
    assert_close(dh, dh_hf, torch.float32, reduce_len=E, name="d hidden")


def test_matches_hf_router_bf16():
    torch.manual_seed(11)
    E, k = 32, 4
    router = _hf_router(E, k, True, 1.0, True).to(torch.bfloat16)
    h = torch.randn(64, 16).bfloat16()
    eb = 0.05 * torch.randn(E)
    logits, w_hf, idx_hf = router(h, eb)
    w, idx = mr.moe_router(logits, k, eb)
    # HF's CPU topk orders equal values arbitrarily; where the row has no tie among its top k+1
    # routing scores the choice is unique and must match exactly, elsewhere the chosen scores must.
    route = (torch.sigmoid(logits) + eb).float()
    top = torch.sort(route, -1, descending=True).values[:, :k + 1]
    unique = (top[:, 1:] != top[:, :-1]).all(-1)
    assert unique.float().mean() > 0.5
    assert torch.equal(idx[unique], idx_hf[unique])
    assert torch.equal(torch.gather(route, 1, idx).sort(-1).values, torch.gather(route, 1, idx_hf).sort(-1).values)
    assert w.dtype == torch.bfloat16
    order = torch.argsort(idx, -1), torch.argsort(idx_hf, -1)
    assert_close(torch.gather(w, 1, order[0]), torch.gather(w_hf, 1, order[1]), torch.bfloat16, reduce_len=k)
    assert torch.isfinite(w.float()).all()


def test_compiled_path_matches_eager():
    """torch.compile sees the kernels as custom ops (fake shapes); fullgraph once the decision is memoised."""
    torch._dynamo.reset()
    logits = _logits(20, 16, seed=5)
    eb = 0.1 * torch.randn(16)
    dw = torch.randn(20, 4)

    def f(x, k, bias, norm, scale):
        w, idx = mr.moe_router(x, k, bias, norm, scale)
        return w * 3.0, idx

    eager = _run(f, logits, 4, eb, True, 1.5, dw)
    compiled = _run(torch.compile(f, backend="aot_eager", fullgraph=True), logits, 4, eb, True, 1.5, dw)
    for o, r in zip(compiled, eager):
        assert torch.equal(o, r)


def test_a_gpu_sweep_ranks_the_router_by_wall_clock(monkeypatch, no_shipped_defaults):
    """The router declares wall_clock: a GPU sweep (here a hopper target on CPU tensors, its timings injected)
    ranks each implementation's best config by device time but the implementations by wall clock per call, and
    its tuning and crossover rows make dispatch pick a PyTorch implementation (here HF's formula, `eager`) where it
    costs less wall clock although its kernels take longer on the device."""
    import inspect

    from liger_rt import autotune
    from liger_rt.autotune import timing, tuning
    from liger_rt.tuning_db import open_store

    def tokens_and_impl(run):
        impl, _ = run.__defaults__                       # tune's `lambda impl=impl, cfg=cfg: run_case(...)`
        return inspect.getclosurevars(run).nonlocals["case"].args[0].shape[0], impl.name

    def device_ms(run, device_type, *, quick=False, method=None):     # the kernels are always faster
        t, impl = tokens_and_impl(run)
        return {"torch": 0.07, "eager": 0.05, "triton": 0.006}[impl] * t / 16, "cuda-graph"

    def wall_clock_ms(run, device_type, repeats, calls=1):           # eager's host path is cheapest below ~64
        t, impl = tokens_and_impl(run)
        return {"torch": 0.1 + 0.001 * t, "eager": 0.08 + 0.001 * t, "triton": 0.15 + 0.0001 * t}[impl]

    original = mr.OP.new_case
    monkeypatch.setattr(mr.OP, "new_case", lambda dims, dtype, device, tag="": original(dims, dtype, "cpu", tag))
    monkeypatch.setattr(mr.OP, "candidates", lambda arch, dims, dtype: [mr.OP.heuristic(arch, dims, dtype)])
    monkeypatch.setattr(timing, "time_fn", device_ms)
    monkeypatch.setattr(tuning, "wall_ms", wall_clock_ms)
    monkeypatch.setattr(tuning, "sync", lambda device_type: None)
    target = dispatch.Target(backend.profile("hopper"), "cuda")
    plan = [(mr.OP, {"tokens": t, "experts": 8, "top_k": 2}, "bf16", "") for t in (16, 256, 1024)]
    with open_store() as store:
        out = autotune.sweep(plan, target, store, quick=True)
        measured = {m["method"] for m in store.select("measurements")}
        rows = {(r["bucket"], r["impl"]): r for r in store.select("tuning")}
    assert [r["winner"]["impl"] for r in out["results"]] == ["eager", "triton", "triton"]
    best = out["results"][0]["best"]
    assert sorted(best) == ["eager", "torch", "triton"]
    assert (best["eager"]["method"], best["eager"]["median_ms"], best["eager"]["device_ms"]) == \
        ("wall-clock", pytest.approx(0.096), pytest.approx(0.05))
    assert measured == {"cuda-graph"}                    # the raw measurements: device time, every config
    assert {r["method"] for r in rows.values()} == {"wall-clock"}
    assert rows['{"tokens":16}', "torch"]["median_ms"] == pytest.approx(0.116)
    assert rows['{"tokens":16}', "eager"]["baseline_ms"] == pytest.approx(0.116)     # torch's wall clock
    (cross,) = out["crossovers"]
    assert (cross["method"], cross["axis_name"], cross["segments"]) == ("wall-clock", "tokens",
                                                                       [[64.0, "eager"], [None, "triton"]])
    dispatch.reset()
    picks = {t: dispatch.decide(mr.OP, target, torch.bfloat16, {"tokens": t, "experts": 8, "top_k": 2})
             for t in (16, 32, 256, 4096)}
    assert {t: (d.impl, d.origin) for t, d in picks.items()} == {
        16: ("eager", "db"), 32: ("eager", "crossover"), 256: ("triton", "db"), 4096: ("triton", "crossover")}
    assert "wall-clock" in picks[16].reason and "tokens=32 -> eager" in picks[32].reason
