"""rope on the GPU at Qwen3 sizes, bf16 against fp64 references (HF's apply_rotary_pos_emb).

    python -m pytest -m gpu tests/gpu/test_rope_gpu.py -q

Besides accuracy at real sizes, every candidate config of this GPU's arch is compiled, run and
validated through the autotuner (on this Triton version), so no config can fail or win wrongly.
"""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

import liger_rt.ops
from liger_rt import autotune, dispatch
from liger_rt.backend import interpreter_on
from liger_rt.kernels import rope as rp
from liger_rt.numerics import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_mem(gib=4)]     # fp64 q, k, gradients: 0.5 GB each
DEV = "cuda"
QWEN3 = dict(b=4, s=2048, hq=16, hk=8, d=128)   # Qwen3-1.7B attention, batch 4 x seq 2048

if torch.cuda.is_available() and interpreter_on():
    pytest.skip("TRITON_INTERPRET=1 is set: unset it to run the GPU tests", allow_module_level=True)


@pytest.fixture
def force_triton(monkeypatch):
    """Our kernel whatever a (shipped or swept) DB would pick for the shape."""
    monkeypatch.setenv("LIGER_RT_IMPL_ROPE", "triton")
    dispatch.reset()


def _hf_tables(b, s, d, dtype, theta=1_000_000.0, full_batch=False):
    """Qwen3RotaryEmbedding: fp32 angles position * inv_freq, emb = cat(freqs, freqs), cos/sin
    computed in fp32 then cast to the model dtype; (1, S, D) unless position_ids are per batch."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d)
    pos = torch.arange(s, device=DEV, dtype=torch.float32)[None].expand(b if full_batch else 1, s)
    if full_batch:   # packed-style offsets per batch row
        pos = pos + 37.0 * torch.arange(b, device=DEV, dtype=torch.float32)[:, None]
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qk(b, s, hq, hk, d, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, s, hq, d, device=DEV, generator=g).to(dtype).transpose(1, 2)   # HF: view + transpose
    k = torch.randn(b, s, hk, d, device=DEV, generator=g).to(dtype).transpose(1, 2)
    dq = torch.randn(q.shape, device=DEV, generator=g).to(dtype)
    dk = torch.randn(k.shape, device=DEV, generator=g).to(dtype)
    return q, k, dq, dk


def _run(fn, q, k, cos, sin, dq, dk):
    q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qe, ke = fn(q, k, cos, sin)
    return [qe, ke, *torch.autograd.grad((qe, ke), (q, k), (dq, dk))]


def _rel_rmse(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


NAMES = ("q_embed", "k_embed", "dq", "dk")


def _check(outs, q, k, cos, sin, dq, dk, dtype):
    exact = _run(hf_rope, q.double(), k.double(), cos.double(), sin.double(), dq.double(), dk.double())
    eager = _run(hf_rope, q, k, cos, sin, dq, dk)             # what HF runs in bf16
    for name, o, r, e in zip(NAMES, outs, exact, eager):
        assert o.shape == r.shape and o.dtype == e.dtype, name
        assert_close(o, r, dtype, name=name)
        # one rounding against eager's three: never further from the fp32 truth than eager
        assert _rel_rmse(o, r) <= _rel_rmse(e, r) + 1e-6, f"{name}: {_rel_rmse(o, r):.3g} vs eager {_rel_rmse(e, r):.3g}"


@pytest.mark.parametrize("full_batch", [False, True])
def test_qwen3_shape_bf16(full_batch, force_triton):
    c = QWEN3
    q, k, dq, dk = _qk(c["b"], c["s"], c["hq"], c["hk"], c["d"], torch.bfloat16)
    cos, sin = _hf_tables(c["b"], c["s"], c["d"], torch.bfloat16, full_batch=full_batch)
    d = dispatch.decision(rp.OP, q, heads_q=c["hq"], heads_k=c["hk"], head_dim=c["d"], tokens=c["b"] * c["s"])
    assert d.impl == "triton", d
    outs = _run(liger_rt.ops.rope, q, k, cos, sin, dq, dk)
    _check(outs, q, k, cos, sin, dq, dk, torch.bfloat16)
    # the kernel rounds once: bit-equal to the fp32 formula cast to bf16 but where FMA contraction
    # moves the last fp32 bit across a rounding boundary
    ref_q, ref_k = rp.rope_ref(q, k, cos, sin)
    assert (outs[0] != ref_q).float().mean() < 1e-3 and (outs[1] != ref_k).float().mean() < 1e-3


@pytest.mark.parametrize("b,s,hq,hk,d,dtype", [
    (2, 1, 32, 8, 128, torch.bfloat16),      # one position (decode-like)
    (3, 1151, 32, 4, 128, torch.float32),    # odd seq, Qwen3-30B-A3B heads
    (2, 777, 32, 8, 64, torch.float16),      # Llama-3.2-1B / LFM2 head_dim
    (1, 513, 8, 8, 256, torch.bfloat16),     # the largest head_dim the kernel takes
    (2, 99, 12, 3, 80, torch.bfloat16),      # heads and half-dim not powers of two
])
def test_other_shapes(b, s, hq, hk, d, dtype, force_triton):
    q, k, dq, dk = _qk(b, s, hq, hk, d, dtype, seed=1)
    g = torch.Generator(device=DEV).manual_seed(2)
    angle = 4.0 * torch.rand(b, s, d, device=DEV, generator=g)         # unequal halves
    cos, sin = angle.cos().to(dtype), (1.3 * angle).sin().to(dtype)
    outs = _run(liger_rt.ops.rope, q, k, cos, sin, dq, dk)
    _check(outs, q, k, cos, sin, dq, dk, dtype)


def test_unsqueeze_dim_2_layout(force_triton):
    c = QWEN3
    q, k, dq, dk = _qk(c["b"], c["s"], c["hq"], c["hk"], c["d"], torch.bfloat16, seed=3)
    q, k, dq, dk = (t.transpose(1, 2).contiguous() for t in (q, k, dq, dk))      # (B, S, H, D)
    cos, sin = _hf_tables(c["b"], c["s"], c["d"], torch.bfloat16)
    outs = _run(lambda *a: liger_rt.ops.rope(*a, unsqueeze_dim=2), q, k, cos, sin, dq, dk)
    exact = _run(lambda *a: hf_rope(*a, unsqueeze_dim=2), q.double(), k.double(), cos.double(), sin.double(),
                 dq.double(), dk.double())
    for name, o, r in zip(NAMES, outs, exact):
        assert_close(o, r, torch.bfloat16, name=name)


@pytest.mark.parametrize("dims,dtype", [
    ({"heads_q": 16, "heads_k": 8, "head_dim": 128, "tokens": 8192}, torch.bfloat16),
    ({"heads_q": 32, "heads_k": 8, "head_dim": 128, "tokens": 4096}, torch.bfloat16),
    ({"heads_q": 16, "heads_k": 8, "head_dim": 128, "tokens": 4096}, torch.float32),
])
def test_every_candidate_compiles_and_validates(dims, dtype):
    target = dispatch.current_target("cuda")
    result = autotune.tune(rp.OP, target, dtype, dims, quick=True)
    bad = [(m["config"], m["error"]) for m in result["measurements"] if not m["ok"]]
    assert not bad, bad
    n = len(rp.OP.candidates_for(rp.OP.impl("triton"), target.arch, dims, dtype))
    assert sum(m["impl"] == "triton" for m in result["measurements"]) == n
    win = result["winner"]
    print(f"\nrope {dims} {dtype}: winner {win['impl']} {win['config']} {win['median_ms']:.4g} ms "
          f"(torch {result['baseline_ms']:.4g} ms)")


def test_compiled_attention_inputs_bf16():
    """q/k projections -> rope under torch.compile(fullgraph, dynamic): the custom ops, eager's numbers."""
    c = QWEN3
    b, s, h = 2, 1024, 2048
    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(b, s, h, device=DEV, generator=g).to(torch.bfloat16)
    wq = (0.02 * torch.randn(h, c["hq"] * c["d"], device=DEV, generator=g)).to(torch.bfloat16)
    wk = (0.02 * torch.randn(h, c["hk"] * c["d"], device=DEV, generator=g)).to(torch.bfloat16)
    cos, sin = _hf_tables(b, s, c["d"], torch.bfloat16)

    def block(x):
        q = (x @ wq).view(b, s, c["hq"], c["d"]).transpose(1, 2)
        k = (x @ wk).view(b, s, c["hk"], c["d"]).transpose(1, 2)
        qe, ke = liger_rt.ops.rope(q, k, cos, sin)
        return qe.float().square().sum() + ke.float().sum()

    comp = torch.compile(block, fullgraph=True, dynamic=True)
    leaf = x.clone().requires_grad_()
    y = comp(leaf)
    (gx,) = torch.autograd.grad(y, leaf)
    leaf2 = x.clone().requires_grad_()
    y2 = block(leaf2)
    (gx2,) = torch.autograd.grad(y2, leaf2)
    assert_close(y, y2, torch.bfloat16, name="loss")
    assert_close(gx, gx2, torch.bfloat16, name="dx")
