"""fused_add_rms_norm through the Triton interpreter: tiny shapes, an fp64 formula as the reference, gradients of
both outputs (the contract every op keeps: tests/test_op_contract.py); the fused_add_norm patch flag on tiny
Qwen3 and Llama models."""
import pytest
import torch

import liger_rt
import liger_rt.ops
from liger_rt import backend, dispatch
from liger_rt.autograd import call_impl
from liger_rt.kernels import fused_add_rms_norm as fa
from liger_rt.kernels import rms_norm as rn
from liger_rt.numerics import assert_close
from routing import OpCalls, record_impls

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = backend.profile("cpu")
# wide tiles: few programs, so the larger odd shapes stay cheap in the interpreter
WIDE = {"num_warps": 4, "ROWS": 32, "bwd_num_warps": 4, "bwd_progs_per_sm": 2, "bwd_prefetch": 1}
ONE_ROW = dict(WIDE, ROWS=1, bwd_prefetch=0)     # the forward's 1-D path, the backward without prefetch


def _inputs(shape, dtype, seed, w_mean=1.0):
    """Fresh random x, residual, weight and the two upstream gradients (dy for y, ds for s)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(dtype)
    r = (3.0 * torch.randn(*shape, generator=g)).to(dtype)
    w = (w_mean + 0.4 * torch.randn(shape[-1], generator=g)).to(dtype)
    dy, ds = torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)
    return x, r, w, dy, ds


def _run(fn, x, r, w, dy, ds, **kw):
    """[y, s, dx, dresidual, dw] of fn(x, r, w) -> (y, s) for upstream gradients dy, ds (None: that output unused)."""
    x, r, w = (t.detach().clone().requires_grad_() for t in (x, r, w))
    y, s = fn(x, r, w, **kw)
    pairs = [(o, g) for o, g in ((y, dy), (s, ds)) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], (x, r, w), [g for _, g in pairs], allow_unused=True,
                                materialize_grads=True)
    return [y, s, *grads]


def _fp64(x, r, w, eps=1e-6, offset=0.0, dtype=None):
    """The formula in fp64, independent of fused_add_rms_norm_ref and rms_norm_ref.  With `dtype`, the op's two
    roundings to it (s as the add returns it; the normalised s before the weight multiply, LlamaRMSNorm's
    casting) as values only: the gradients stay exact."""
    def rounded(t):
        return t if dtype is None else t + (t.to(dtype).double() - t).detach()
    s = rounded(x.double() + r.double())
    shat = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return rounded(shat) * (w.double() + offset), s


def _triton(config):
    return lambda x, r, w, eps=1e-6, offset=0.0: call_impl(fa.OP, "triton", config, x, r, w, eps, offset)


def _heuristic(hidden):
    return fa._heuristic(CPU, {"rows": 1, "hidden": hidden}, torch.float32)


NAMES = ["y", "s", "dx", "dresidual", "dw"]


def _check_fp64(outs, x, r, w, dy, ds, dtype, rows, what, **kw):
    """Outputs in the op's dtypes, each within the dtype's tolerance of the fp64 formula (dW's scaled by rows)."""
    exact = _run(_fp64, x, r, w, None if dy is None else dy.double(), None if ds is None else ds.double(),
                 dtype=torch.promote_types(x.dtype, r.dtype), **kw)
    for name, o, e in zip(NAMES, outs, exact):
        assert o.shape == e.shape, f"{what} {name}"
        assert_close(o, e, dtype, reduce_len=rows if name == "dw" else 1, name=f"{what} {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_matches_fp64(dtype, offset):
    x, r, w, dy, ds = _inputs((3, 5, 100), dtype, seed=1, w_mean=0.0 if offset else 1.0)
    outs = _run(_triton(_heuristic(100)), x, r, w, dy, ds, offset=offset)
    assert [o.dtype for o in outs] == [dtype] * 5
    _check_fp64(outs, x, r, w, dy, ds, dtype, 15, f"{dtype} offset={offset}", offset=offset)
    # the HF layer's own casting: s is x + residual in dtype, bit for bit, and y is rms_norm(s)
    assert torch.equal(outs[1], x + r)
    assert_close(outs[0], rn.rms_norm_ref(x + r, w, 1e-6, offset), dtype, name="y vs rms_norm_ref(x + r)")
    if offset:   # the offset is not ignored
        assert (outs[0].float() - rn.rms_norm_ref(x + r, w).float()).abs().max() > 0.1


@pytest.mark.parametrize("rows,hidden,dtype,config", [
    (199, 760, torch.bfloat16, WIDE), (67, 1000, torch.float32, WIDE),
    (37, 333, torch.bfloat16, ONE_ROW), (1, 64, torch.float32, ONE_ROW)])
def test_odd_sizes(rows, hidden, dtype, config):
    """Odd rows and hidden: the last row block and the column tail are masked (packed rows and one row per
    program; the backward with and without prefetch)."""
    x, r, w, dy, ds = _inputs((rows, hidden), dtype, seed=2)
    _check_fp64(_run(_triton(config), x, r, w, dy, ds), x, r, w, dy, ds, dtype, rows, f"{rows}x{hidden}")


def test_one_output_used():
    """Only y used (s's gradient never arrives: zeros) or only s (the norm's gradient is zero)."""
    x, r, w, dy, ds = _inputs((6, 48), torch.float32, seed=3)
    f = _triton(_heuristic(48))
    for dy_, ds_ in ((dy, None), (None, ds)):
        _check_fp64(_run(f, x, r, w, dy_, ds_), x, r, w, dy_, ds_, torch.float32, 6, f"dy={dy_ is not None}")


def test_one_gradient_tensor_for_both_addends():
    """The gradient of x and of the residual is computed once: the same tensor reaches both."""
    x, r, w, dy, ds = _inputs((4, 32), torch.float32, seed=4)
    x, r, w = (t.requires_grad_() for t in (x, r, w))
    seen = []
    y, s = liger_rt.ops.fused_add_rms_norm(x * 1.0, r * 1.0, w)     # non-leaves: gradients pass through as given
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_inputs))
    torch.autograd.backward([y, s], [dy, ds])
    dx, dr = seen[0][0], seen[0][1]
    assert dx is dr
    torch.testing.assert_close(x.grad, r.grad, rtol=0, atol=0)


def test_non_contiguous():
    g = torch.Generator().manual_seed(5)
    base_x, base_r = torch.randn(4, 6, 200, generator=g), torch.randn(4, 6, 200, generator=g)
    w = torch.randn(100, generator=g) + 1.0
    dy, ds = torch.randn(4, 6, 100, generator=g), torch.randn(4, 6, 100, generator=g)
    views = {
        "row-strided views (no copy)": (base_x[..., :100], base_r[..., 100:]),
        "column stride 2 (copied)": (base_x[..., ::2], base_r[..., 1::2]),
        "one contiguous, one transposed": (base_x[..., 100:].transpose(0, 1).contiguous(),
                                           base_r[..., :100].transpose(0, 1)),
    }
    for name, (x, r) in views.items():
        dy_, ds_ = (dy.transpose(0, 1), ds.transpose(0, 1)) if "transposed" in name else (dy, ds)
        outs = _run(liger_rt.ops.fused_add_rms_norm, x, r, w, dy_, ds_)
        _check_fp64(outs, x, r, w, dy_, ds_, torch.float32, 24, name)
    # non-contiguous upstream gradients
    x, r = base_x[..., :100], base_r[..., :100]
    dy_t = torch.randn(100, 6, 4, generator=g).permute(2, 1, 0)
    ds_t = torch.randn(4, 100, 6, generator=g).transpose(1, 2)
    _check_fp64(_run(liger_rt.ops.fused_add_rms_norm, x, r, w, dy_t, ds_t), x, r, w, dy_t, ds_t, torch.float32, 24,
                "strided dy, ds")


def test_mixed_dtypes_promote_like_the_add():
    """A bf16 x onto an fp32 residual stream: s is fp32 (as x + residual), each gradient in its input's dtype."""
    x, r, w, dy, ds = _inputs((5, 64), torch.float32, seed=6)
    x = x.bfloat16()
    outs = _run(_triton(_heuristic(64)), x, r, w, dy, ds)
    assert [o.dtype for o in outs] == [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32]
    refs = _run(fa.fused_add_rms_norm_ref, x, r, w, dy, ds)
    for name, o, e in zip(NAMES, outs, refs):
        assert_close(o, e, torch.bfloat16 if name == "dx" else torch.float32, reduce_len=5 if name == "dw" else 1,
                     name=name)


def test_dispatch_runs_the_kernel_and_env_the_reference(monkeypatch):
    ran = record_impls(monkeypatch, fa.OP)
    x, r, w, dy, ds = _inputs((8, 64), torch.float32, seed=7)
    y, s = liger_rt.ops.fused_add_rms_norm(x, r, w, eps=1e-5)
    assert ran == ["triton"]
    assert dispatch.decision(fa.OP, x, rows=8, hidden=64).impl == "triton"
    monkeypatch.setenv("LIGER_RT_IMPL_FUSED_ADD_RMS_NORM", "torch")
    dispatch.reset()
    y_ref, s_ref = liger_rt.ops.fused_add_rms_norm(x, r, w, eps=1e-5)
    assert ran == ["triton", "torch"]
    assert_close(y, y_ref, torch.float32)
    assert torch.equal(s, s_ref)


def test_errors_wide_rows_and_other_dtypes():
    d = dispatch.select("fused_add_rms_norm", dtype="bf16", arch="cpu", rows=4, hidden=rn.MAX_HIDDEN + 1)
    assert d.impl == "torch"
    wide = torch.randn(2, rn.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match="hidden <= 32768"):
        fa.fused_add_rms_norm_fwd(wide, wide, torch.ones(rn.MAX_HIDDEN + 1), 1e-6, 0.0, {})
    with pytest.raises(ValueError, match="residual must have x's shape"):
        liger_rt.ops.fused_add_rms_norm(torch.randn(2, 8), torch.randn(1, 8), torch.ones(8))
    with pytest.raises(ValueError, match="weight must have shape"):
        liger_rt.ops.fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(9))
    x64, r64, w64 = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64), torch.rand(16)
    y, s = liger_rt.ops.fused_add_rms_norm(x64, r64, w64.double())
    assert torch.equal(s, x64 + r64) and torch.equal(y, rn.rms_norm_ref(x64 + r64, w64.double()))
    y0, s0 = liger_rt.ops.fused_add_rms_norm(torch.randn(0, 16), torch.randn(0, 16), torch.ones(16))
    assert y0.shape == s0.shape == (0, 16)


@pytest.mark.parametrize("backend_name", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_kernels_policy(monkeypatch, backend_name):
    """Under torch.compile with LIGER_RT_COMPILE_POLICY=kernels the kernels run as custom ops; s feeds the next
    add (inductor may write that add into s's buffer) while the backward still needs s, and one gradient serves
    both addends: no custom op result may alias another (custom_ops clones them)."""
    monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", "kernels")
    dispatch.reset()
    torch._dynamo.reset()
    calls = []
    real = fa.fused_add_rms_norm_fwd
    monkeypatch.setattr(fa, "fused_add_rms_norm_fwd", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(8)
    proj = torch.randn(48, 48, generator=g) * 0.1

    def layer(x, r, w, op):
        y, s = op(x, r, w)
        return s + y @ proj.to(y.dtype)

    f = torch.compile(lambda x, r, w: layer(x, r, w, liger_rt.ops.fused_add_rms_norm), backend=backend_name,
                      fullgraph=True)
    x, r, w, dy, _ = _inputs((2, 5, 48), torch.float32, seed=9)
    outs = _run(lambda *a: (f(*a), None), x, r, w, dy, None)
    refs = _run(lambda *a: (layer(*a, _fp64), None), x.double(), r.double(), w.double(), dy.double(), None)
    for name, o, e in zip(["out", "-", "dx", "dresidual", "dw"], outs, refs):
        if name != "-":
            assert_close(o, e, torch.float32, reduce_len=10 if name == "dw" else 1, name=f"{backend_name} {name}")
    assert calls == [1]


# -- the fused_add_norm patch flag ----------------------------------------------------------------------------

def _pair(preset):
    from liger_rt.tools.models import build_model
    base, new = build_model(preset, dtype=torch.float32), build_model(preset, dtype=torch.float32)
    new.load_state_dict(base.state_dict())
    return base, new


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("level", ["instance", "class"])
@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny"])
def test_patched_decoder_layers_match_unpatched(preset, level, monkeypatch):
    """fused_add_norm alone and with the default flags: logits and every parameter's gradient as the unpatched
    model's (fp32); each decoder layer makes one fused call; unpatch restores the host forward."""
    import types

    from liger_rt.patch import core
    base, new = _pair(preset)
    layer_cls = type(base.model.layers[0])
    host_forward = layer_cls.forward
    ids = torch.randint(1, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(10))
    want_logits, want_grads = _logits_and_grads(base, ids)
    calls = OpCalls(monkeypatch, "fused_add_rms_norm")
    try:
        for flags in ({"fused_add_norm": True, "rms_norm": False, "swiglu": False}, {"fused_add_norm": True}):
            if level == "class":
                liger_rt.patch(base.config.model_type, **flags)
                assert layer_cls.forward is not host_forward
            else:
                liger_rt.patch(new, **flags)
                forward = new.model.layers[0].__dict__["forward"]
                assert isinstance(forward, types.MethodType) and forward.__self__ is new.model.layers[0]
                assert liger_rt.patch.describe(new)["patched"]["fused_add_norm"] == len(new.model.layers)
            calls.n = 0
            logits, grads = _logits_and_grads(new, ids)
            assert calls.n == len(new.model.layers), flags
            torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)
            for name, g in want_grads.items():
                torch.testing.assert_close(grads[name], g, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    finally:
        core.unpatch(base.config.model_type)
        liger_rt.unpatch(new)
    assert layer_cls.forward is host_forward and "forward" not in new.model.layers[0].__dict__
    calls.n = 0
    new(input_ids=ids)
    assert calls.n == 0


@pytest.mark.slow
@pytest.mark.parametrize("level", ["instance", "class"])
def test_gradient_checkpointing_recomputes_each_fused_layer_once(level, fallback):
    """A checkpointed model recomputes each patched decoder layer once in the backward (counted on the MLP, which
    runs inside the layer's forward), as unpatched; the fused op ran in each recomputation."""
    from hf_compat import enable_checkpointing
    from liger_rt.tools.models import build_model
    if level == "class":
        liger_rt.patch("qwen3", fused_add_norm=True)
        model = build_model("qwen3-tiny", dtype=torch.float32)
    else:
        model = liger_rt.patch(build_model("qwen3-tiny", dtype=torch.float32), fused_add_norm=True)
    calls = []
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    enable_checkpointing(model, use_reentrant=False)
    model.train()
    ids = torch.randint(1, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(12))
    loss = model(input_ids=ids, labels=ids).loss
    forward = len(calls)
    loss.backward()
    layers = len(model.model.layers)
    assert (forward, len(calls) - forward) == (layers, layers)
    assert liger_rt.patch.describe(model)["patched"]["fused_add_norm"] == layers
    liger_rt.unpatch(model if level == "instance" else "qwen3")


def test_fused_add_norm_is_off_by_default_and_keeps_the_signature():
    import inspect

    from liger_rt.patch import specs
    for model_type in ("qwen3", "llama", "qwen2", "mistral", "mixtral", "qwen3_moe", "qwen2_moe", "smollm3", "gemma"):
        spec = specs.SPECS[model_type]
        assert "fused_add_norm" in specs.flags(spec) and "fused_add_norm" not in spec.defaults, model_type
    assert "fused_add_norm" not in specs.flags(specs.SPECS["lfm2"])
    _, model = _pair("qwen3-tiny")
    layer = model.model.layers[0]
    host = inspect.signature(layer.forward)
    liger_rt.patch(model, fused_add_norm=True)
    assert inspect.signature(layer.forward) == host
    liger_rt.unpatch(model)


def test_positional_arguments_reach_attention_as_the_host_passes_them():
    """A caller passing the layer's arguments positionally: they reach self_attn by name, as in the host."""
    base, new = _pair("llama-tiny")
    liger_rt.patch(new, fused_add_norm=True, rms_norm=False, swiglu=False)
    h = torch.randn(1, 5, base.config.hidden_size, generator=torch.Generator().manual_seed(11))
    pos = torch.arange(5)[None]
    emb = base.model.rotary_emb(h, pos)
    want = base.model.layers[0](h, None, pos, None, False, emb)
    got = new.model.layers[0](h, None, pos, None, False, emb)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    liger_rt.unpatch(new)
