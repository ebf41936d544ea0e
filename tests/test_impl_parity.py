"""The implementation-parity contract: whatever implementation the dispatcher picks, a call has one outcome.

For every registered op, TABLE lists bad and edge inputs (out-of-range ids and targets, every accepted and
refused dtype, empty and zero-size tensors, non-contiguous views, NaN and inf, mismatched shapes).  Each input
goes through ``liger_rt.ops.<op>`` once per implementation that can run here (LIGER_RT_IMPL_<OP> forces it; an
implementation that declares it cannot take the shape is never picked, so it is skipped), forward and, where
the forward succeeds, backward.  Every implementation must give the same outcome as ``torch``: the same error
class and message, or the same outputs and gradients (shapes, dtypes, positions of NaN and inf, values
within the op's tolerance, liger_rt/numerics.py).  Every error is one line naming the op.  Where the table states
the documented outcome (``expect``), it is checked too.

Tiny fp32/bf16 shapes; the Triton kernels run through the interpreter.  tests/gpu/test_impl_parity_gpu.py runs
the same table on CUDA.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import pytest
import torch
from routing import record_impls

import liger_rt.ops
from liger_rt import dispatch
from liger_rt.numerics import TOLERANCES, validation_report
from liger_rt.registry import OP_MODULES, REGISTRY

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
I32, I64 = torch.int32, torch.int64
OK = "ok"                   # an `expect` value: the call must succeed on every implementation
# NaN and inf inputs are the point of some rows: the interpreter's numpy says so on every one
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@dataclasses.dataclass(frozen=True)
class Input:
    """One row of an op's table: `build(dev)` -> (args, kwargs) of liger_rt.ops.<op>, fresh tensors on `dev`
    (the same values on every call: the RNG is seeded before it); `expect` None (any outcome, as long as
    every implementation agrees), OK, or (error class, regex its message must match).  `gpu_assert`: on CUDA,
    where the check would cost a host sync, every implementation stops with this device-side assertion instead
    (the GPU test runs such a row in a child process: the CUDA context is unusable after it)."""
    name: str
    build: Callable[[str], tuple[tuple, dict]]
    expect: object = None
    gpu_assert: str = ""


# -- input builders: deterministic tensors ----------------------------------------------------------------

def rnd(dev, *shape, dtype=F32, scale=1.0):
    return (torch.randn(shape) * scale).to(dev, dtype)


def ids(dev, high, *shape, dtype=I64):
    return torch.randint(0, high, shape).to(dev, dtype)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other element of a buffer twice as long in the last dim)."""
    out = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]
    return out.copy_(t)


def col_major(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view whose first two dims are transposed in memory."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def poke(t: torch.Tensor, value: float, *index) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# -- the table ------------------------------------------------------------------------------------------

def _rms_norm(dev, x=None, w=None, dt=F32, wdt=None, eps=1e-6, offset=0.0):
    x = rnd(dev, 3, 8, dtype=dt) if x is None else x
    w = rnd(dev, x.shape[-1] if x.dim() else 8, dtype=wdt or dt) if w is None else w
    return (x, w), dict(eps=eps, offset=offset)


def _fused_add(dev, x=None, r=None, w=None, dt=F32, rdt=None, wdt=None, eps=1e-6, offset=0.0):
    x = rnd(dev, 3, 8, dtype=dt) if x is None else x
    r = rnd(dev, *x.shape, dtype=rdt or dt) if r is None else r
    n = x.shape[-1] if x.dim() else 8
    return (x, r, rnd(dev, n, dtype=wdt or dt) if w is None else w), dict(eps=eps, offset=offset)


def _layer_norm(dev, x=None, w=None, b=None, dt=F32, wdt=None, no_bias=False, eps=1e-5):
    x = rnd(dev, 3, 8, dtype=dt) if x is None else x
    n = x.shape[-1] if x.dim() else 8
    w = rnd(dev, n, dtype=wdt or dt) if w is None else w
    b = None if no_bias else (rnd(dev, n, dtype=wdt or dt) if b is None else b)
    return (x, w, b), dict(eps=eps)


def _gated(dev, g=None, u=None, dt=F32, udt=None):
    g = rnd(dev, 3, 8, dtype=dt, scale=2.0) if g is None else g
    return (g, rnd(dev, *g.shape, dtype=udt or dt) if u is None else u), {}


def _rope(dev, B=1, H=2, HK=1, S=4, D=8, dt=F32, cdt=None, cos=None, sin=None, layout="bhsd", ud=1):
    q, k = rnd(dev, B, S, H, D, dtype=dt), rnd(dev, B, S, HK, D, dtype=dt)
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    angle = rnd(dev, 1, S, D) * 2
    cos = angle.cos().to(cdt or dt) if cos is None else cos
    sin = angle.sin().to(cdt or dt) if sin is None else sin
    return (q, k, cos, sin), dict(unsqueeze_dim=ud)


def _short_conv(dev, B=2, T=5, H=4, K=3, dt=F32, wdt=None, bcx=None, w=None, bias=False, seq_idx=None):
    bcx = rnd(dev, B, T, 3 * H, dtype=dt) if bcx is None else bcx
    w = rnd(dev, H, K, dtype=wdt or dt) if w is None else w
    b = rnd(dev, H, dtype=wdt or dt) if bias is True else (None if bias is False else bias)
    return (bcx, w, b), dict(seq_idx=seq_idx)


def _moe_router(dev, T=6, E=8, k=2, dt=F32, logits=None, bias=None, **kw):
    logits = rnd(dev, T, E, dtype=dt) if logits is None else logits
    return (logits, k, bias), kw


def _moe_experts(dev, T=5, E=3, K=2, H=8, I=8, dt=F32, x=None, idx=None, w=None, gu=None, down=None):
    x = rnd(dev, T, H, dtype=dt) if x is None else x
    gu = rnd(dev, E, 2 * I, H, dtype=dt, scale=0.3) if gu is None else gu
    down = rnd(dev, E, H, I, dtype=dt, scale=0.5) if down is None else down
    idx = torch.rand(T, E).topk(K, dim=-1).indices.to(dev) if idx is None else idx
    w = torch.rand(T, K).to(dev, dt) if w is None else w
    return (x, gu, down, idx, w), {}


def _ce(dev, N=6, V=11, dt=F32, logits=None, target=None, **kw):
    logits = rnd(dev, N, V, dtype=dt, scale=2.0) if logits is None else logits
    target = ids(dev, V, N) if target is None else target
    return (logits, target), kw


def _flce(dev, N=6, H=8, V=11, dt=F32, x=None, w=None, target=None, bias=None, **kw):
    x = rnd(dev, N, H, dtype=dt) if x is None else x
    w = rnd(dev, V, H, dtype=dt, scale=0.5) if w is None else w
    target = ids(dev, V, N) if target is None else target
    return (x, w, target, bias), kw


def _lp(dev, N=6, H=8, V=11, dt=F32, x=None, w=None, target=None, bias=None, **kw):
    args, _ = _flce(dev, N, H, V, dt, x, w, target, bias)
    return args, dict(return_entropy=True, **kw)


def _common(op: str, base) -> list[Input]:
    """The dtype rows every op has: the kernels' (fp32, bf16, fp16), the reference's (fp64), refused (ints, bool,
    fp8)."""
    rows = [Input(f"dtype-{n}", lambda d, t=t: base(d, dt=t), OK) for n, t in
            (("fp32", F32), ("bf16", BF16), ("fp16", F16), ("fp64", F64))]
    rows += [Input(f"dtype-{n}", lambda d, t=t: base(d, dt=t), (TypeError, rf"{op}.*dtype"))
             for n, t in (("int32", I32), ("int64", I64), ("bool", torch.bool), ("fp8", torch.float8_e4m3fn))]
    return rows


TABLE: dict[str, list[Input]] = {
    "fused_add_rms_norm": _common("fused_add_rms_norm", _fused_add) + [
        Input("residual-other-shape", lambda d: _fused_add(d, r=rnd(d, 3, 7)), (ValueError, r"fused_add_rms_norm.*residual")),
        Input("residual-broadcast", lambda d: _fused_add(d, r=rnd(d, 1, 8)), (ValueError, r"fused_add_rms_norm.*residual")),
        Input("weight-wrong-length", lambda d: _fused_add(d, w=rnd(d, 7)), (ValueError, r"fused_add_rms_norm.*weight")),
        Input("residual-bf16-x-fp32", lambda d: _fused_add(d, rdt=BF16)),
        Input("x-0d", lambda d: _fused_add(d, x=rnd(d)), (ValueError, r"fused_add_rms_norm")),
        Input("x-3d", lambda d: _fused_add(d, x=rnd(d, 2, 3, 8)), OK),
        Input("rows-0", lambda d: _fused_add(d, x=rnd(d, 0, 8)), OK),
        Input("non-contiguous", lambda d: _fused_add(d, x=strided(rnd(d, 3, 8)), r=col_major(rnd(d, 3, 8))), OK),
        Input("nan", lambda d: _fused_add(d, x=poke(rnd(d, 3, 8), float("nan"), 1, 2)), OK),
        Input("inf", lambda d: _fused_add(d, r=poke(rnd(d, 3, 8), float("inf"), 1, 2)), OK),
        Input("offset-1", lambda d: _fused_add(d, offset=1.0), OK),
    ],
    "rms_norm": _common("rms_norm", _rms_norm) + [
        Input("weight-wrong-length", lambda d: _rms_norm(d, w=rnd(d, 7)), (ValueError, r"rms_norm.*weight")),
        Input("weight-2d", lambda d: _rms_norm(d, w=rnd(d, 1, 8)), (ValueError, r"rms_norm.*weight")),
        Input("weight-int", lambda d: _rms_norm(d, w=torch.ones(8, dtype=I64, device=d))),
        Input("weight-fp64", lambda d: _rms_norm(d, wdt=F64)),
        Input("weight-bf16-x-fp32", lambda d: _rms_norm(d, wdt=BF16), OK),
        Input("x-0d", lambda d: _rms_norm(d, x=rnd(d)), (ValueError, r"rms_norm")),
        Input("x-1d", lambda d: _rms_norm(d, x=rnd(d, 8)), OK),
        Input("x-3d", lambda d: _rms_norm(d, x=rnd(d, 2, 3, 8)), OK),
        Input("rows-0", lambda d: _rms_norm(d, x=rnd(d, 0, 8)), OK),
        Input("hidden-0", lambda d: _rms_norm(d, x=rnd(d, 3, 0))),
        Input("non-contiguous", lambda d: _rms_norm(d, x=strided(rnd(d, 3, 8))), OK),
        Input("column-major", lambda d: _rms_norm(d, x=col_major(rnd(d, 3, 8))), OK),
        Input("weight-strided", lambda d: _rms_norm(d, w=strided(rnd(d, 8))), OK),
        Input("weight-expanded", lambda d: _rms_norm(d, w=rnd(d, 1).expand(8)), OK),
        Input("nan", lambda d: _rms_norm(d, x=poke(rnd(d, 3, 8), float("nan"), 1, 2)), OK),
        Input("inf", lambda d: _rms_norm(d, x=poke(rnd(d, 3, 8), float("inf"), 1, 2)), OK),
        Input("eps-negative", lambda d: _rms_norm(d, eps=-10.0)),
        Input("offset-1", lambda d: _rms_norm(d, offset=1.0), OK),
    ],
    "layer_norm": _common("layer_norm", _layer_norm) + [
        Input("weight-wrong-length", lambda d: _layer_norm(d, w=rnd(d, 7)), (ValueError, r"layer_norm.*weight")),
        Input("bias-wrong-length", lambda d: _layer_norm(d, b=rnd(d, 9)), (ValueError, r"layer_norm.*bias")),
        Input("no-bias", lambda d: _layer_norm(d, no_bias=True), OK),
        Input("weight-int", lambda d: _layer_norm(d, w=torch.ones(8, dtype=I64, device=d)),
              (TypeError, r"layer_norm.*weight")),
        Input("weight-fp64", lambda d: _layer_norm(d, wdt=F64)),
        Input("weight-bf16-x-fp32", lambda d: _layer_norm(d, wdt=BF16), OK),
        Input("x-0d", lambda d: _layer_norm(d, x=rnd(d)), (ValueError, r"layer_norm")),
        Input("rows-0", lambda d: _layer_norm(d, x=rnd(d, 0, 8)), OK),
        Input("hidden-0", lambda d: _layer_norm(d, x=rnd(d, 3, 0))),
        Input("non-contiguous", lambda d: _layer_norm(d, x=strided(rnd(d, 3, 8))), OK),
        Input("column-major", lambda d: _layer_norm(d, x=col_major(rnd(d, 3, 8))), OK),
        Input("weight-bias-strided", lambda d: _layer_norm(d, w=strided(rnd(d, 8)), b=strided(rnd(d, 8))), OK),
        Input("nan", lambda d: _layer_norm(d, x=poke(rnd(d, 3, 8), float("nan"), 1, 2)), OK),
        Input("inf", lambda d: _layer_norm(d, x=poke(rnd(d, 3, 8), float("inf"), 1, 2)), OK),
        Input("constant-row", lambda d: _layer_norm(d, x=torch.ones(3, 8, device=d)), OK),
    ],
    **{op: _common(op, _gated) + [
        Input("shape-mismatch", lambda d: _gated(d, u=rnd(d, 3, 7)), (ValueError, rf"{op}.*gate.*up")),
        Input("broadcast-up", lambda d: _gated(d, u=rnd(d, 1, 8)), (ValueError, rf"{op}.*gate.*up")),
        Input("up-int", lambda d: _gated(d, u=torch.ones(3, 8, dtype=I64, device=d)), (TypeError, rf"{op}.*up")),
        Input("up-fp64", lambda d: _gated(d, udt=F64), OK),
        Input("gate-bf16-up-fp32", lambda d: _gated(d, dt=BF16, udt=F32), OK),
        Input("gate-fp32-up-bf16", lambda d: _gated(d, dt=F32, udt=BF16), OK),
        Input("gate-0d", lambda d: _gated(d, g=rnd(d), u=rnd(d)), (ValueError, rf"{op}")),
        Input("rows-0", lambda d: _gated(d, g=rnd(d, 0, 8)), OK),
        Input("cols-0", lambda d: _gated(d, g=rnd(d, 3, 0)), OK),
        Input("cols-1", lambda d: _gated(d, g=rnd(d, 3, 1)), OK),
        Input("fused-halves", lambda d: _gated(d, *rnd(d, 3, 16).chunk(2, -1)), OK),
        Input("column-major", lambda d: _gated(d, g=col_major(rnd(d, 3, 8)), u=col_major(rnd(d, 3, 8))), OK),
        Input("nan-inf", lambda d: _gated(d, g=poke(poke(rnd(d, 3, 8), float("nan"), 0, 1), float("-inf"), 1, 1),
                                          u=poke(rnd(d, 3, 8), float("inf"), 2, 2)), OK),
    ] for op in ("swiglu", "geglu")},
    "rope": _common("rope", _rope) + [
        Input("cos-wrong-head-dim", lambda d: _rope(d, cos=rnd(d, 1, 4, 6), sin=rnd(d, 1, 4, 6)),
              (ValueError, r"rope.*cos")),
        Input("cos-wrong-seq", lambda d: _rope(d, cos=rnd(d, 1, 5, 8), sin=rnd(d, 1, 5, 8)),
              (ValueError, r"rope.*cos")),
        Input("cos-4d", lambda d: _rope(d, cos=rnd(d, 1, 1, 4, 8), sin=rnd(d, 1, 1, 4, 8)), OK),   # as HF: 5-D
        Input("cos-2d", lambda d: _rope(d, cos=rnd(d, 4, 8), sin=rnd(d, 4, 8))),
        Input("sin-broadcast", lambda d: _rope(d, sin=rnd(d, 1, 1, 8)), OK),
        Input("sin-wrong", lambda d: _rope(d, sin=rnd(d, 1, 3, 8)), (ValueError, r"rope.*sin")),
        Input("cos-batch", lambda d: _rope(d, B=2, cos=rnd(d, 2, 4, 8), sin=rnd(d, 2, 4, 8)), OK),
        Input("cos-wrong-batch", lambda d: _rope(d, B=2, cos=rnd(d, 3, 4, 8), sin=rnd(d, 3, 4, 8)),
              (ValueError, r"rope.*cos")),
        Input("k-other-seq", lambda d: (lambda a, kw: ((a[0], rnd(d, 1, 1, 5, 8), *a[2:]), kw))(*_rope(d)),
              (ValueError, r"rope.*k")),
        Input("head-dim-odd", lambda d: _rope(d, D=7), (ValueError, r"rope.*head_dim")),
        Input("cos-fp32-q-bf16", lambda d: _rope(d, dt=BF16, cdt=F32), OK),
        Input("cos-fp64", lambda d: _rope(d, cdt=F64), OK),
        Input("cos-int", lambda d: _rope(d, cdt=I64), (TypeError, r"rope.*dtype")),
        Input("bshd", lambda d: _rope(d, layout="bshd", ud=2), OK),
        Input("bshd-with-unsqueeze-1", lambda d: _rope(d, layout="bshd", ud=1), (ValueError, r"rope")),
        Input("unsqueeze-negative", lambda d: _rope(d, ud=-3), OK),
        Input("unsqueeze-0", lambda d: _rope(d, ud=0), OK),
        Input("unsqueeze-out-of-range", lambda d: _rope(d, ud=5), (ValueError, r"rope.*unsqueeze_dim")),
        Input("unsqueeze-float", lambda d: _rope(d, ud=1.0), (TypeError, r"rope.*unsqueeze_dim")),
        Input("unsqueeze-str", lambda d: _rope(d, ud="1"), (TypeError, r"rope.*unsqueeze_dim")),
        Input("unsqueeze-int-tensor", lambda d: _rope(d, ud=torch.tensor(2), layout="bshd"), OK),
        Input("seq-0", lambda d: _rope(d, S=0), OK),
        Input("batch-0", lambda d: _rope(d, B=0), OK),
        Input("heads-0", lambda d: _rope(d, H=0), OK),
        Input("contiguous-bhsd", lambda d: (lambda a, kw: ((a[0].contiguous(), a[1].contiguous(), *a[2:]), kw))(
            *_rope(d)), OK),
        Input("cos-strided", lambda d: _rope(d, cos=strided(rnd(d, 1, 4, 8)), sin=rnd(d, 1, 4, 8)), OK),
        Input("nan-inf", lambda d: _rope(d, cos=poke(rnd(d, 1, 4, 8), float("nan"), 0, 1, 1),
                                         sin=poke(rnd(d, 1, 4, 8), float("inf"), 0, 2, 5)), OK),
    ],
    "short_conv": _common("short_conv", _short_conv) + [
        Input("weight-hf-3d", lambda d: _short_conv(d, w=rnd(d, 4, 1, 3)), OK),
        Input("weight-wrong-hidden", lambda d: _short_conv(d, w=rnd(d, 5, 3)), (ValueError, r"short_conv.*weight")),
        Input("bcx-2d", lambda d: _short_conv(d, bcx=rnd(d, 5, 12)), (ValueError, r"short_conv.*bcx")),
        Input("bias", lambda d: _short_conv(d, bias=True), OK),
        Input("bias-wrong", lambda d: _short_conv(d, bias=rnd(d, 5)), (ValueError, r"short_conv.*bias")),
        Input("weight-bias-strided", lambda d: _short_conv(d, w=col_major(rnd(d, 4, 3)), bias=strided(rnd(d, 4))), OK),
        Input("weight-int", lambda d: _short_conv(d, w=torch.ones(4, 3, dtype=I64, device=d))),
        Input("weight-fp64", lambda d: _short_conv(d, wdt=F64)),
        Input("weight-bf16-bcx-fp32", lambda d: _short_conv(d, wdt=BF16), OK),
        Input("kernel-1", lambda d: _short_conv(d, K=1), OK),
        Input("kernel-longer-than-seq", lambda d: _short_conv(d, T=2, K=4), OK),
        Input("kernel-5", lambda d: _short_conv(d, K=5), OK),
        Input("kernel-0", lambda d: _short_conv(d, K=0)),
        Input("seq-0", lambda d: _short_conv(d, T=0), OK),
        Input("batch-0", lambda d: _short_conv(d, B=0), OK),
        Input("hidden-0", lambda d: _short_conv(d, H=0)),
        Input("seq-idx", lambda d: _short_conv(d, seq_idx=torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], device=d)),
              OK),
        Input("seq-idx-unordered", lambda d: _short_conv(d, seq_idx=torch.tensor([[3, -1, -1, 7, 3]] * 2, device=d))),
        Input("seq-idx-int32", lambda d: _short_conv(d, seq_idx=torch.zeros(2, 5, dtype=I32, device=d)), OK),
        Input("seq-idx-float", lambda d: _short_conv(d, seq_idx=torch.zeros(2, 5, device=d)),
              ((ValueError, TypeError), r"short_conv.*seq_idx")),
        Input("seq-idx-wrong-shape", lambda d: _short_conv(d, seq_idx=torch.zeros(2, 4, dtype=I64, device=d)),
              (ValueError, r"short_conv.*seq_idx")),
        Input("non-contiguous", lambda d: _short_conv(d, bcx=strided(rnd(d, 2, 5, 12))), OK),
        Input("seq-major", lambda d: _short_conv(d, bcx=col_major(rnd(d, 2, 5, 12))), OK),
        Input("nan-inf", lambda d: _short_conv(d, bcx=poke(poke(rnd(d, 2, 5, 12), float("nan"), 0, 1, 2),
                                                            float("inf"), 1, 3, 9)), OK),
    ],
    "moe_router": _common("moe_router", _moe_router) + [
        Input("top-k-above-experts", lambda d: _moe_router(d, k=9), (ValueError, r"moe_router.*top_k")),
        Input("top-k-0", lambda d: _moe_router(d, k=0), (ValueError, r"moe_router.*top_k")),
        Input("top-k-negative", lambda d: _moe_router(d, k=-1), (ValueError, r"moe_router.*top_k")),
        Input("top-k-bool", lambda d: _moe_router(d, k=True), (TypeError, r"moe_router.*top_k")),
        Input("top-k-float", lambda d: _moe_router(d, k=2.0), (TypeError, r"moe_router.*top_k")),
        Input("top-k-tensor", lambda d: _moe_router(d, k=torch.tensor(2)), OK),
        Input("top-k-all", lambda d: _moe_router(d, k=8), OK),
        Input("top-k-above-kernel", lambda d: _moe_router(d, E=16, k=9), OK),
        Input("experts-1", lambda d: _moe_router(d, E=1, k=1), OK),
        Input("bias", lambda d: _moe_router(d, bias=rnd(d, 8, scale=0.1)), OK),
        Input("bias-wrong", lambda d: _moe_router(d, bias=rnd(d, 7)), (ValueError, r"moe_router.*expert_bias")),
        Input("bias-int", lambda d: _moe_router(d, bias=torch.ones(8, dtype=I64, device=d))),
        Input("bias-strided", lambda d: _moe_router(d, bias=strided(rnd(d, 8, scale=0.1))), OK),
        Input("bias-fp32-logits-bf16", lambda d: _moe_router(d, dt=BF16, bias=rnd(d, 8, scale=0.1)), OK),
        Input("no-normalize", lambda d: _moe_router(d, norm_topk_prob=False, routed_scaling_factor=2.5), OK),
        Input("logits-1d", lambda d: _moe_router(d, logits=rnd(d, 8)), OK),
        Input("logits-3d", lambda d: _moe_router(d, logits=rnd(d, 2, 3, 8)), OK),
        Input("logits-0d", lambda d: _moe_router(d, logits=rnd(d)), (ValueError, r"moe_router")),
        Input("experts-0", lambda d: _moe_router(d, logits=rnd(d, 6, 0)), (ValueError, r"moe_router")),
        Input("tokens-0", lambda d: _moe_router(d, T=0), OK),
        Input("ties", lambda d: _moe_router(d, logits=torch.zeros(6, 8, device=d)), OK),
        Input("column-major", lambda d: _moe_router(d, logits=col_major(rnd(d, 6, 8))), OK),
        Input("nan", lambda d: _moe_router(d, logits=poke(rnd(d, 6, 8), float("nan"), 2, 5)), OK),
        Input("inf", lambda d: _moe_router(d, logits=poke(poke(rnd(d, 6, 8), float("inf"), 1, 3), float("-inf"), 2, 0)),
              OK),
    ],
    "moe_experts": _common("moe_experts", _moe_experts) + [
        # bf16 with widths of 16: grouped MM can take them on a GPU
        Input("expert-id-equal-E", lambda d: _moe_experts(d, H=16, I=16, dt=BF16,
                                                          idx=poke(torch.tensor([[0, 1]] * 5, device=d), 3, 2, 1)),
              (ValueError, r"moe_experts.*top_k_index.*\[0, 3\)"),
              gpu_assert="moe_experts: top_k_index holds ids outside [0, 3)"),
        Input("expert-id-negative", lambda d: _moe_experts(d, H=16, I=16, dt=BF16,
                                                           idx=poke(torch.tensor([[0, 1]] * 5, device=d), -1, 0, 0)),
              (ValueError, r"moe_experts.*top_k_index.*\[0, 3\)"),
              gpu_assert="moe_experts: top_k_index holds ids outside [0, 3)"),
        Input("expert-id-int32", lambda d: _moe_experts(d, idx=torch.tensor([[0, 2]] * 5, dtype=I32, device=d)), OK),
        Input("expert-id-repeated", lambda d: _moe_experts(d, idx=torch.tensor([[1, 1]] * 5, device=d)), OK),
        Input("expert-id-float", lambda d: _moe_experts(d, idx=torch.zeros(5, 2, device=d)),
              (TypeError, r"moe_experts.*top_k_index")),
        Input("expert-id-bool", lambda d: _moe_experts(d, idx=torch.zeros(5, 2, dtype=torch.bool, device=d)),
              (TypeError, r"moe_experts.*top_k_index")),
        Input("weights-wrong-shape", lambda d: _moe_experts(d, w=torch.rand(5, 3, device=d)),
              (ValueError, r"moe_experts.*top_k_weights")),
        Input("weights-fp64", lambda d: _moe_experts(d, w=torch.rand(5, 2, dtype=F64, device=d))),
        Input("weights-int", lambda d: _moe_experts(d, w=torch.ones(5, 2, dtype=I64, device=d))),
        Input("x-bf16-weights-fp32", lambda d: _moe_experts(d, x=rnd(d, 5, 8, dtype=BF16)),
              (TypeError, r"moe_experts.*dtype")),
        Input("down-wrong-shape", lambda d: _moe_experts(d, down=rnd(d, 3, 8, 5)), (ValueError, r"moe_experts")),
        Input("bf16-grouped-mm-shape", lambda d: _moe_experts(d, T=8, H=16, I=16, dt=BF16), OK),
        Input("gate-up-odd", lambda d: _moe_experts(d, gu=rnd(d, 3, 7, 8)), (ValueError, r"moe_experts")),
        Input("x-3d", lambda d: _moe_experts(d, x=rnd(d, 1, 5, 8), idx=torch.tensor([[[0, 2]] * 5], device=d),
                                             w=torch.rand(1, 5, 2, device=d)), OK),
        Input("tokens-0", lambda d: _moe_experts(d, T=0), OK),
        Input("top-k-1", lambda d: _moe_experts(d, K=1), OK),
        Input("top-k-0", lambda d: _moe_experts(d, K=0)),
        Input("one-expert", lambda d: _moe_experts(d, E=1, K=1), OK),
        Input("hidden-0", lambda d: _moe_experts(d, H=0)),
        Input("empty-expert", lambda d: _moe_experts(d, idx=torch.tensor([[0, 2]] * 5, device=d)), OK),
        Input("non-contiguous", lambda d: _moe_experts(d, x=strided(rnd(d, 5, 8)), idx=strided(ids(d, 3, 5, 2)),
                                                       w=strided(torch.rand(5, 2, device=d))), OK),
        Input("weights-transposed", lambda d: _moe_experts(d, gu=col_major(rnd(d, 3, 16, 8) / 3),
                                                           down=rnd(d, 3, 8, 8).transpose(1, 2) / 2), OK),
        Input("nan-inf", lambda d: _moe_experts(d, x=poke(rnd(d, 5, 8), float("nan"), 1, 3),
                                                w=poke(torch.rand(5, 2, device=d), float("inf"), 3, 0)), OK),
    ],
    "cross_entropy": _common("cross_entropy", _ce) + [
        Input("target-equal-vocab", lambda d: _ce(d, target=poke(ids(d, 11, 6), 11, 2)), OK),
        Input("target-negative", lambda d: _ce(d, target=poke(ids(d, 11, 6), -1, 4)), OK),
        Input("target-out-of-range-none", lambda d: _ce(d, target=poke(ids(d, 11, 6), 50, 0), reduction="none"), OK),
        Input("target-int32", lambda d: _ce(d, target=ids(d, 11, 6, dtype=I32)), OK),
        Input("target-float", lambda d: _ce(d, target=torch.zeros(6, device=d)), (TypeError, r"cross_entropy.*target")),
        Input("target-bool", lambda d: _ce(d, target=torch.zeros(6, dtype=torch.bool, device=d)),
              (TypeError, r"cross_entropy.*target")),
        Input("target-wrong-count", lambda d: _ce(d, target=ids(d, 11, 5)), (ValueError, r"cross_entropy.*target")),
        Input("all-ignored", lambda d: _ce(d, target=torch.full((6,), -100, device=d)), OK),
        Input("ignore-index-in-range", lambda d: _ce(d, ignore_index=3, target=torch.tensor([3, 1, 3, 0, 2, 3],
                                                                                           device=d)), OK),
        *[Input(f"reduction-{r}", lambda d, r=r: _ce(d, reduction=r), OK) for r in ("sum", "none")],
        Input("reduction-bad", lambda d: _ce(d, reduction="avg"), (ValueError, r"cross_entropy.*reduction")),
        Input("label-smoothing", lambda d: _ce(d, label_smoothing=0.1), OK),
        Input("label-smoothing-bad", lambda d: _ce(d, label_smoothing=1.5),
              (ValueError, r"cross_entropy.*label_smoothing")),
        Input("softcap", lambda d: _ce(d, softcap=3.0), OK),
        Input("softcap-0", lambda d: _ce(d, softcap=0.0), (ValueError, r"cross_entropy.*softcap")),
        Input("z-loss", lambda d: _ce(d, lse_square_scale=1e-2), OK),
        Input("num-items", lambda d: _ce(d, num_items_in_batch=4), OK),
        Input("num-items-0", lambda d: _ce(d, num_items_in_batch=0), OK),
        Input("num-items-with-none", lambda d: _ce(d, num_items_in_batch=4, reduction="none"),
              (ValueError, r"cross_entropy.*num_items_in_batch")),
        Input("logits-3d", lambda d: _ce(d, logits=rnd(d, 2, 3, 11), target=ids(d, 11, 2, 3)), OK),
        Input("rows-0", lambda d: _ce(d, N=0), OK),
        Input("vocab-0", lambda d: _ce(d, V=0, target=torch.zeros(6, dtype=I64, device=d)),
              (ValueError, r"cross_entropy.*vocab")),
        Input("vocab-1", lambda d: _ce(d, V=1), OK),
        Input("non-contiguous", lambda d: _ce(d, logits=strided(rnd(d, 6, 11)), target=strided(ids(d, 11, 6))), OK),
        Input("column-major", lambda d: _ce(d, logits=col_major(rnd(d, 6, 11))), OK),
        Input("masked-vocab", lambda d: _ce(d, logits=poke(rnd(d, 6, 11), float("-inf"), slice(None), 7)), OK),
        Input("nan", lambda d: _ce(d, logits=poke(rnd(d, 6, 11), float("nan"), 1, 3)), OK),
        Input("inf", lambda d: _ce(d, logits=poke(rnd(d, 6, 11), float("inf"), 1, 3)), OK),
    ],
    "fused_linear_cross_entropy": _common("fused_linear_cross_entropy", _flce) + [
        Input("target-equal-vocab", lambda d: _flce(d, target=poke(ids(d, 11, 6), 11, 2)), OK),
        Input("target-negative", lambda d: _flce(d, target=poke(ids(d, 11, 6), -1, 4), reduction="none"), OK),
        Input("target-float", lambda d: _flce(d, target=torch.zeros(6, device=d)),
              (TypeError, r"fused_linear_cross_entropy.*target")),
        Input("target-wrong-count", lambda d: _flce(d, target=ids(d, 11, 7)),
              (ValueError, r"fused_linear_cross_entropy.*target")),
        Input("weight-wrong-hidden", lambda d: _flce(d, w=rnd(d, 11, 7)),
              (ValueError, r"fused_linear_cross_entropy.*weight")),
        Input("bias", lambda d: _flce(d, bias=rnd(d, 11)), OK),
        Input("bias-strided", lambda d: _flce(d, bias=strided(rnd(d, 11))), OK),
        Input("bias-wrong", lambda d: _flce(d, bias=rnd(d, 10)), (ValueError, r"fused_linear_cross_entropy.*bias")),
        Input("weight-bf16-x-fp32", lambda d: _flce(d, w=rnd(d, 11, 8, dtype=BF16)), OK),
        Input("reduction-bad", lambda d: _flce(d, reduction="avg"),
              (ValueError, r"fused_linear_cross_entropy.*reduction")),
        Input("all-ignored", lambda d: _flce(d, target=torch.full((6,), -100, device=d)), OK),
        Input("options", lambda d: _flce(d, label_smoothing=0.1, lse_square_scale=1e-2, softcap=3.0,
                                         reduction="sum"), OK),
        Input("x-3d", lambda d: _flce(d, x=rnd(d, 2, 3, 8), target=ids(d, 11, 2, 3)), OK),
        Input("tokens-0", lambda d: _flce(d, N=0), OK),
        Input("hidden-0", lambda d: _flce(d, H=0)),
        Input("non-contiguous", lambda d: _flce(d, x=strided(rnd(d, 6, 8)), w=col_major(rnd(d, 11, 8))), OK),
        Input("nan-inf", lambda d: _flce(d, x=poke(rnd(d, 6, 8), float("nan"), 1, 3),
                                         w=poke(rnd(d, 11, 8), float("inf"), 2, 2)), OK),
    ],
    "fused_linear_logprobs": _common("fused_linear_logprobs", _lp) + [
        Input("target-equal-vocab", lambda d: _lp(d, target=poke(ids(d, 11, 6), 11, 2)), OK),
        Input("target-negative", lambda d: _lp(d, target=poke(ids(d, 11, 6), -1, 4)), OK),
        Input("target-float", lambda d: _lp(d, target=torch.zeros(6, device=d)),
              (ValueError, r"fused_linear_logprobs.*target")),
        Input("target-wrong-count", lambda d: _lp(d, target=ids(d, 11, 7)),
              (ValueError, r"fused_linear_logprobs.*target")),
        Input("weight-wrong-hidden", lambda d: _lp(d, w=rnd(d, 11, 7)), (ValueError, r"fused_linear_logprobs.*weight")),
        Input("bias", lambda d: _lp(d, bias=rnd(d, 11)), OK),
        Input("bias-strided", lambda d: _lp(d, bias=strided(rnd(d, 11))), OK),
        Input("bias-wrong", lambda d: _lp(d, bias=rnd(d, 10)), (ValueError, r"fused_linear_logprobs.*bias")),
        Input("temperature", lambda d: _lp(d, temperature=0.7), OK),
        Input("temperature-0", lambda d: _lp(d, temperature=0.0), (ValueError, r"fused_linear_logprobs.*temperature")),
        Input("all-ignored", lambda d: _lp(d, target=torch.full((6,), -100, device=d)), OK),
        Input("x-3d", lambda d: _lp(d, x=rnd(d, 2, 3, 8), target=ids(d, 11, 2, 3)), OK),
        Input("tokens-0", lambda d: _lp(d, N=0), OK),
        Input("vocab-0", lambda d: _lp(d, V=0, target=torch.zeros(6, dtype=I64, device=d)),
              (ValueError, r"fused_linear_logprobs.*vocab")),
        Input("non-contiguous", lambda d: _lp(d, x=strided(rnd(d, 6, 8)), w=col_major(rnd(d, 11, 8))), OK),
        Input("nan-inf", lambda d: _lp(d, x=poke(rnd(d, 6, 8), float("nan"), 1, 3),
                                       w=poke(rnd(d, 11, 8), float("inf"), 2, 2)), OK),
    ],
}

# args that get a gradient (by position; floating tensors only): cos/sin (rope) and expert_bias (moe_router)
# get none, as in the models
NO_GRAD = {"rope": (2, 3), "moe_router": (2,)}


# -- running one input through one implementation ------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    impl: str
    error: tuple[type, str] | None = None      # (class, message) of the first error, forward or backward
    stage: str = ""                            # "forward" or "backward" where it failed
    tensors: list = dataclasses.field(default_factory=list)   # outputs, then the gradients of the inputs
    ran: list = dataclasses.field(default_factory=list)       # the implementations that actually ran


def _leaves(op: str, args) -> list[torch.Tensor]:
    return [a for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dtype.is_floating_point
            and i not in NO_GRAD.get(op, ())]


def run(op_name: str, impl: str, row: Input, dev: str, monkeypatch) -> Outcome | None:
    """`row` through liger_rt.ops.<op> with LIGER_RT_IMPL_<OP>=impl: forward, then backward of the float outputs
    against fixed upstream gradients.  None when dispatch says `impl` cannot take this input (never picked)."""
    op = REGISTRY.get(op_name)
    monkeypatch.setenv(f"LIGER_RT_IMPL_{op_name.upper()}", impl)
    dispatch.reset()
    with monkeypatch.context() as m:
        ran = record_impls(m, op)
        torch.manual_seed(0)
        args, kwargs = row.build(dev)
        leaves = _leaves(op_name, args)
        args = tuple(a.detach().requires_grad_() if any(a is t for t in leaves) else a for a in args)
        leaves = _leaves(op_name, args)
        out = Outcome(impl)
        try:
            res = getattr(liger_rt.ops, op_name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (the outcome under test)
            if re.match(rf"LIGER_RT_IMPL_{op_name.upper()}=\w+ but \w+ cannot run here", str(exc)):
                return None
            out.error, out.stage, out.ran = (type(exc), str(exc)), "forward", list(ran)
            return out
        outs = list(res) if isinstance(res, (tuple, list)) else [res]
        out.tensors = [o.detach() for o in outs]
        float_outs = [o for o in outs if o.dtype.is_floating_point and o.requires_grad]
        if float_outs and leaves:
            torch.manual_seed(1)
            ups = [torch.randn(o.shape).to(o.device, o.dtype) for o in float_outs]
            try:
                grads = torch.autograd.grad(float_outs, leaves, ups, allow_unused=True)
            except Exception as exc:  # noqa: BLE001
                out.error, out.stage = (type(exc), str(exc)), "backward"
                grads = ()
            out.tensors += [g if g is None else g.detach() for g in grads]
        out.ran = list(ran)
        return out


def difference(a: torch.Tensor | None, b: torch.Tensor | None, reduce_len: int) -> str | None:
    """None when `a` (an implementation's) and `b` (torch's) agree: shape, dtype, the positions of non-finite values
    (NaN and inf alike: where an inf input meets a sum, NaN or inf depends on the order of the terms), finite values
    within the dtype's tolerance (exact for integer tensors)."""
    if a is None or b is None:
        return None if a is b else f"{'no' if a is None else 'a'} gradient, torch {'one' if a is None else 'none'}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype} {tuple(a.shape)} != torch's {b.dtype} {tuple(b.shape)}"
    if not a.dtype.is_floating_point:
        return None if torch.equal(a, b) else f"values differ: {a.tolist()} != torch's {b.tolist()}"
    dtype = b.dtype if b.dtype in TOLERANCES else F32
    a, b = a.cpu().float(), b.cpu().float()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        differ = (torch.isfinite(a) != fin).nonzero().tolist()
        return f"finite where torch is not, or the reverse, at {len(differ)} positions, e.g. {differ[:4]}"
    return validation_report(a[fin], b[fin], dtype, reduce_len) if fin.any() else None
    return None


def compare(op_name: str, outcomes: list[Outcome], row: Input) -> list[str]:
    """What differs between the implementations' outcomes (torch's first) and from the row's documented one."""
    ref = outcomes[0]
    problems = []
    reduce_len = max([s for t in ref.tensors if t is not None for s in t.shape] + [1])
    for o in outcomes:
        if o.error is not None:
            cls, msg = o.error
            if op_name not in msg or "\n" in msg.strip():
                problems.append(f"{o.impl}: {o.stage} error is not one line naming {op_name}: {cls.__name__}: {msg}")
    for o in outcomes[1:]:
        if (o.error is None) != (ref.error is None) or o.stage != ref.stage:
            problems.append(f"{o.impl}: {o.stage or 'ok'} {o.error} but torch: {ref.stage or 'ok'} {ref.error}")
            continue
        if o.error is not None and (o.error[0] is not ref.error[0] or o.error[1] != ref.error[1]):
            problems.append(f"{o.impl}: {o.error[0].__name__}: {o.error[1]} but torch: {ref.error[0].__name__}: "
                            f"{ref.error[1]}")
        if len(o.tensors) != len(ref.tensors):
            problems.append(f"{o.impl}: {len(o.tensors)} results, torch {len(ref.tensors)}")
            continue
        for i, (a, b) in enumerate(zip(o.tensors, ref.tensors)):
            if why := difference(a, b, reduce_len):
                problems.append(f"{o.impl}: result {i}: {why}")
    if row.expect == OK:
        problems += [f"{o.impl}: expected success, got {o.stage} {o.error}" for o in outcomes if o.error]
    elif row.expect is not None:
        cls, pattern = row.expect
        for o in outcomes:
            if o.error is None or not issubclass(o.error[0], cls) or not re.search(pattern, o.error[1]):
                problems.append(f"{o.impl}: expected {cls} matching {pattern!r}, got {o.stage or 'ok'} {o.error}")
    return problems


def impls_here(op_name: str, device_type: str) -> list[str]:
    """The op's implementations available on this device (torch first)."""
    op = REGISTRY.get(op_name)
    target = dispatch.current_target(device_type)
    names = [i.name for i in op.impls if i.available(target)]
    return ["torch"] + [n for n in names if n != "torch"]


ROWS = [pytest.param(op, row, id=f"{op}-{row.name}") for op in OP_MODULES for row in TABLE[op]]


def test_every_registered_op_has_a_table():
    assert set(TABLE) == set(OP_MODULES)


def check_row(op_name: str, row: Input, dev: str, monkeypatch) -> None:
    """`row` through every implementation of the op available on `dev`: one outcome (compare)."""
    impls = impls_here(op_name, dev)
    assert len(impls) > 1, impls            # on cpu the interpreter makes the Triton implementations available
    outcomes = [o for impl in impls if (o := run(op_name, impl, row, dev, monkeypatch)) is not None]
    assert outcomes[0].impl == "torch"
    problems = compare(op_name, outcomes, row)
    assert not problems, "\n".join(problems)
    if row.name == "dtype-fp32":            # the plain call: each forced implementation is the one that ran
        assert all(o.ran == [o.impl] for o in outcomes), [(o.impl, o.ran) for o in outcomes]


@pytest.mark.parametrize("op_name,row", ROWS)
def test_one_outcome_whatever_the_implementation(op_name, row, monkeypatch):
    check_row(op_name, row, "cpu", monkeypatch)
