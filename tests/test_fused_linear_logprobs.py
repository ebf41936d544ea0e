"""fused_linear_logprobs through the Triton interpreter against an fp64 formula written here."""
import inspect

import pytest
import torch

import liger_rt
from liger_rt import _swaps, backend, dispatch
from liger_rt.autograd import call_impl
from liger_rt.kernels import fused_linear_logprobs as flp
from liger_rt.numerics import assert_close

CPU = backend.profile("cpu")
# several chunks (4 rows), ragged vocab blocks (37 = 2 x 16 + 5 forward, 32 + 5 backward)
MULTI = flp.LogProbsConfig(chunk=4, BLOCK_V=16, num_warps=4, bwd_BLOCK_V=32, bwd_num_warps=4)
SINGLE = flp.LogProbsConfig(chunk=0, BLOCK_V=64, num_warps=4, bwd_BLOCK_V=64, bwd_num_warps=4)


def _case(tokens=13, hidden=16, vocab=37, *, bias=True, dtype=torch.float32, seed=0, ignored=(3, 7)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (3.0 / hidden ** 0.5)      # logits of spread ~3
    b = torch.randn(vocab, generator=g) if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[list(ignored)] = -100
    g_lp, g_h = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    cast = lambda a: None if a is None else a.to(dtype)  # noqa: E731
    return cast(x), cast(w), cast(b), t, g_lp, g_h


def _ref64(x, w, t, b=None, temperature=1.0, ignore_index=-100):
    """lp = z[t] - logsumexp(z), H = logsumexp(z) - sum(p z), z = (x W^T + b) / T, in fp64."""
    z = x.double() @ w.double().t()
    if b is not None:
        z = z + b.double()
    z = z / temperature
    lse = torch.logsumexp(z, -1)
    valid = t != ignore_index
    lp = z.gather(-1, torch.where(valid, t, 0)[:, None])[:, 0] - lse
    ent = lse - (torch.softmax(z, -1) * z).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _fwd_bwd(fn, x, w, b, t, g_lp, g_h, **kw):
    """Outputs and the gradients of sum(lp * g_lp + H * g_h) into x, w (and b)."""
    leaves = [a.detach().clone().requires_grad_() for a in (x, w, b) if a is not None]
    lp, ent = fn(*leaves[:2], t, leaves[2] if b is not None else None, **kw)
    grads = torch.autograd.grad((lp * g_lp.to(lp.dtype) + ent * g_h.to(lp.dtype)).sum(), leaves)
    return lp, ent, grads


def _triton(config):
    return lambda x, w, t, b, temperature=1.0, ignore_index=-100: call_impl(flp.OP,
        "triton", config, x, w, t, b, float(temperature), int(ignore_index))


def _check64(outs, refs, rows, dtype=torch.float32, what=""):
    lp, ent, grads = outs
    lp, ent, refs = lp.detach(), ent.detach(), [r.detach() for r in refs[:2]] + [refs[2]]
    assert lp.dtype == ent.dtype == torch.float32
    assert float((lp.double() - refs[0]).abs().max()) <= 1e-5, f"{what} lp"
    assert float((ent.double() - refs[1]).abs().max()) <= 1e-5, f"{what} entropy"
    for name, g, r in zip(("dx", "dw", "db"), grads, refs[2]):
        assert g.dtype == dtype
        assert_close(g, r, dtype, reduce_len=rows if name != "dx" else 1, name=f"{what} {name}")


@pytest.mark.parametrize("config,bias,temperature", [(MULTI, True, 0.7), (SINGLE, False, 1.0)], ids=["multi", "single"])
def test_fp32_matches_fp64_formula(config, bias, temperature):
    x, w, b, t, g_lp, g_h = _case(bias=bias)
    outs = _fwd_bwd(_triton(config), x, w, b, t, g_lp, g_h, temperature=temperature)
    refs = _fwd_bwd(_ref64, x.double(), w.double(), None if b is None else b.double(), t, g_lp.double(),
                    g_h.double(), temperature=temperature)
    _check64(outs, refs, x.shape[0], what=str(config))
    assert (outs[0][[3, 7]] == 0).all() and (outs[1][[3, 7]] == 0).all()
    assert (outs[2][0][[3, 7]] == 0).all()          # ignored rows take no gradient


def test_fp16_inputs_get_fp32_logits():
    """16-bit inputs: logits kept in fp32 (so log-probs match the fp64 formula of the rounded inputs
    to fp32 precision, not to fp16's), dlogits written in fp16 over the fp32 buffer (NARROW)."""
    x, w, b, t, g_lp, g_h = _case(dtype=torch.float16, seed=1)
    outs = _fwd_bwd(_triton(MULTI), x, w, b, t, g_lp, g_h, temperature=0.7)
    refs = _fwd_bwd(_ref64, x.double(), w.double(), b.double(), t, g_lp.double(), g_h.double(), temperature=0.7)
    _check64(outs, refs, x.shape[0], dtype=torch.float16, what="fp16")


def test_all_ignored_rows():
    x, w, b, t, g_lp, g_h = _case(tokens=6, ignored=range(6))
    lp, ent, (dx, dw, db) = _fwd_bwd(_triton(MULTI), x, w, b, t, g_lp, g_h)
    assert lp.abs().max() == 0 and ent.abs().max() == 0
    assert dx.abs().max() == 0 and dw.abs().max() == 0 and db.abs().max() == 0


def test_target_out_of_range_is_nan_not_a_value():
    x, w, b, t, _, _ = _case(tokens=4, ignored=())
    t[1] = 37
    lp, ent = _triton(SINGLE)(x, w, t, b)
    assert torch.isnan(lp[1]) and torch.isfinite(lp[[0, 2, 3]]).all() and torch.isfinite(ent).all()


def test_functional_shapes_routing_and_return_entropy():
    x, w, _, t, g_lp, g_h = _case(tokens=10, bias=False)
    x3, t2 = x.reshape(2, 5, -1), t.reshape(2, 5)
    d = dispatch.select("fused_linear_logprobs", dtype="fp32", arch="cpu", tokens=10, hidden=16, vocab=37)
    assert d.impl == "triton" and d.origin == "heuristic"
    lp = liger_rt.ops.fused_linear_logprobs(x3, w, t2, temperature=0.5)
    lp2, ent = liger_rt.ops.fused_linear_logprobs(x3, w, t2, temperature=0.5, return_entropy=True)
    assert lp.shape == ent.shape == (2, 5) and torch.equal(lp, lp2)
    ref_lp, ref_ent = _ref64(x, w, t, None, 0.5)
    assert float((lp.reshape(-1).double() - ref_lp).abs().max()) <= 1e-5
    assert float((ent.reshape(-1).double() - ref_ent).abs().max()) <= 1e-5


def test_fallback_runs_the_reference(fallback):
    x, w, b, t, g_lp, g_h = _case(tokens=5, ignored=(2,))
    d = dispatch.select("fused_linear_logprobs", dtype="fp32", arch="cpu", tokens=5, hidden=16, vocab=37)
    assert d.impl == "torch" and d.origin == "env"
    fn = lambda *a, **kw: liger_rt.ops.fused_linear_logprobs(*a, **kw, return_entropy=True)  # noqa: E731
    refs = _fwd_bwd(_ref64, x.double(), w.double(), b.double(), t, g_lp.double(), g_h.double(), temperature=2.0)
    _check64(_fwd_bwd(fn, x, w, b, t, g_lp, g_h, temperature=2.0), refs, 5, what="torch")


@pytest.mark.parametrize("call,match", [
    (lambda x, w, t: liger_rt.ops.fused_linear_logprobs(x, w, t[:-1]), "leading dims"),
    (lambda x, w, t: liger_rt.ops.fused_linear_logprobs(x, w[:, :-1], t), r"weight \(vocab, hidden\)"),
    (lambda x, w, t: liger_rt.ops.fused_linear_logprobs(x, w, t, temperature=0.0), "temperature > 0"),
    (lambda x, w, t: liger_rt.ops.fused_linear_logprobs(x, w, t.float()), "integer class ids"),
    (lambda x, w, t: liger_rt.ops.fused_linear_logprobs(x, w, t, torch.zeros(3)), r"bias must have shape \(37,\)"),
])
def test_errors_name_what_is_valid(call, match):
    x, w, _, t, _, _ = _case(tokens=4, bias=False, ignored=())
    with pytest.raises(ValueError, match=match):
        call(x, w, t)


def test_compiles_fullgraph_with_gradients(monkeypatch):
    """Zero graph breaks (fullgraph=True), forward and backward through the generated custom ops."""
    x, w, b, t, g_lp, g_h = _case(tokens=8, seed=2)
    impl, ran = flp.OP.impl("triton"), []
    for name in ("forward", "backward"):
        real = getattr(impl, name)
        monkeypatch.setattr(impl, name, lambda *a, real=real, name=name: ran.append(name) or real(*a))
    torch._dynamo.reset()

    def step(x, w, b):
        lp, ent = liger_rt.ops.fused_linear_logprobs(x, w, t, b, temperature=0.7, return_entropy=True)
        return (lp * g_lp + ent * g_h).sum(), lp

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    leaves = [a.clone().requires_grad_() for a in (x, w, b)]
    loss, lp = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    ref = _fwd_bwd(_ref64, x.double(), w.double(), b.double(), t, g_lp.double(), g_h.double(), temperature=0.7)
    assert ran == ["forward", "backward"]
    assert float((lp.detach().double() - ref[0].detach()).abs().max()) <= 1e-5
    for g, r in zip(grads, ref[2]):
        assert_close(g, r, torch.float32, reduce_len=8)


def test_candidates_construct_and_respect_the_chunk_cap_on_every_arch():
    from liger_rt.tools.presets import get_preset
    for name in backend.ARCH_NAMES:
        arch = backend.profile(name)
        plans = flp._plan(None, arch, False) + flp._plan(get_preset("qwen3-4b"), arch, True)
        for dims in plans:
            cands = flp.OP.candidates_for(flp.OP.impl("triton"), arch, dims, torch.bfloat16)
            assert cands and all(isinstance(c, flp.LogProbsConfig) for c in cands), (name, dims)
            cap, cand_cap = flp.chunk_cap(arch, dims), flp.chunk_cap(arch, dims, share=8)
            fixed = [flp._heuristic(arch, dims, torch.bfloat16)]
            assert all((cfg.chunk == 0) == (dims["tokens"] <= cap) for cfg in fixed), (name, dims, fixed)
            for cfg in fixed:
                assert (cfg.chunk or dims["tokens"]) <= cap, (name, dims, cfg)
            for cfg in cands + fixed:
                assert (cfg.chunk or dims["tokens"]) <= cand_cap, (name, dims, cfg)
                if arch.is_hip:
                    assert cfg.limits()[0] <= 8, cfg
            if name != "cpu":   # the memory target: one fp32 chunk <= 1/8 of the bf16 logits, or the floor
                assert cap * 4 <= dims["tokens"] * 2 / 8 or cap == 256, (name, dims, cap)
                # candidates: <= 1/4 of them (1/8 of torch.compile's bf16 logits and their gradient)
                assert cand_cap * 4 <= dims["tokens"] * 2 / 4 or cand_cap == 256, (name, dims, cand_cap)
    assert flp.chunk_cap(backend.profile("hopper"), {"tokens": 16384, "vocab": 151936}) == 1024
    assert flp.chunk_cap(backend.profile("hopper"), {"tokens": 16384, "vocab": 151936}, share=8) == 1536


# -- the causal-LM forward and the parity rows (liger_rt.layers.logprobs) --------------------------

def _logprobs_patched(model):
    """What liger_rt.patch does for logprobs=True (instance level)."""
    from liger_rt.layers import logprobs, loss
    opts = loss.loss_options(inspect.signature(_swaps.original(model)), type(model).__module__)
    _swaps.bind(model, logprobs.causal_lm_logprobs_forward)
    model._liger_rt_logprobs = opts
    return model


@pytest.mark.slow
def test_causal_lm_forward_returns_logprobs_and_entropy_without_logits():
    from liger_rt.tools.models import build_model
    base, model = build_model("qwen3-tiny"), _logprobs_patched(build_model("qwen3-tiny"))
    ids = torch.randint(1, 160, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, temperature=0.8)
    assert type(out).__name__ == "CausalLMLogProbsOutput" and out.loss is None and out.logits is None
    with torch.no_grad():         # HF's logits in fp64, tempered, at the next token
        logp = torch.log_softmax(base(input_ids=ids, attention_mask=mask).logits.double() / 0.8, -1)
    nxt = labels[:, 1:]
    valid = nxt != -100
    lp = logp[:, :-1].gather(-1, nxt.clamp(min=0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)[:, :-1]
    assert float((out.logprobs[:, :-1].detach().double() - lp)[valid].abs().max()) <= 1e-5
    assert float((out.entropy[:, :-1].detach().double() - ent)[valid].abs().max()) <= 1e-5
    assert (out.logprobs[:, -1] == 0).all() and (out.logprobs[:, :-1][~valid] == 0).all()
    out.logprobs.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    assert "temperature" in inspect.signature(model.forward).parameters
    assert model(input_ids=ids).logits.shape == (2, 8, 160)                     # no labels: the host runs
    assert model(input_ids=ids, labels=labels, return_logits=True).loss is not None


@pytest.mark.slow
def test_parity_rows_go_through_the_op():
    from liger_rt.tools import parity as P
    from liger_rt.tools.models import build_model
    report = P.compare(lambda: build_model("qwen3-tiny"), patch=_logprobs_patched)
    assert report["fused_logprobs"] and report["ok"], P.format_table(report)
    assert report["rows"]["action_logprobs"]["max_abs"] <= 1e-5
    assert report["rows"]["entropy"]["max_abs"] <= 1e-5


def test_benchmark_plumbing_on_cpu(tmp_path):
    """The H200 benchmark's arms, errors and CSV on a tiny case (peers that do not import are skipped
    with the reason; the GPU run is `python -m liger_rt.tools.bench.logprobs`)."""
    from click.testing import CliRunner

    from liger_rt.tools.bench import logprobs as B
    rows = B.run(specs=[dict(op=B.OP, tokens=8, hidden=16, vocab=67, quick=True)], device="cpu", compile_=False,
                 out_dir=tmp_path, echo=lambda s: None)
    by = {(r["impl"], r["pass"]): r for r in rows}
    for impl in ("liger_rt", "eager"):
        assert by[(impl, "fwdbwd")]["err_lp"] < 1e-5 and by[(impl, "fwdbwd")]["err_dw"] < 1e-5, by[(impl, "fwdbwd")]
        assert by[(impl, "fwd_nograd")]["ms"] > 0
    assert by[("liger_rt", "fwdbwd")]["config"].startswith("triton")
    for impl in ("trl", "liger_kernel"):
        assert all(by[(impl, p)].get("ms") or by[(impl, p)]["error"] for p in B.PASSES)
    csv_text = (tmp_path / "logprobs_cpu.csv").read_text()
    assert "trl" in csv_text.splitlines()[0] and "liger_kernel" in csv_text.splitlines()[0]
    result = CliRunner().invoke(B.main, [])
    if not torch.cuda.is_available():
        assert result.exit_code == 1 and "needs a CUDA/ROCm GPU" in result.output


def test_benchmark_rounds_are_counterbalanced_and_judged_by_median(tmp_path):
    """--rounds 3: every arm once a round, the order reversed in round 2; the verdict takes each arm's
    median round and shows the spread."""
    from liger_rt.tools.bench import logprobs as B
    rows = B.run(specs=[dict(op=B.OP, tokens=8, hidden=16, vocab=67, quick=True)], device="cpu", compile_=False,
                 out_dir=tmp_path, echo=lambda s: None, rounds=3)
    order = {rnd: list(dict.fromkeys(r["impl"] for r in rows if r["round"] == rnd)) for rnd in range(3)}
    assert order[1] == order[0][::-1] and order[2] == order[0] and len(order[0]) == 4
    assert len(rows) == 3 * len(order[0]) * len(B.PASSES)
    # pinned timings: ours 5, 9, 1 ms (median 5) against TRL 4, 6, 20 (median 6)
    fake = [{"tokens": 1, "hidden": 2, "vocab": 3, "impl": impl, "pass": "fwdbwd", "ms": ms}
            for impl, times in (("liger_rt", (5, 9, 1)), ("trl", (4, 6, 20))) for ms in times]
    (line,) = B.verdicts(fake)
    assert "ok time vs trl (5 vs 6 ms; median of 3, spread 1..9 vs 4..20)" in line, line
