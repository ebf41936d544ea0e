"""Fused linear log-probs and entropy: per-token log p(target | x) and the entropy of the tempered
softmax of x @ W.T (+ b), chunked over tokens so the (tokens, vocab) logits never exist.

    lp, ent = liger_rt.ops.fused_linear_logprobs(hidden, lm_head.weight, actions, return_entropy=True)  # (B, S) fp32

With z = (x @ W.T + b) / T, p = softmax(z), lse = logsumexp(z):
    lp = z[t] - lse,   H = lse - sum_j p_j z_j.
Rows whose target is `ignore_index` give lp = H = 0 and no gradient; a target outside [0, vocab)
gives lp = NaN (never a silent wrong value) on every implementation, its entropy as usual, and the
gradient of -lse (no target term).  Both outputs are fp32 whatever the input dtype.
For each chunk of `chunk` token rows (a dispatch decision, see `chunk_cap`):
  forward   logits = x[chunk] @ W.T            cuBLAS, fp32 out (16-bit inputs: no rounded logits)
            lp, H, lse, sbar per row           one online pass of the forward kernel
  backward  logits recomputed (same GEMM), then one pass of the backward kernel writes
                dz = (g_lp * (onehot(t) - p) - g_H * p * (z - sbar)) / T
            over the logits buffer (16-bit x: into the first half of each fp32 row), then
            dX[chunk] = dz @ W, dW (+)= dz.T @ x[chunk], db += sum(dz).
The backward recomputes the logits (dz depends on the per-row g_lp and g_H, unknown in the
forward): 4 GEMMs where the materialised path does 3, for memory of one (chunk, vocab) fp32
buffer instead of the logits and their gradient.  dW accumulates in the weight dtype.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .._triton import tl, triton
from ..backend import interpreter_on
from ..config import WARPS, Config, knob, pow2
from ..dispatch import call, register
from ..op import Case, Impl, Op
from ._common import next_pow2, to_dtype, triton_available, warps_for
from .linear_softmax import (FLOOR, TARGET_DTYPES, MiB, chunk_grads, chunk_spans, device_kind, linear_plan,
                             load_logits, online_softmax, out_of_range, zero_row)


def fused_linear_logprobs_ref(x, weight, target, bias=None, temperature: float = 1.0, ignore_index: int = -100):
    """(lp, H) of x (tokens, hidden) from materialised fp32 (fp64 inputs: fp64) logits."""
    wide = torch.promote_types(x.dtype, torch.float32)
    z = F.linear(x.to(wide), weight.to(wide), None if bias is None else bias.to(wide)) / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    bad = out_of_range(target, ignore_index, z.shape[-1])
    idx = torch.where(valid & ~bad, target, 0).unsqueeze(-1)
    lp = logp.gather(-1, idx).squeeze(-1)
    # a target outside [0, vocab): the kernels' NaN, with their gradient, that of -lse (no target term)
    lp = torch.where(bad, lp - z.gather(-1, idx).squeeze(-1) + float("nan"), lp)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), device=x.device)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


@triton.jit
def _logprobs_fwd_kernel(L, stride_l, B, T, LP, ENT, LSE, SBAR, V, inv_t, ignore_index,
                         BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One row per program, one online pass over the vocab (the family's online_softmax): running max m,
    d = sum exp(z - m) and s = sum exp(z - m) * (z - m), shifted so the entropy keeps fp32 precision."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row).to(tl.int64)
    if t == ignore_index:
        tl.store(LP + row, 0.0)
        tl.store(ENT + row, 0.0)
        tl.store(LSE + row, 0.0)
        tl.store(SBAR + row, 0.0)
        return
    p_l = L + row * stride_l
    m, d, s, _ = online_softmax(p_l, B, V, inv_t, 1.0, BLOCK_V, HAS_BIAS=HAS_BIAS, TEMPERED=True, ENTROPY=True)
    log_d = tl.log(d)
    lse = m + log_d
    in_range = (t >= 0) & (t < V)
    z_t = load_logits(p_l, B, t, in_range, inv_t, HAS_BIAS=HAS_BIAS, TEMPERED=True)
    tl.store(LP + row, tl.where(in_range, z_t - lse, float("nan")))
    tl.store(ENT + row, log_d - s / d)
    tl.store(LSE + row, lse)
    tl.store(SBAR + row, m + s / d)            # sum_j p_j z_j


@triton.jit
def _logprobs_bwd_kernel(L, stride_l, DZ, stride_dz, B, T, LSE, SBAR, GLP, GH, V, inv_t, ignore_index,
                         BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GLP: tl.constexpr,
                         HAS_GH: tl.constexpr, NARROW: tl.constexpr, RNE_BF16: tl.constexpr):
    """dz of one row in one pass.  NARROW: dz (16-bit) is written over the first half of the row's
    fp32 logits; block k's store covers fp32 elements [k B / 2, (k + 1) B / 2), all loaded by this
    or earlier iterations, and the barrier makes every warp finish this block's loads first."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row).to(tl.int64)
    p_l = L + row * stride_l
    p_dz = DZ + row * stride_dz
    if t == ignore_index:
        zero_row(p_dz, V, BLOCK_V)
        return
    lse = tl.load(LSE + row)
    sbar = tl.load(SBAR + row)
    g_lp = 0.0
    g_h = 0.0
    if HAS_GLP:
        g_lp = tl.load(GLP + row).to(tl.float32)
    if HAS_GH:
        g_h = tl.load(GH + row).to(tl.float32)
    o_v = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        o = start + o_v
        m_v = o < V
        z = load_logits(p_l, B, o, m_v, inv_t, HAS_BIAS=HAS_BIAS, TEMPERED=True)
        p = tl.exp(z - lse)
        g = -p * (g_lp + g_h * (z - sbar))
        g = tl.where(o == t, g + g_lp, g) * inv_t
        if NARROW:
            tl.debug_barrier()
        tl.store(p_dz + o, to_dtype(g, DZ.dtype.element_ty, RNE_BF16), mask=m_v)


_FP32_OUT: dict = {}


def _fp32_out(device: torch.device) -> bool:
    """Whether cuBLAS here stores a 16-bit GEMM's fp32 accumulator (torch.mm out_dtype, torch >= 2.8,
    CUDA; probed once per device).  Elsewhere the logits keep the input dtype on GPU."""
    key = str(device)
    if key not in _FP32_OUT:
        try:
            a = torch.zeros(1, 1, device=device, dtype=torch.bfloat16)
            _FP32_OUT[key] = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_OUT[key] = False
    return _FP32_OUT[key]


def _logits_dtype(x: torch.Tensor) -> torch.dtype:
    if x.dtype == torch.float32 or x.device.type == "cpu" or _fp32_out(x.device):
        return torch.float32
    return x.dtype


def _chunk_logits(xc: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (rows, vocab) = xc @ weight.T in out's dtype, accumulated in fp32."""
    if out.dtype == xc.dtype:
        return torch.matmul(xc, weight.t(), out=out)
    if xc.device.type == "cpu":          # the interpreter's tests: exact fp32 products of 16-bit inputs
        return torch.matmul(xc.float(), weight.t().float(), out=out)
    return torch.mm(xc, weight.t(), out_dtype=out.dtype, out=out)


def _buffer(x: torch.Tensor, config, vocab: int) -> torch.Tensor:
    rows = max(e - s for s, e in chunk_spans(config.chunk, x.shape[0]))
    return torch.empty(rows, vocab, device=x.device, dtype=_logits_dtype(x))


def _forward(config, x, weight, target, bias, temperature, ignore_index):
    tokens, vocab = x.shape[0], weight.shape[0]
    f32 = dict(device=x.device, dtype=torch.float32)
    lp, ent, lse, sbar = (torch.empty(tokens, **f32) for _ in range(4))
    if tokens == 0:
        return (lp, ent), (lse, sbar)
    buf = _buffer(x, config, vocab)
    block = min(config.BLOCK_V, next_pow2(vocab))
    with torch.autocast(x.device.type, enabled=False):
        for s, e in chunk_spans(config.chunk, tokens):
            logits = _chunk_logits(x[s:e], weight, buf[: e - s])
            _logprobs_fwd_kernel[(e - s,)](
                logits, logits.stride(0), logits if bias is None else bias, target[s:e], lp[s:e], ent[s:e],
                lse[s:e], sbar[s:e], vocab, 1.0 / temperature, ignore_index,
                BLOCK_V=block, HAS_BIAS=bias is not None, num_warps=config.num_warps)
    return (lp, ent), (lse, sbar)


def _backward(config, args, saved, needs, g_lp, g_h):
    x, weight, target, bias, temperature, ignore_index = args
    lse, sbar = saved
    need_x, need_w, need_b = needs[0], needs[1], needs[3] and bias is not None
    tokens, vocab = x.shape[0], weight.shape[0]
    if not (need_x or need_w or need_b) or (g_lp is None and g_h is None):
        return None, None, None, None, None, None
    gx = torch.empty_like(x) if need_x else None
    gw = torch.empty_like(weight) if need_w else None
    gb = torch.zeros(vocab, device=x.device, dtype=torch.float32) if need_b else None
    g_lp = None if g_lp is None else g_lp.reshape(-1).float().contiguous()
    g_h = None if g_h is None else g_h.reshape(-1).float().contiguous()
    buf = _buffer(x, config, vocab)
    narrow = buf.dtype != x.dtype
    dz_all = buf.view(x.dtype)[:, :vocab] if narrow else buf
    block = min(config.bwd_BLOCK_V, next_pow2(vocab))
    with torch.autocast(x.device.type, enabled=False):
        for i, (s, e) in enumerate(chunk_spans(config.chunk, tokens)):
            xc = x[s:e]
            logits, dz = buf[: e - s], dz_all[: e - s]
            _chunk_logits(xc, weight, logits)
            _logprobs_bwd_kernel[(e - s,)](
                logits, logits.stride(0), dz, dz.stride(0), logits if bias is None else bias, target[s:e],
                lse[s:e], sbar[s:e], lse if g_lp is None else g_lp[s:e], lse if g_h is None else g_h[s:e],
                vocab, 1.0 / temperature, ignore_index, BLOCK_V=block, HAS_BIAS=bias is not None,
                HAS_GLP=g_lp is not None, HAS_GH=g_h is not None, NARROW=narrow, RNE_BF16=interpreter_on(),
                num_warps=config.bwd_num_warps)
            chunk_grads(dz, xc, weight, (s, e), gx, gw, gb, first=i == 0)
    return gx, gw, None, None if gb is None else gb.to(bias.dtype), None, None


def _fake(config, x, weight, target, bias, temperature, ignore_index):
    lp, ent, lse, sbar = (x.new_empty((x.shape[0],), dtype=torch.float32) for _ in range(4))
    return (lp, ent), (lse, sbar)


# token rows per chunk (0: all): powers of two and their 1.5x, so a budget-derived cap lands near
LADDER = (4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


@dataclasses.dataclass(frozen=True)
class LogProbsConfig(Config):
    chunk: int = knob(0, (0, *LADDER))
    BLOCK_V: int = knob(4096, pow2(16, 32768))        # forward kernel: vocab columns per loop trip
    num_warps: int = knob(8, WARPS)
    bwd_BLOCK_V: int = knob(4096, pow2(16, 32768))
    bwd_num_warps: int = knob(8, WARPS)


def _dims(x, weight, target, bias, temperature, ignore_index) -> dict:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_linear_logprobs takes x (tokens, hidden) and weight (vocab, hidden); "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    tokens, vocab = x.shape[0], weight.shape[0]
    if target.shape != (tokens,) or target.dtype not in TARGET_DTYPES:
        raise ValueError(f"fused_linear_logprobs: target must be integer class ids (int64 or int32) of shape "
                         f"({tokens},); got {target.dtype} {tuple(target.shape)}")
    if target.device != x.device:
        raise ValueError(f"fused_linear_logprobs: target is on {target.device}, x on {x.device}: move the target there")
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"fused_linear_logprobs: bias must have shape ({vocab},); got {tuple(bias.shape)}")
    if vocab < 1 or not temperature > 0.0:
        raise ValueError(f"fused_linear_logprobs needs vocab >= 1 and temperature > 0; got vocab {vocab}, "
                         f"temperature {temperature}")
    return {"tokens": tokens, "hidden": x.shape[1], "vocab": vocab}


def fused_linear_logprobs(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          bias: torch.Tensor | None = None, *, temperature: float = 1.0, ignore_index: int = -100,
                          return_entropy: bool = False):
    """log p(target | x) under softmax((x @ weight.T + bias) / temperature), without the logits:
    x (..., hidden); weight (vocab, hidden); target (...) integer ids with x's leading dims (shift
    labels before the call); bias (vocab,) or None, cast as fused_linear_cross_entropy casts them.
    Returns fp32 log-probs of target's shape (0 where target == ignore_index), and with
    return_entropy=True also the entropy of the tempered distribution (fp32, 0 at ignored rows).
    Example: h (4, 2048, 2560) bf16, W (151936, 2560) bf16, y (4, 2048) -> lp (4, 2048) fp32.
    """
    hidden = x.shape[-1]
    if target.shape != x.shape[:-1]:
        raise ValueError(f"fused_linear_logprobs: target {tuple(target.shape)} must have x's leading dims "
                         f"{tuple(x.shape[:-1])} (x is {tuple(x.shape)})")
    if torch.is_autocast_enabled(x.device.type):     # weight and bias follow x
        x = x.to(torch.get_autocast_dtype(x.device.type))
    weight = weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    lp, ent = call(OP, x.reshape(-1, hidden).contiguous(), weight, target.reshape(-1).contiguous(), bias,
                   float(temperature), int(ignore_index))
    lp = lp.view(target.shape)
    return (lp, ent.view(target.shape)) if return_entropy else lp


# Bytes the chunk's logits buffer (fp32, rows x vocab) may take.  The memory target is a peak at
# most 1/4 of torch.compile's materialised path, which holds the bf16 logits and their gradient
# (at T16384 V151936: 10 GB, plus dW): so a chunk takes at most tokens/16 rows (its fp32 buffer
# is 1/8 of the bf16 logits), within the arch budget (1 GiB on hopper and blackwell: 1536 rows at
# V151936; 512 MiB elsewhere; not measured yet) and never below the family's floor
# (linear_softmax.FLOOR: 256 rows on a GPU), rounded down to LADDER.
_BUDGET = {"hopper": 1024 * MiB, "blackwell": 1024 * MiB, "cpu": 16 * 1024}
_OTHER_BUDGET = 512 * MiB


def chunk_cap(arch, dims: dict, share: int = 16) -> int:
    """The most token rows one chunk may take (see above): 1/16 of the tokens, 1/8 for candidates (`share`)."""
    kind = device_kind(arch)
    rows = _BUDGET.get(arch.name, _OTHER_BUDGET) // (4 * dims["vocab"])
    if kind == "gpu":
        rows = min(rows, dims["tokens"] // share)
    return max([FLOOR[kind]] + [c for c in LADDER if c <= rows])


def _launch(arch, *, vocab: int, block: int, per_thread: int) -> dict:
    """One launch shape for both kernels: BLOCK_V columns (at most the padded vocab), `per_thread` fp32 values per
    thread."""
    block = min(block, next_pow2(vocab))
    warps = min(8, warps_for(block, per_thread, arch)) if arch.is_hip else warps_for(block, per_thread, arch)
    return {"BLOCK_V": block, "num_warps": warps, "bwd_BLOCK_V": block, "bwd_num_warps": warps}


def _heuristic(arch, dims, dtype):
    """The largest chunk under the cap (fewest dW passes, largest GEMMs); 4096 columns a loop trip,
    16 fp32 per thread (8 warps on NVIDIA, 4 wave64 on AMD: HIP-safe).  Not measured yet."""
    cap = chunk_cap(arch, dims)
    chunk = 0 if dims["tokens"] <= cap else cap
    if arch.name == "cpu":
        return LogProbsConfig(chunk=chunk, BLOCK_V=256, num_warps=4, bwd_BLOCK_V=256, bwd_num_warps=4)
    return LogProbsConfig(chunk=chunk, **_launch(arch, vocab=dims["vocab"], block=4096, per_thread=16))


# The GPU launches a sweep measures: columns a loop trip, fp32 values per thread.
LAUNCH_LADDER = (dict(block=4096, per_thread=16), dict(block=8192, per_thread=16), dict(block=8192, per_thread=32))


def _configs(arch, dims, dtype):
    tokens, kind = dims["tokens"], device_kind(arch)
    if kind == "cpu":   # the interpreter ignores warps: a multi-chunk run with a ragged tail block, one chunk
        return [LogProbsConfig(chunk=8, BLOCK_V=64, num_warps=4, bwd_BLOCK_V=128, bwd_num_warps=4),
                _heuristic(arch, dims, dtype)]
    # up to 1/8 of the tokens: on the H200 the 1/16 chunk peaked at 6-8% of torch.compile's
    # memory (the target allows 25%) and each halving of the chunk count saved time (256 -> 512
    # rows at T8192: 20.6 -> 16.8 ms), so the sweep measures the next larger chunk as well
    cap = chunk_cap(arch, dims, share=8)
    chunks = [c for c in LADDER if FLOOR[kind] <= c <= cap and c < tokens] + [0] * (tokens <= cap)
    launches = [_launch(arch, vocab=dims["vocab"], **step) for step in LAUNCH_LADDER]
    return list(dict.fromkeys(LogProbsConfig(chunk=c, **ln) for c in chunks[-3:] for ln in launches))


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens, hidden, vocab = dims["tokens"], dims["hidden"], dims["vocab"]
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * (2.0 / hidden ** 0.5)).to(device, dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[torch.rand(tokens, generator=g) < 0.1] = -100
    g_lp, g_h = (torch.randn(tokens, generator=g).to(device) for _ in range(2))
    return Case(args=(x, w, target.to(device), None, 1.0, -100), grads=(g_lp, g_h))


def _plan(preset, arch, quick):
    shapes = [(8192, 2048, 65536), (16384, 2560, 151936)]   # the two benchmark shapes of docs/logprobs.md
    more = [(4096, 2048, 65536), (4096, 2560, 151936), (8192, 2560, 151936)]
    return linear_plan(preset, arch, quick, shapes if quick else shapes + more)


OP = register(Op(
    name="fused_linear_logprobs", static=("hidden", "vocab"), dynamic=("tokens",), dims=_dims,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available),
           Impl("torch", fn=fused_linear_logprobs_ref)],
    config=LogProbsConfig, candidates=_configs, heuristic=_heuristic, fake=_fake, outputs=2, make_case=_make_case,
    plan=_plan, schema="Tensor x, Tensor weight, Tensor target, Tensor? bias, float temperature, int ignore_index",
    # dW adds one rounding in the weight dtype per chunk (token rows); the rest reduces in fp32
    reduce_len=lambda d: d["tokens"]))
