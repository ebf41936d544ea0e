"""LFM2 gated short convolution: y = C * causal_depthwise_conv(B * x) (+ bias inside the conv).

`bcx` is the `in_proj` output (batch, seq, 3*hidden), split along the last dim into the B-gate, C-gate and x;
`weight` is (hidden, kernel) (HF's (hidden, 1, kernel) squeezed). One forward kernel reads bcx once and writes y
(no transposes, no B*x in memory); one backward kernel reads bcx and dy once, writes d(bcx) and fp32 partials.

    y = short_conv(bcx, weight)                      # bcx (2, 4096, 3*2048), weight (2048, 3)
    y = short_conv(bcx, weight, seq_idx=seq_idx)     # packed sequences (seq_idx_from_position_ids): no mixing
Numerics: fp32 throughout, one rounding to bcx's dtype (HF's bf16 path also rounds B*x and the conv output).
"""
from __future__ import annotations

import dataclasses

import torch

from .._triton import tl, triton
from ..config import WARPS, Config, knob, pow2
from ..dispatch import call, register
from ..op import Case, Impl, Op, check_dtype
from ._common import sm_count, triton_available, warps_for
from ._common import MAX_GRID_Y

MAX_KERNEL = 4  # LFM2 uses 3 (conv_L_cache); the weight-gradient kernel has 4 tap accumulators


def short_conv_ref(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 reference (also the `torch` impl): (batch, seq, 3H), (H, K) -> (batch, seq, H).

    out[t] = C[t] * (sum_k w[k] * (B*x)[t - (K-1) + k] + bias), taps before the sequence start (or in another
    packed sequence) reading zero: HF's F.conv1d(padding=K-1)[..., :T]."""
    w = weight.float().reshape(weight.shape[0], -1)      # HF's (hidden, 1, kernel) too
    T, K = bcx.shape[1], w.shape[-1]
    bg, c, x = bcx.float().chunk(3, dim=-1)
    u = bg * x
    z = u * w[:, K - 1]
    for k in range(K - 1):
        shift = K - 1 - k
        if shift >= T:
            continue
        src = torch.nn.functional.pad(u[:, : T - shift], (0, 0, shift, 0))
        if seq_idx is not None:
            same = torch.nn.functional.pad(seq_idx[:, shift:] == seq_idx[:, : T - shift], (shift, 0), value=False)
            src = src * same.unsqueeze(-1)
        z = z + src * w[:, k]
    if bias is not None:
        z = z + bias.float()
    return (c * z).to(bcx.dtype)


def seq_idx_from_position_ids(position_ids: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """Sequence ids of packed rows (a new one wherever the position does not follow the previous one): position_ids
    (batch, seq) or (seq,) -> int32 (batch, seq), e.g. [[0,1,2,0,1]] -> [[0,0,0,1,1]]; one row expanded to `batch`."""
    pos = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
    starts = pos[:, 1:] != pos[:, :-1] + 1
    idx = torch.nn.functional.pad(torch.cumsum(starts, dim=-1, dtype=torch.int32), (1, 0))
    return idx.expand(batch, -1) if batch is not None and idx.shape[0] != batch else idx


@triton.jit(do_not_specialize=["T"])
def _short_conv_fwd_kernel(
    BCX, W, BIAS, SEQ, Y, T, H, n_tblocks, s_xb, s_xt, s_yb, s_yt, s_sb, s_st, K: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SEQ: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // n_tblocks).to(tl.int64)
    o_t = (pid % n_tblocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_t = o_t < T
    m_h = o_h < H
    p_x = BCX + b * s_xb
    if HAS_SEQ:
        p_s = SEQ + b * s_sb
        b_seq = tl.load(p_s + o_t * s_st, mask=m_t, other=-1)
    b_z = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(K):
        o_src = o_t - (K - 1 - k)
        m_src = m_t & (o_src >= 0)
        if HAS_SEQ:
            if k < K - 1:
                m_src = m_src & (tl.load(p_s + o_src * s_st, mask=m_src, other=-2) == b_seq)
        m = m_src[:, None] & m_h[None, :]
        p = p_x + o_src.to(tl.int64)[:, None] * s_xt + o_h[None, :]
        b_b = tl.load(p, mask=m, other=0.0).to(tl.float32)
        b_x = tl.load(p + 2 * H, mask=m, other=0.0).to(tl.float32)
        b_w = tl.load(W + o_h * K + k, mask=m_h, other=0.0).to(tl.float32)
        b_z += b_w[None, :] * (b_b * b_x)
    if HAS_BIAS:
        b_z += tl.load(BIAS + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
    m = m_t[:, None] & m_h[None, :]
    o_t64 = o_t.to(tl.int64)[:, None]
    b_c = tl.load(p_x + o_t64 * s_xt + H + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(Y + b * s_yb + o_t64 * s_yt + o_h[None, :], (b_c * b_z).to(Y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def _short_conv_bwd_kernel(
    BCX, W, BIAS, SEQ, DY, DBCX, DW_PART, DB_PART, T, H, n_chunks, T_CHUNK, s_xb, s_xt, s_gb, s_gt, s_db, s_dt, s_sb,
    s_st, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program: BLOCK_H channels over T_CHUNK tokens of one batch row, in BLOCK_T steps.
    # dz = dy*C;  dC = dy*z (z recomputed);  du[t] = sum_j w[K-1-j] dz[t+j];  dB = du*x;
    # dx = du*B;  dw[k] += sum_t dz[t] * u[t-(K-1)+k] — every tap from the same loads of u.
    pid = tl.program_id(0)
    b = (pid // n_chunks).to(tl.int64)
    t_start = (pid % n_chunks) * T_CHUNK
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    p_x = BCX + b * s_xb
    p_g = DY + b * s_gb
    p_d = DBCX + b * s_db
    p_s = SEQ + b * s_sb
    # tile-shaped fp32 accumulators, one per tap, reduced over tokens once at the end (a
    # cross-warp tl.sum per step and tap would cost a shared-memory round trip each)
    b_dw0 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    b_dw1 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    b_dw2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    b_dw3 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    b_db = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    n_iter = tl.minimum(T_CHUNK, T - t_start)
    for i in range(0, n_iter, BLOCK_T):
        o_t = t_start + i + tl.arange(0, BLOCK_T)
        m_t = o_t < T
        m = m_t[:, None] & m_h[None, :]
        o_t64 = o_t.to(tl.int64)[:, None]
        if HAS_SEQ:
            b_seq = tl.load(p_s + o_t * s_st, mask=m_t, other=-1)
        p = p_x + o_t64 * s_xt + o_h[None, :]
        b_b = tl.load(p, mask=m, other=0.0).to(tl.float32)
        b_c = tl.load(p + H, mask=m, other=0.0).to(tl.float32)
        b_x = tl.load(p + 2 * H, mask=m, other=0.0).to(tl.float32)
        b_g = tl.load(p_g + o_t64 * s_gt + o_h[None, :], mask=m, other=0.0).to(tl.float32)
        b_dz = b_g * b_c
        # z and dw: taps read u at t - (K-1) + k
        b_z = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for k in tl.static_range(K):
            if k == K - 1:
                b_u = b_b * b_x
            else:
                o_src = o_t - (K - 1 - k)
                m_src = m_t & (o_src >= 0)
                if HAS_SEQ:
                    m_src = m_src & (tl.load(p_s + o_src * s_st, mask=m_src, other=-2) == b_seq)
                ms = m_src[:, None] & m_h[None, :]
                ps = p_x + o_src.to(tl.int64)[:, None] * s_xt + o_h[None, :]
                b_u = (tl.load(ps, mask=ms, other=0.0).to(tl.float32)
                       * tl.load(ps + 2 * H, mask=ms, other=0.0).to(tl.float32))
            b_w = tl.load(W + o_h * K + k, mask=m_h, other=0.0).to(tl.float32)
            b_z += b_w[None, :] * b_u
            if k == 0:
                b_dw0 += b_dz * b_u
            elif k == 1:
                b_dw1 += b_dz * b_u
            elif k == 2:
                b_dw2 += b_dz * b_u
            else:
                b_dw3 += b_dz * b_u
        if HAS_BIAS:
            b_z += tl.load(BIAS + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
            b_db += b_dz
        # du: output t+j read u[t] through tap K-1-j
        b_du = b_dz * tl.load(W + o_h * K + (K - 1), mask=m_h, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(1, K):
            o_dst = o_t + j
            m_dst = m_t & (o_dst < T)
            if HAS_SEQ:
                m_dst = m_dst & (tl.load(p_s + o_dst * s_st, mask=m_dst, other=-2) == b_seq)
            md = m_dst[:, None] & m_h[None, :]
            o_dst64 = o_dst.to(tl.int64)[:, None]
            b_dzj = (tl.load(p_g + o_dst64 * s_gt + o_h[None, :], mask=md, other=0.0).to(tl.float32)
                     * tl.load(p_x + o_dst64 * s_xt + H + o_h[None, :], mask=md, other=0.0).to(tl.float32))
            b_w = tl.load(W + o_h * K + (K - 1 - j), mask=m_h, other=0.0).to(tl.float32)
            b_du += b_w[None, :] * b_dzj
        pd = p_d + o_t64 * s_dt + o_h[None, :]
        dt = DBCX.dtype.element_ty
        tl.store(pd, (b_du * b_x).to(dt), mask=m)
        tl.store(pd + H, (b_g * b_z).to(dt), mask=m)
        tl.store(pd + 2 * H, (b_du * b_b).to(dt), mask=m)
    pid64 = pid.to(tl.int64)
    p_dw = DW_PART + pid64 * K * H + o_h
    tl.store(p_dw, tl.sum(b_dw0, axis=0), mask=m_h)
    if K > 1:
        tl.store(p_dw + H, tl.sum(b_dw1, axis=0), mask=m_h)
    if K > 2:
        tl.store(p_dw + 2 * H, tl.sum(b_dw2, axis=0), mask=m_h)
    if K > 3:
        tl.store(p_dw + 3 * H, tl.sum(b_dw3, axis=0), mask=m_h)
    if HAS_BIAS:
        tl.store(DB_PART + pid64 * H + o_h, tl.sum(b_db, axis=0), mask=m_h)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _seq_args(seq_idx, weight):
    """The seq_idx pointer and strides (weight as a never-read placeholder without it)."""
    if seq_idx is None:
        return weight, 0, 0
    return seq_idx, seq_idx.stride(0), seq_idx.stride(1)


def short_conv_fwd(bcx, weight, bias, seq_idx, config) -> torch.Tensor:
    """bcx (B, T, 3H) any strides with a unit last stride; returns y (B, T, H) contiguous."""
    _check_kernel(weight.shape[-1])
    B, T, H3 = bcx.shape
    H, K = weight.shape
    bcx = _last_dim_contiguous(bcx)
    weight = weight.contiguous()
    y = torch.empty(B, T, H, device=bcx.device, dtype=bcx.dtype)
    if y.numel() == 0:
        return y
    n_tb = triton.cdiv(T, config.BLOCK_T)
    seq, s_sb, s_st = _seq_args(seq_idx, weight)
    _short_conv_fwd_kernel[(B * n_tb, triton.cdiv(H, config.BLOCK_H))](
        bcx, weight, bias if bias is not None else weight, seq, y, T, H, n_tb,
        bcx.stride(0), bcx.stride(1), y.stride(0), y.stride(1), s_sb, s_st, K=K, HAS_BIAS=bias is not None,
        HAS_SEQ=seq_idx is not None, BLOCK_T=config.BLOCK_T, BLOCK_H=config.BLOCK_H, num_warps=config.num_warps)
    return y


def bwd_chunking(B: int, T: int, H: int, config, n_sm: int) -> tuple[int, int]:
    """(tokens per program, programs per batch row) of the backward grid: BWD_PROGRAMS_PER_SM programs per SM, so
    long sequences run few, long programs (few dw partials) and short ones still fill the device."""
    bt = config.BWD_BLOCK_T
    n_hb = -(-H // config.BWD_BLOCK_H)
    want = max(1, config.BWD_PROGRAMS_PER_SM * n_sm)
    steps = -(-T // bt)
    per_row = min(steps, max(1, -(-want // (B * n_hb))))
    chunk = -(-steps // per_row) * bt
    return chunk, -(-T // chunk)


def short_conv_bwd(bcx, weight, bias, seq_idx, dy, config):
    """Returns d(bcx) (B, T, 3H) in bcx's dtype, d(weight) (H, K), d(bias) (H,) or None."""
    B, T, H3 = bcx.shape
    H, K = weight.shape
    bcx = _last_dim_contiguous(bcx)
    dy = _last_dim_contiguous(dy)
    weight = weight.contiguous()
    dbcx = torch.empty(B, T, 3 * H, device=bcx.device, dtype=bcx.dtype)
    if dbcx.numel() == 0:
        return dbcx, torch.zeros_like(weight), (torch.zeros_like(bias) if bias is not None else None)
    chunk, n_chunks = bwd_chunking(B, T, H, config, sm_count(bcx.device))
    n_prog = B * n_chunks
    # fp32 partials: every (program, tap, channel) is written by the kernel, so no zero-fill
    dw_part = torch.empty(n_prog, K, H, device=bcx.device, dtype=torch.float32)
    db_part = torch.empty(n_prog, H, device=bcx.device, dtype=torch.float32) if bias is not None else dw_part
    seq, s_sb, s_st = _seq_args(seq_idx, weight)
    _short_conv_bwd_kernel[(n_prog, triton.cdiv(H, config.BWD_BLOCK_H))](
        bcx, weight, bias if bias is not None else weight, seq, dy, dbcx, dw_part, db_part, T, H, n_chunks, chunk,
        bcx.stride(0), bcx.stride(1), dy.stride(0), dy.stride(1), dbcx.stride(0), dbcx.stride(1), s_sb, s_st,
        K=K, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None,
        BLOCK_T=config.BWD_BLOCK_T, BLOCK_H=config.BWD_BLOCK_H, num_warps=config.bwd_num_warps)
    dw = dw_part.sum(0).t().to(weight.dtype).contiguous()
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dbcx, dw, db


@dataclasses.dataclass(frozen=True)
class ShortConvConfig(Config):
    BLOCK_T: int = knob(32, pow2(1, 256))             # forward tile: tokens x channels
    BLOCK_H: int = knob(128, pow2(16, 1024))
    num_warps: int = knob(8, WARPS)
    BWD_BLOCK_T: int = knob(16, pow2(1, 128))         # backward tile, one BLOCK_T step at a time
    BWD_BLOCK_H: int = knob(128, pow2(16, 512))
    BWD_PROGRAMS_PER_SM: int = knob(4, (1, 2, 3, 4, 6, 8, 12, 16))   # backward grid: chunks of tokens
    bwd_num_warps: int = knob(8, WARPS)


def _check_kernel(K: int) -> None:
    if not 1 <= K <= MAX_KERNEL:
        raise ValueError(f"the Triton short_conv takes kernel widths 1..{MAX_KERNEL} (LFM2 uses 3), got {K}; "
                         f"the torch implementation runs it (liger_rt.ops.short_conv dispatches there, "
                         f"or LIGER_RT_IMPL_SHORT_CONV=torch)")


def _dims(bcx, weight, bias, seq_idx) -> dict:
    if bcx.dim() != 3 or weight.dim() != 2 or bcx.shape[2] != 3 * weight.shape[0]:
        raise ValueError(f"short_conv takes bcx (batch, seq, 3*hidden), split into B, C and x, and weight (hidden, "
                         f"kernel) (squeeze HF's (hidden, 1, kernel)); got {tuple(bcx.shape)}, {tuple(weight.shape)}")
    B, T, _ = bcx.shape
    H, K = weight.shape
    if H < 1 or K < 1:
        raise ValueError(f"short_conv: weight (hidden, kernel) needs hidden >= 1 and kernel >= 1; got "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (H,):
        raise ValueError(f"short_conv: bias must have shape ({H},); got {tuple(bias.shape)}")
    for what, t in (("weight", weight), ("bias", bias)):
        check_dtype("short_conv", what, t, OP.accepted_dtypes)
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (B, T) or seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
            raise ValueError(f"short_conv: seq_idx must be an integer tensor of shape ({B}, {T}) "
                             f"(see seq_idx_from_position_ids); got {seq_idx.dtype} {tuple(seq_idx.shape)}")
        if seq_idx.device != bcx.device:
            raise ValueError(f"short_conv: seq_idx is on {seq_idx.device}, bcx on {bcx.device}")
    return {"batch": B, "seq": T, "hidden": H, "kernel": K}


def _forward(config, bcx, weight, bias, seq_idx):
    return (short_conv_fwd(bcx, weight, bias, seq_idx, config),), ()


def _backward(config, args, saved, needs, dy):
    dbcx, dw, db = short_conv_bwd(*args, dy, config)
    return dbcx, dw, db, None


def _fake(config, bcx, weight, bias, seq_idx):
    return (bcx.new_empty(bcx.shape[0], bcx.shape[1], weight.shape[0]),), ()


def short_conv(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """LFM2 gated short conv: (batch, seq, 3*hidden), (hidden, kernel) or (hidden, 1, kernel) -> (batch, seq, hidden).

    >>> y = short_conv(self.in_proj(h), self.conv.weight, self.conv.bias, seq_idx=seq_idx)   # Lfm2ShortConv, no cache
    """
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    if bias is not None and not bias.is_contiguous():     # the kernels read the bias with unit stride
        bias = bias.contiguous()
    return call(OP, bcx, weight, bias, seq_idx)


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    B, T, H, K = dims["batch"], dims["seq"], dims["hidden"], dims["kernel"]
    bcx = torch.randn(B, T, 3 * H, generator=g).to(device, dtype).requires_grad_()
    # LFM2's conv is bias-free (conv_bias=False in the released configs)
    w = (torch.randn(H, K, generator=g) / K ** 0.5).to(device, dtype).requires_grad_()
    dy = torch.randn(B, T, H, generator=g).to(device, dtype)
    return Case(args=(bcx, w, None, None), grads=(dy,))


# Tiles of BLOCK_T positions by BLOCK_H channels. The forward has 3 live tiles, the backward ~12 (dy, B, C, x, dz, z,
# du, the shifted taps and 4 dw accumulators), hence its smaller tiles and fewer elements per thread. Registers from
# ptxas (sm_90a) on Triton 3.9's PTX compiled offline, no spills: fwd 32x128 / 8 warps 64 regs (64x128: 104); bwd
# 16x128 / 8 warps 128 regs (162 with seq_idx), 32x128 / 8 warps 241. Sweeps (`liger-tune sweep --op short_conv`)
# override these.
_FWD_TILES = [dict(block_t=32, block_h=128), dict(block_t=64, block_h=128), dict(block_t=16, block_h=256),
              dict(block_t=64, block_h=64)]
_BWD_TILES = [dict(block_t=16, block_h=128), dict(block_t=32, block_h=128), dict(block_t=16, block_h=64),
              dict(block_t=8, block_h=256)]
_FWD_PER_THREAD, _BWD_PER_THREAD = 16, 8
# interpreter: cost grows with programs x steps, so few large tiles; the second of each covers several tiles and chunks
_CPU_FWD = [dict(block_t=16, block_h=32), dict(block_t=8, block_h=16)]
_CPU_BWD = [dict(block_t=8, block_h=32, progs=1), dict(block_t=4, block_h=16, progs=2)]


def _fwd_cfg(arch, *, block_t: int, block_h: int, per_thread: int = _FWD_PER_THREAD) -> dict:
    return {"BLOCK_T": block_t, "BLOCK_H": block_h, "num_warps": warps_for(block_t * block_h, per_thread, arch)}


def _bwd_cfg(arch, *, block_t: int, block_h: int, progs: int = 4, per_thread: int = _BWD_PER_THREAD) -> dict:
    """Backward knobs: BLOCK_T x BLOCK_H tiles, `progs` programs per SM, `per_thread` values per thread."""
    return {"BWD_BLOCK_T": block_t, "BWD_BLOCK_H": block_h, "BWD_PROGRAMS_PER_SM": progs,
            "bwd_num_warps": warps_for(block_t * block_h, per_thread, arch)}


def _heuristic(arch, dims, dtype):
    if arch.name == "cpu":
        return ShortConvConfig(**_fwd_cfg(arch, **_CPU_FWD[0]), **_bwd_cfg(arch, **_CPU_BWD[0]))
    # hopper: 32x128 tiles with 128/256 threads; AMD: the same tiles, half the warps (wave64).
    return ShortConvConfig(**_fwd_cfg(arch, **_FWD_TILES[0]), **_bwd_cfg(arch, **_BWD_TILES[0]))


def _configs(arch, dims, dtype):
    """The heuristic plus one half (fwd or bwd) varied at a time: their times add, so 4+4+2 configs, not a product."""
    base = _heuristic(arch, dims, dtype)
    if arch.name == "cpu":
        fwd = [_fwd_cfg(arch, **tile) for tile in _CPU_FWD]
        bwd = [_bwd_cfg(arch, **tile) for tile in _CPU_BWD]
    else:
        fwd = [_fwd_cfg(arch, **tile) for tile in _FWD_TILES]
        fwd.append(_fwd_cfg(arch, **_FWD_TILES[0], per_thread=2 * _FWD_PER_THREAD))
        bwd = [_bwd_cfg(arch, **tile) for tile in _BWD_TILES]
        bwd += [_bwd_cfg(arch, **_BWD_TILES[0], progs=progs) for progs in (8, 2)]
    return list(dict.fromkeys([base] + [base.replace(**half) for half in fwd + bwd]))


def _supports(dims, dtype):
    if not 1 <= dims["kernel"] <= MAX_KERNEL:
        return f"kernel width {dims['kernel']} outside 1..{MAX_KERNEL} (4 tap accumulators in the backward)"
    return None


def _launchable(config, dims, arch, dtype):
    """Why `config` cannot launch at `dims` (None: it can): both grids put channel blocks on their second axis,
    which holds at most MAX_GRID_Y programs (the tiles are far below Triton's largest block)."""
    for name, block_h in (("forward", config.BLOCK_H), ("backward", config.BWD_BLOCK_H)):
        if (blocks := -(-dims["hidden"] // block_h)) > MAX_GRID_Y:
            return f"its {name} grid has {blocks} channel blocks on its second axis, more than {MAX_GRID_Y}"
    return None


def _plan(preset, arch, quick):
    if preset is not None and not preset.model_type.startswith("lfm2"):
        return []
    K = preset.conv_kernel if preset is not None else 3
    if arch.name == "cpu":
        H = preset.hidden if preset is not None and preset.tiny else 32
        combos = [(1, 16)] if quick else [(1, 16), (2, 33)]
    else:
        H = preset.hidden if preset is not None else 2048
        seqs = (preset.quick_tokens if quick else preset.tokens) if preset is not None else \
            ((4096,) if quick else (1024, 4096, 16384, 65536))
        combos = [(1, t) for t in seqs] + ([(8, 4096)] if quick else [(8, 4096), (4, 16384)])
    return [{"batch": b, "seq": t, "hidden": H, "kernel": K} for b, t in dict.fromkeys(combos)]


OP = register(Op(
    name="short_conv", static=("hidden", "kernel"), dynamic=("batch", "seq"), dims=_dims, config=ShortConvConfig,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available, supports=_supports),
           Impl("torch", fn=short_conv_ref)],
    candidates=_configs, heuristic=_heuristic, launchable=_launchable, fake=_fake, make_case=_make_case, plan=_plan,
    schema="Tensor bcx, Tensor weight, Tensor? bias, Tensor? seq_idx", reduce_len=lambda d: d["batch"] * d["seq"]))
