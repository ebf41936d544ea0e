"""LFM2-MoE router: sigmoid scores, top-k on scores + expert_bias, weights from the unbiased scores, optional
normalisation with a 1e-6 guard, then routed_scaling_factor.

    weights, indices = moe_router(logits, top_k=4, expert_bias=bias)   # logits (T, 32) -> (T, 4) x2

The experts picked equal HF's (transformers Lfm2MoeTopKRouter.forward) in every dtype: the fp32 sigmoid is rounded
(to nearest even) to the logits dtype before selection; `scores + expert_bias` follows torch's promotion (bf16 + the
fp32 bias buffer is fp32); ties go to the lower expert index (a stable descending sort; torch.topk may pick any of equal
scores, on CUDA as on CPU); NaN ranks above every number, so a NaN score is picked
first and, normalised, makes its row's weights NaN. Weights come from the unbiased scores, normalised in fp32 (HF:
in the logits dtype) and rounded once to the logits dtype; indices are int64.

Implementations: `triton` (one forward and one backward kernel), `eager` (HF's formula in the logits dtype, autograd:
the fewest torch ops) and `torch` (the fp32 reference).  A GPU sweep ranks them by wall clock per call (the Op's
wall_clock), since the kernels take microseconds and a call's host path decides.
"""
from __future__ import annotations

import dataclasses
import operator

import torch

from .._triton import tl, triton
from ..config import WARPS, Config, knob, pow2
from ..dispatch import call, register
from ..launch import bind, launch_memo
from ..op import Case, Impl, Op
from ._common import next_pow2, row_layout, triton_available, warps_for
from ._common import block_problem

try:  # accurate expf on GPUs (CUDA libdevice / ROCm ocml); the interpreter has no libdevice
    from triton.language.extra import libdevice as _libdevice
except Exception:  # pragma: no cover
    _libdevice = None

MAX_EXPERTS = 256
MAX_TOP_K = 8


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` and back, with an identity gradient (straight through, in fp32)."""
    return x if dtype == torch.float32 else x + (x.to(dtype).float() - x).detach()


def routing_dtype(logits_dtype: torch.dtype, bias_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype HF's `scores + expert_bias` is computed in (torch type promotion)."""
    return logits_dtype if bias_dtype is None else torch.promote_types(logits_dtype, bias_dtype)


def moe_router_ref(logits: torch.Tensor, top_k: int, expert_bias: torch.Tensor | None = None,
                   norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
    """fp32 reference (also the `torch` impl): logits (..., E) -> weights (..., k) in logits dtype, indices int64."""
    scores = _round_to(torch.sigmoid(logits.float()), logits.dtype)
    route = scores
    if expert_bias is not None:
        route = _round_to(scores.detach() + expert_bias.float(), routing_dtype(logits.dtype, expert_bias.dtype))
    # stable descending sort: among equal scores the lower expert index comes first
    indices = torch.sort(route.detach(), dim=-1, descending=True, stable=True).indices[..., :top_k]
    weights = torch.gather(scores, -1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return (weights * routed_scaling_factor).to(logits.dtype), indices


def moe_router_eager(logits: torch.Tensor, top_k: int, expert_bias: torch.Tensor | None = None,
                     norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
    """Hugging Face's formula (Lfm2MoeTopKRouter.forward after the gate projection) in the logits dtype, differentiated
    by autograd (the `eager` impl): what the unpatched model computes, in about half the reference's ops (no fp32
    round trips), the cheapest host path where a call costs more host time than its kernels save.  The experts equal
    the reference's (the sigmoid in the logits dtype is its fp32 sigmoid rounded once; ties to the lower index by a
    stable sort, where HF's topk may pick any of equal scores); the weights are normalised in the logits dtype, as HF
    does (within one rounding of the reference's fp32 normalisation)."""
    scores = logits.sigmoid()
    route = (scores if expert_bias is None else scores + expert_bias).detach()
    # a stable descending sort, not topk: topk on CUDA and on CPU may pick any of equal scores
    indices = torch.sort(route, dim=-1, descending=True, stable=True).indices[..., :top_k]
    weights = torch.gather(scores, -1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, indices


@triton.jit
def _round_fp32(x, QUANT: tl.constexpr):
    # QUANT 1: to bf16 (round to nearest even, by bits: the interpreter's cast truncates; NaN kept
    # as it is, its payload could carry into the sign); 2: to fp16; 0: unchanged.
    if QUANT == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif QUANT == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _sigmoid_fp32(x, ACCURATE: tl.constexpr):
    # torch's CUDA sigmoid is 1 / (1 + expf(-x)) with IEEE division: the same ops bit for bit,
    # so scores (and ties among them) equal torch's.  tl.exp would be the approximate ex2.
    if ACCURATE:
        e = _libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit(do_not_specialize=["T"])
def _moe_router_fwd_kernel(
    L, EB, W_OUT, I_OUT, I_SAVE, T, E, s_lt, scale, K: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    QUANT: tl.constexpr, ROUTE_QUANT: tl.constexpr, ACCURATE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_e = tl.arange(0, BLOCK_E)
    o_k = tl.arange(0, BLOCK_K)
    m_t = o_t < T
    m_e = o_e < E
    m = m_t[:, None] & m_e[None, :]
    o_t64 = o_t.to(tl.int64)
    b_l = tl.load(L + o_t64[:, None] * s_lt + o_e[None, :], mask=m, other=0.0).to(tl.float32)
    b_s = _round_fp32(_sigmoid_fp32(b_l, ACCURATE), QUANT)
    b_r = b_s
    if HAS_BIAS:
        b_r = _round_fp32(b_s + tl.load(EB + o_e, mask=m_e, other=0.0).to(tl.float32)[None, :], ROUTE_QUANT)
    b_free = m            # experts not chosen yet
    b_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    b_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(K):
        # torch's order: NaN above every number, then the lower index among equals (explicit, as
        # argmax's tie and NaN rules differ across backends)
        b_nan = b_free & (b_r != b_r)
        b_max = tl.max(tl.where(b_free & (b_r == b_r), b_r, float("-inf")), axis=1)
        b_top = tl.where(tl.max(b_nan.to(tl.int32), axis=1)[:, None] > 0, b_nan, b_free & (b_r == b_max[:, None]))
        i_k = tl.min(tl.where(b_top, o_e[None, :], BLOCK_E), axis=1)
        i_k = tl.minimum(i_k, E - 1)   # rows past T choose nothing: keep the index in range
        hit = o_e[None, :] == i_k[:, None]
        w_k = tl.sum(tl.where(hit, b_s, 0.0), axis=1)
        b_free = b_free & (o_e[None, :] != i_k[:, None])
        b_w = tl.where(o_k[None, :] == k, w_k[:, None], b_w)
        b_i = tl.where(o_k[None, :] == k, i_k[:, None], b_i)
    if NORMALIZE:
        b_w = b_w / (tl.sum(b_w, axis=1)[:, None] + 1e-6)
    b_w = b_w * scale
    mk = m_t[:, None] & (o_k[None, :] < K)
    off = o_t64[:, None] * K + o_k[None, :]
    tl.store(W_OUT + off, b_w.to(W_OUT.dtype.element_ty), mask=mk)
    tl.store(I_OUT + off, b_i.to(tl.int64), mask=mk)
    tl.store(I_SAVE + off, b_i, mask=mk)     # int32 copy for the backward (outputs cannot be saved)


@triton.jit(do_not_specialize=["T"])
def _moe_router_bwd_kernel(
    L, I, DW, DL, T, E, s_lt, s_dlt, scale, K: tl.constexpr, NORMALIZE: tl.constexpr, QUANT: tl.constexpr,
    ACCURATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    # w_j = scale * s_j / D, D = sum_sel s + 1e-6:
    #   dL/ds_m = scale * (g_m / D - sum_j g_j s_j / D^2) on selected m, 0 elsewhere;
    #   dL/dl = dL/ds * sigma * (1 - sigma) (the rounding to the logits dtype is straight through).
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_e = tl.arange(0, BLOCK_E)
    m_t = o_t < T
    m_e = o_e < E
    m = m_t[:, None] & m_e[None, :]
    o_t64 = o_t.to(tl.int64)
    b_l = tl.load(L + o_t64[:, None] * s_lt + o_e[None, :], mask=m, other=0.0).to(tl.float32)
    b_sig = _sigmoid_fp32(b_l, ACCURATE)
    b_s = _round_fp32(b_sig, QUANT)
    b_g = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    b_sel = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    for k in tl.static_range(K):
        i_k = tl.load(I + o_t64 * K + k, mask=m_t, other=-1)
        g_k = tl.load(DW + o_t64 * K + k, mask=m_t, other=0.0).to(tl.float32)
        hit = o_e[None, :] == i_k[:, None]
        b_g = tl.where(hit, g_k[:, None], b_g)
        b_sel = b_sel | hit
    if NORMALIZE:
        b_den = tl.sum(tl.where(b_sel, b_s, 0.0), axis=1) + 1e-6
        b_gs = tl.sum(b_g * b_s, axis=1)
        b_ds = (b_g / b_den[:, None] - (b_gs / (b_den * b_den))[:, None]) * scale
    else:
        b_ds = b_g * scale
    b_dl = tl.where(b_sel, b_ds, 0.0) * b_sig * (1.0 - b_sig)   # NaN at a NaN logit, chosen or not, as autograd
    tl.store(DL + o_t64[:, None] * s_dlt + o_e[None, :], b_dl.to(DL.dtype.element_ty), mask=m)


_QUANT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _accurate(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" and _libdevice is not None


@launch_memo
def _fwd_launch(config, T: int, E: int, k: int, has_bias: bool, normalize: bool, quant: int, route_quant: int,
                accurate: bool):
    """The forward's bound kernel per shape and mode (checked once per shape, not per call)."""
    why = _supports({"experts": E, "top_k": k}, None)
    if why:
        raise ValueError(f"the Triton moe_router takes {why}; liger_rt.ops.moe_router runs torch there "
                         f"(or LIGER_RT_IMPL_MOE_ROUTER=torch)")
    return bind(_moe_router_fwd_kernel, (triton.cdiv(T, config.BLOCK_T),), K=k, HAS_BIAS=has_bias,
                NORMALIZE=normalize, QUANT=quant, ROUTE_QUANT=route_quant, ACCURATE=accurate, BLOCK_T=config.BLOCK_T,
                BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(k), num_warps=config.num_warps)


@launch_memo
def _bwd_launch(config, T: int, E: int, k: int, normalize: bool, quant: int, accurate: bool):
    return bind(_moe_router_bwd_kernel, (triton.cdiv(T, config.BLOCK_T),), K=k, NORMALIZE=normalize, QUANT=quant,
                ACCURATE=accurate, BLOCK_T=config.BLOCK_T, BLOCK_E=next_pow2(E), num_warps=config.num_warps)


@launch_memo
def _route_quant(logits_dtype: torch.dtype, bias_dtype: torch.dtype | None) -> int:
    return _QUANT.get(routing_dtype(logits_dtype, bias_dtype), 0)


def moe_router_fwd(logits, top_k, expert_bias, norm_topk_prob, routed_scaling_factor, config):
    """logits (..., E) -> weights (..., k) in logits dtype, indices (..., k) int64, and the indices again as
    (T, k) int32 for the backward."""
    E = logits.shape[-1]
    l2, T, stride = row_layout(logits, E)
    shape = (*logits.shape[:-1], top_k)
    weights = torch.empty(shape, device=logits.device, dtype=logits.dtype)
    indices = torch.empty(shape, device=logits.device, dtype=torch.int64)
    saved = torch.empty((T, top_k), device=logits.device, dtype=torch.int32)
    if T:
        has_bias = expert_bias is not None
        run = _fwd_launch(config, T, E, top_k, has_bias, bool(norm_topk_prob), _QUANT[logits.dtype],
                          _route_quant(logits.dtype, expert_bias.dtype if has_bias else None), _accurate(logits))
        run(l2, expert_bias.contiguous() if has_bias else l2, weights, indices, saved, T, E, stride,
            float(routed_scaling_factor))
    return weights, indices, saved


def moe_router_bwd(logits, indices32, dweights, norm_topk_prob, routed_scaling_factor, config):
    """The dense d(logits) in the logits' shape and dtype; every element written by the kernel."""
    E = logits.shape[-1]
    l2, T, stride = row_layout(logits, E)
    dlogits = torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
    if T:
        _bwd_launch(config, T, E, indices32.shape[1], bool(norm_topk_prob), _QUANT[logits.dtype], _accurate(logits))(
            l2, indices32, dweights.contiguous(), dlogits, T, E, stride, E, float(routed_scaling_factor))
    return dlogits


@dataclasses.dataclass(frozen=True)
class MoERouterConfig(Config):
    BLOCK_T: int = knob(64, pow2(1, 8192))      # tokens per program (forward and backward)
    num_warps: int = knob(8, WARPS)


def _dims(logits, top_k, expert_bias, norm_topk_prob, routed_scaling_factor) -> dict:
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"moe_router takes logits (tokens, experts); got {tuple(logits.shape)}")
    E = logits.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_router: top_k must be in 1..{E} (the number of experts), got {top_k}")
    if expert_bias is not None and tuple(expert_bias.shape) != (E,):
        raise ValueError(f"moe_router: expert_bias must have shape ({E},); got {tuple(expert_bias.shape)}")
    return {"tokens": logits.numel() // E, "experts": E, "top_k": top_k}


def _forward(config, logits, top_k, expert_bias, norm_topk_prob, routed_scaling_factor):
    w, idx, idx32 = moe_router_fwd(logits, top_k, expert_bias, norm_topk_prob, routed_scaling_factor, config)
    return (w, idx), (idx32,)


def _backward(config, args, saved, needs, dweights, dindices):
    logits, top_k, _, norm_topk_prob, routed_scaling_factor = args
    if dweights is None:
        dweights = logits.new_zeros(*logits.shape[:-1], top_k)
    dl = moe_router_bwd(logits, saved[0], dweights, norm_topk_prob, routed_scaling_factor, config)
    return dl, None, None, None, None


def _fake(config, logits, top_k, expert_bias, norm_topk_prob, routed_scaling_factor):
    shape = (*logits.shape[:-1], top_k)
    return ((logits.new_empty(shape), logits.new_empty(shape, dtype=torch.int64)),
            (logits.new_empty((logits.numel() // logits.shape[-1], top_k), dtype=torch.int32),))


def moe_router(logits: torch.Tensor, top_k: int, expert_bias: torch.Tensor | None = None,
               norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
    """LFM2-MoE routing: logits (..., E) -> (weights (..., k) in logits dtype, indices (..., k) int64).

    >>> weights, idx = moe_router(F.linear(h2d, gate.weight), cfg.num_experts_per_tok, block.expert_bias)
    """
    try:
        k = None if isinstance(top_k, bool) else operator.index(top_k)
    except TypeError:      # a float tensor has __index__ and refuses it
        k = None
    if k is None:
        raise TypeError(f"moe_router: top_k must be an integer number of experts, got {top_k!r}")
    return call(OP, logits, k, expert_bias, bool(norm_topk_prob), float(routed_scaling_factor))


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    T, E, k = dims["tokens"], dims["experts"], dims["top_k"]
    logits = torch.randn(T, E, generator=g).to(device, dtype).requires_grad_()
    # HF keeps expert_bias as an fp32 buffer (aux-loss-free load balancing); small like a trained one
    bias = (0.05 * torch.randn(E, generator=g)).to(device)
    dw = torch.randn(T, k, generator=g).to(device, dtype)
    return Case(args=(logits, k, bias, True, 1.0), grads=(dw, None))


def _tile_rows(E: int, elems: int) -> int:
    return max(1, elems // next_pow2(E))


def _heuristic(arch, dims, dtype):
    E = dims["experts"]
    if arch.name == "cpu":
        return MoERouterConfig(BLOCK_T=min(8, _tile_rows(E, 256)), num_warps=1)
    # 2048-element tiles (64 rows at E=32): T=65536 gives 1024 programs, ~8 per SM.  8 elements
    # per thread keeps the backward at ~100 registers (ptxas sm_90a of Triton 3.9's PTX, compiled
    # offline: 16 per thread needs 167); on AMD the same threads are half the (64-lane) warps.
    return MoERouterConfig(BLOCK_T=_tile_rows(E, 2048), num_warps=warps_for(max(2048, next_pow2(E)), 8, arch))


def _configs(arch, dims, dtype):
    E = dims["experts"]
    base = _heuristic(arch, dims, dtype)
    if arch.name == "cpu":
        return [base, MoERouterConfig(BLOCK_T=_tile_rows(E, 64), num_warps=1)]
    rows = [_tile_rows(E, elems) for elems in (512, 1024, 2048, 4096, 8192)]
    return list(dict.fromkeys([base] + [MoERouterConfig(BLOCK_T=r, num_warps=warps_for(r * next_pow2(E), pt, arch))
                                        for r in rows for pt in (8, 16, 32)]))


def _supports(dims, dtype):
    E, k = dims["experts"], dims["top_k"]
    if not 1 <= E <= MAX_EXPERTS:
        return f"1..{MAX_EXPERTS} experts (one row per BLOCK_E lanes), got {E}"
    if not 1 <= k <= min(E, MAX_TOP_K):
        return f"1 <= top_k <= min(experts, {MAX_TOP_K}), got top_k={k}, experts={E}"
    return None


def _launchable(config, dims, arch, dtype):
    """Why `config` cannot launch at `dims` (None: it can): both kernels hold (BLOCK_T, padded experts) tiles,
    within Triton's largest block."""
    return block_problem(tile=config.BLOCK_T * next_pow2(dims["experts"]))


def _plan(preset, arch, quick):
    if preset is not None and preset.experts == 0:
        return []
    E, k = (preset.experts, preset.top_k) if preset is not None else (32, 4)
    if preset is not None and (preset.tiny or arch.name != "cpu"):
        tokens = preset.quick_tokens if quick else preset.tokens
    elif arch.name == "cpu":
        tokens = (32,) if quick else (16, 64)
    else:
        tokens = (4096,) if quick else (1024, 4096, 16384, 65536)
    return [{"tokens": int(t), "experts": E, "top_k": k} for t in tokens]


OP = register(Op(
    name="moe_router", static=("experts", "top_k"), dynamic=("tokens",), dims=_dims, config=MoERouterConfig,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available, supports=_supports),
           Impl("torch", fn=moe_router_ref), Impl("eager", fn=moe_router_eager)],     # eager: where a row says so
    candidates=_configs, heuristic=_heuristic, launchable=_launchable, fake=_fake, outputs=2,
    make_case=_make_case, plan=_plan,
    schema="Tensor logits, int top_k, Tensor? expert_bias, bool norm_topk_prob, float routed_scaling_factor",
    reduce_len=lambda d: d["top_k"],
    # ranked by wall clock, crossing over on the token count: the kernels take microseconds while a call costs a
    # few hundred of host time (T4096 E32 bf16 fwd+bwd on an H100: device 5.9 us, torch 72 us; wall clock per call
    # 0.28 ms, torch 0.46 ms; HF's formula, the eager impl, ran at 1/0.84 of the dispatched kernels' speed in the
    # kernel benchmark there), so the host path decides which implementation a training step waits less for
    wall_clock=True, crossover_axis=lambda d: d["tokens"], crossover_axis_name="tokens"))
