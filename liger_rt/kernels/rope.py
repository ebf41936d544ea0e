"""RoPE: Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (Llama/Qwen3).

Shapes (unsqueeze_dim=1, HF's layout): q (B, Hq, S, D), k (B, Hk, S, D), usually the views
``proj(x).view(B, S, H, D).transpose(1, 2)``; cos, sin (B, S, D) or (1, S, D) (broadcast over
batch).  Outputs q_embed, k_embed have q's and k's shapes in promote(x.dtype, cos.dtype,
sin.dtype), eager's dtype.  unsqueeze_dim=2 takes the (B, S, H, D) layout.

    q_embed, k_embed = liger_rt.ops.rope(q, k, cos, sin)     # q (4, 16, 2048, 128) bf16, cos (1, 2048, 128)

With x1 = x[..., :D/2], x2 = x[..., D/2:] and c1, c2 / s1, s2 the halves of cos / sin (the halves
are not assumed equal): y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2.  The backward is the transposed
rotation, dx1 = dy1*c1 + dy2*s2, dx2 = dy2*c2 - dy1*s1, recomputed from cos and sin (the only
saved tensors).  cos and sin get no gradient; when either requires one, the torch formula runs.
Every load is cast to fp32 and each output rounded once (eager bf16 rounds q*cos, rotate_half(q)*sin
and their sum), so ours sits closer to the fp32 truth than eager's bf16 path.

Kernel: per position, one load of the cos/sin half-rows, then every q and k head rotated in
(BLOCK_H, D/2) tiles into fresh outputs (never in place: autograd may have saved q and k), laid
out (B, S, H, D) in memory like HF's q and k.  Minimum traffic per token, fwd and bwd alike: read
and write (Hq + Hk) * D values each, plus 2D of cos/sin.
"""
from __future__ import annotations

import dataclasses
import functools
import operator

import torch

from .._triton import tl, triton
from ..backend import interpreter_on
from ..config import WARPS, Config, knob, pow2
from ..dispatch import call, register
from ..dtypes import DTYPE_NAMES
from ..launch import bind, launch_memo
from ..op import Case, Impl, Op, check_dtype
from ._common import next_pow2, to_dtype, triton_available, warps_for

# A position's (BLOCK_H, D/2) half-tiles live in registers.  BLOCK_H * next_pow2(D/2) is capped at
# MAX_TILE fp32 (32 heads at D 256: 16 values per thread at 8 warps, twice for the two halves);
# an estimate, not measured on a GPU yet.  Larger heads loop over head tiles.
MAX_HEAD_DIM = 256
MAX_TILE = 4096


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    d2 = x.shape[-1] // 2
    return torch.cat((-x[..., d2:], x[..., :d2]), dim=-1)


def _rope_torch(q, k, cos, sin, unsqueeze_dim: int = 1):
    """What the Hugging Face attention runs, in the input dtypes (the `torch` implementation)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _out_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def rope_ref(q, k, cos, sin, unsqueeze_dim: int = 1):
    """fp32 compute of the HF formula, each output cast once to eager's dtype."""
    qe, ke = _rope_torch(q.float(), k.float(), cos.float(), sin.float(), unsqueeze_dim)
    return qe.to(_out_dtype(q, cos, sin)), ke.to(_out_dtype(k, cos, sin))


@triton.jit
def _rotate_heads(X, Y, off_x, off_y, stride_xh, stride_yh, c1, c2, s1, s2, m_d, H, D2,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr, RNE_BF16: tl.constexpr):
    """All H heads of one position, (BLOCK_H, BLOCK_D) tiles per half; unit head-dim stride."""
    o_d = tl.arange(0, BLOCK_D)
    for h0 in tl.range(0, H, BLOCK_H):
        o_h = h0 + tl.arange(0, BLOCK_H)
        mask = (o_h < H)[:, None] & m_d[None, :]
        p_x = X + off_x + o_h.to(tl.int64)[:, None] * stride_xh + o_d[None, :]
        x1 = tl.load(p_x, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p_x + D2, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:   # the transposed rotation
            y1 = x1 * c1[None, :] + x2 * s2[None, :]
            y2 = x2 * c2[None, :] - x1 * s1[None, :]
        else:
            y1 = x1 * c1[None, :] - x2 * s1[None, :]
            y2 = x2 * c2[None, :] + x1 * s2[None, :]
        p_y = Y + off_y + o_h.to(tl.int64)[:, None] * stride_yh + o_d[None, :]
        tl.store(p_y, to_dtype(y1, Y.dtype.element_ty, RNE_BF16), mask=mask)
        tl.store(p_y + D2, to_dtype(y2, Y.dtype.element_ty, RNE_BF16), mask=mask)


@triton.jit(do_not_specialize=["T", "S"])
def _rope_kernel(Q, K, COS, SIN, QO, KO,
                 stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_qob, stride_qos, stride_qoh, stride_kob, stride_kos, stride_koh,
                 stride_cb, stride_cs, stride_sb, stride_ss, T, S, HQ, HK, D2,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, POS: tl.constexpr,
                 BACKWARD: tl.constexpr, RNE_BF16: tl.constexpr):
    """Program p rotates positions p*POS .. p*POS + POS - 1 of the flattened (B*S) tokens; every
    tensor is addressed as (B, S, H, D) through its strides (stride_cb = 0 broadcasts cos/sin)."""
    o_d = tl.arange(0, BLOCK_D)
    for i in tl.static_range(POS):
        t = tl.program_id(0).to(tl.int64) * POS + i
        b = t // S
        s = t - b * S
        m_d = o_d < tl.where(t < T, D2, 0)   # a tail position (t >= T) loads and stores nothing
        p_c = COS + b * stride_cb + s * stride_cs + o_d
        p_s = SIN + b * stride_sb + s * stride_ss + o_d
        c1 = tl.load(p_c, mask=m_d, other=0.0).to(tl.float32)
        c2 = tl.load(p_c + D2, mask=m_d, other=0.0).to(tl.float32)
        s1 = tl.load(p_s, mask=m_d, other=0.0).to(tl.float32)
        s2 = tl.load(p_s + D2, mask=m_d, other=0.0).to(tl.float32)
        _rotate_heads(Q, QO, b * stride_qb + s * stride_qs, b * stride_qob + s * stride_qos, stride_qh, stride_qoh,
                      c1, c2, s1, s2, m_d, HQ, D2, BLOCK_HQ, BLOCK_D, BACKWARD, RNE_BF16)
        _rotate_heads(K, KO, b * stride_kb + s * stride_ks, b * stride_kob + s * stride_kos, stride_kh, stride_koh,
                      c1, c2, s1, s2, m_d, HK, D2, BLOCK_HK, BLOCK_D, BACKWARD, RNE_BF16)


def _check_head_dim(d: int) -> None:
    if d % 2:
        raise ValueError(f"rope: head_dim must be even (rotate_half pairs element i with i + D/2), got {d}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"rope triton kernel supports head_dim <= {MAX_HEAD_DIM}, got {d}; use liger_rt.ops.rope "
                         f"(dispatch picks torch there) or LIGER_RT_IMPL_ROPE=torch")


def _check_layout(q, k, cos, sin, unsqueeze_dim: int) -> None:
    if _kernel_layout(q, k, cos, sin, unsqueeze_dim) != unsqueeze_dim:
        raise ValueError(f"rope kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)} with unsqueeze_dim {unsqueeze_dim}: takes (B, H, S, D) q/k with "
                         f"unsqueeze_dim 1 or (B, S, H, D) with 2, and (B or 1, S, D) cos/sin on one device; "
                         f"liger_rt.ops.rope runs other shapes through torch")


def _bshd(x: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """x as a (B, S, H, D) view with unit head-dim stride (a copy only when that stride is not 1)."""
    v = x.transpose(1, 2) if unsqueeze_dim == 1 else x
    return v if v.stride(-1) == 1 else v.contiguous()


def _new_out(x: torch.Tensor, dtype: torch.dtype, unsqueeze_dim: int) -> torch.Tensor:
    """A fresh tensor of x's shape laid out (B, S, H, D) in memory (HF's q/k layout)."""
    if unsqueeze_dim == 1:
        b, h, s, d = x.shape
        return torch.empty((b, s, h, d), dtype=dtype, device=x.device).transpose(1, 2)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def _unit_d(x: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """_bshd's copy of x seen in x's own dims."""
    v = _bshd(x, unsqueeze_dim)
    return v.transpose(1, 2) if unsqueeze_dim == 1 else v


def _out_strides(h: int, s: int, d: int, unsqueeze_dim: int) -> tuple[tuple, tuple]:
    """(strides in q's or k's dim order, (batch, seq, head) strides) of an output laid out like
    _new_out's, by torch's contiguous rule (a size-0 dim counts as 1)."""
    sd = max(d, 1)
    sh = max(h, 1) * sd
    ss = max(s, 1) * sh
    return (ss, sd, sh, 1) if unsqueeze_dim == 1 else (ss, sh, sd, 1), (ss, sh, sd)


@launch_memo
def _launch_plan(config, backward: bool, unsqueeze_dim: int, q_shape, q_stride, k_shape, k_stride, cos_shape,
                 cos_stride, sin_stride):
    """(the two outputs' strides, the bound kernel or None (nothing to rotate), its scalar args).
    The inputs have unit head-dim strides and sin has cos's shape."""
    if unsqueeze_dim == 1:
        b, hq, s, d = q_shape
        hk = k_shape[1]
        sq, sk = (q_stride[0], q_stride[2], q_stride[1]), (k_stride[0], k_stride[2], k_stride[1])
    else:
        b, s, hq, d = q_shape
        hk = k_shape[2]
        sq, sk = q_stride[:3], k_stride[:3]
    _check_head_dim(d)
    qo_stride, sqo = _out_strides(hq, s, d, unsqueeze_dim)
    ko_stride, sko = _out_strides(hk, s, d, unsqueeze_dim)
    t = b * s
    if t == 0 or d == 0:
        return qo_stride, ko_stride, None, ()
    batch = cos_shape[0] > 1           # else batch stride 0: cos/sin broadcast over the batch
    kernel = bind(_rope_kernel, (triton.cdiv(t, config.POS),), BLOCK_HQ=min(next_pow2(hq), config.BLOCK_H),
                  BLOCK_HK=min(next_pow2(hk), config.BLOCK_H), BLOCK_D=next_pow2(d // 2), POS=config.POS,
                  BACKWARD=backward, RNE_BF16=interpreter_on(), num_warps=config.num_warps)
    return qo_stride, ko_stride, kernel, (*sq, *sk, *sqo, *sko, cos_stride[0] if batch else 0, cos_stride[1],
                                          sin_stride[0] if batch else 0, sin_stride[1], t, s, hq, hk, d // 2)


def _launch(xq, xk, cos, sin, unsqueeze_dim: int, q_dtype, k_dtype, backward: bool, config):
    """Rotate xq, xk (shapes checked by the caller) into fresh outputs laid out (B, S, H, D)."""
    if xq.stride(-1) != 1:
        xq = _unit_d(xq, unsqueeze_dim)
    if xk.stride(-1) != 1:
        xk = _unit_d(xk, unsqueeze_dim)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    qo_stride, ko_stride, kernel, scalars = _launch_plan(config, backward, unsqueeze_dim, xq.shape, xq.stride(),
                                                         xk.shape, xk.stride(), cos.shape, cos.stride(), sin.stride())
    qo = torch.empty_strided(xq.shape, qo_stride, dtype=q_dtype, device=xq.device)
    ko = torch.empty_strided(xk.shape, ko_stride, dtype=k_dtype, device=xk.device)
    if kernel is not None:
        kernel(xq, xk, cos, sin, qo, ko, *scalars)
    return qo, ko


def rope_fwd(q, k, cos, sin, unsqueeze_dim: int, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed), fresh tensors laid out (B, S, H, D) in memory."""
    _check_layout(q, k, cos, sin, unsqueeze_dim)
    return _launch(q, k, cos, sin, unsqueeze_dim, _out_dtype(q, cos, sin), _out_dtype(k, cos, sin), False, config)


@dataclasses.dataclass(frozen=True)
class RoPEConfig(Config):
    POS: int = knob(1, (1, 2, 3, 4))                 # positions per program (3: the interpreter's tail check)
    BLOCK_H: int = knob(16, pow2(1, MAX_TILE))       # heads per tile, at most next_pow2(heads)
    num_warps: int = knob(4, WARPS)


def _layout(q_shape, k_shape, cos_shape, sin_shape, q_dev, k_dev, cos_dev, sin_dev, unsqueeze_dim: int) -> int | None:
    if len(q_shape) != 4 or len(k_shape) != 4 or len(cos_shape) != 3 or sin_shape != cos_shape:
        return None
    ud = unsqueeze_dim + 4 if unsqueeze_dim < 0 else unsqueeze_dim   # cos.unsqueeze(-3) is unsqueeze(1)
    if ud not in (1, 2):
        return None
    sd = 2 if ud == 1 else 1
    b, s, d = q_shape[0], q_shape[sd], q_shape[-1]
    if ((k_shape[0], k_shape[sd], k_shape[-1]) != (b, s, d) or tuple(cos_shape[1:]) != (s, d)
            or cos_shape[0] not in (1, b)):
        return None
    if not (q_dev == k_dev == cos_dev == sin_dev):
        return None
    return ud


_layout_memo = functools.lru_cache(maxsize=4096, typed=True)(_layout)   # typed: 1.0 stays 1.0, as unmemoised


def _kernel_layout(q, k, cos, sin, unsqueeze_dim: int) -> int | None:
    """1 or 2 (the normalised unsqueeze_dim) when the kernel can take these shapes, else None;
    memoised, as the functional, the Op's dims and the launcher each ask on every call."""
    key = (q.shape, k.shape, cos.shape, sin.shape, q.device, k.device, cos.device, sin.device, unsqueeze_dim)
    if not torch.compiler.is_compiling():
        try:
            return _layout_memo(*key)
        except TypeError:   # symbolic shapes: a SymInt does not hash
            pass
    return _layout(*key)


def _dims(q, k, cos, sin, unsqueeze_dim) -> dict:
    _check_layout(q, k, cos, sin, unsqueeze_dim)
    if not all(t.dtype.is_floating_point for t in (q, k, cos, sin)):
        raise TypeError(f"rope: unsupported dtypes q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype}; "
                        f"accepted: floating point dtypes")
    h, s = (1, 2) if unsqueeze_dim == 1 else (2, 1)
    return {"heads_q": q.shape[h], "heads_k": k.shape[h], "head_dim": q.shape[-1], "tokens": q.shape[0] * q.shape[s]}


def _forward(config, q, k, cos, sin, unsqueeze_dim):
    return rope_fwd(q, k, cos, sin, unsqueeze_dim, config), ()


def _backward(config, args, saved, needs, dq_embed, dk_embed):
    """The transposed rotation of the upstream gradients (any strides; None: an unused output)."""
    q, k, cos, sin, unsqueeze_dim = args
    if dq_embed is None:
        dq_embed = q.new_zeros(q.shape, dtype=_out_dtype(q, cos, sin))
    if dk_embed is None:
        dk_embed = k.new_zeros(k.shape, dtype=_out_dtype(k, cos, sin))
    dq, dk = _launch(dq_embed, dk_embed, cos, sin, unsqueeze_dim, q.dtype, k.dtype, True, config)
    return dq, dk, None, None, None


def _fake(config, q, k, cos, sin, unsqueeze_dim):
    return (_new_out(q, _out_dtype(q, cos, sin), unsqueeze_dim),
            _new_out(k, _out_dtype(k, cos, sin), unsqueeze_dim)), ()


def _other_float(dtype: torch.dtype) -> bool:
    """A float dtype the kernels do not take (fp64, fp8): the functional runs the reference (fp64), or refuses."""
    return dtype.is_floating_point and dtype not in DTYPE_NAMES


_LAYOUTS = ("valid: q, k (B, H, S, D) with cos, sin (B or 1, S, D) and unsqueeze_dim=1, or q, k (B, S, H, D) "
            "with unsqueeze_dim=2")


def _broadcastable(a, b) -> bool:
    """Whether shapes `a` and `b` broadcast together (torch's rule: aligned from the right, equal or 1)."""
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b)))


def _check_even(q, k) -> None:
    if q.dim() < 1 or k.dim() < 1 or q.shape[-1] % 2 or k.shape[-1] % 2:
        raise ValueError(f"rope: head_dim must be even (rotate_half pairs element i with i + D/2); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")


def _index(unsqueeze_dim) -> int:
    """An integer unsqueeze_dim (a NumPy integer or 0-d integer tensor too) as an int; TypeError for anything else
    (a bool, a float: torch's unsqueeze refuses them, where the kernels' layout check would take 1.0 and True)."""
    if not isinstance(unsqueeze_dim, bool):
        try:
            return operator.index(unsqueeze_dim)
        except TypeError:      # a float tensor has __index__ and refuses it
            pass
    raise TypeError(f"rope: unsqueeze_dim must be an int (1: q, k (B, H, S, D); 2: q, k (B, S, H, D)), "
                    f"got {unsqueeze_dim!r}")


def _check_any_layout(q, k, cos, sin, unsqueeze_dim) -> None:
    """rope's prologue where HF's formula runs (_dims checks the kernels' layouts): dtypes, an even head_dim, and
    cos and sin that broadcast with q and with k after unsqueeze(unsqueeze_dim), as HF's formula needs (rope has
    made unsqueeze_dim an int)."""
    for what, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_dtype("rope", what, t, OP.accepted_dtypes)
    _check_even(q, k)
    if not -cos.dim() - 1 <= unsqueeze_dim <= cos.dim():
        raise ValueError(f"rope: unsqueeze_dim={unsqueeze_dim!r} does not index cos {tuple(cos.shape)}; {_LAYOUTS}")
    for c_name, c in (("cos", cos), ("sin", sin)):
        shape = c.unsqueeze(unsqueeze_dim).shape
        for x_name, x in (("q", q), ("k", k)):
            if not _broadcastable(shape, x.shape):
                raise ValueError(f"rope: {c_name} {tuple(c.shape)} unsqueezed at dim {unsqueeze_dim} does not "
                                 f"broadcast with {x_name} {tuple(x.shape)}; {_LAYOUTS}")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids=None,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary_pos_emb (position_ids is ignored, as HF does); other shapes where cos and sin broadcast to
    q and k, fp64, and cos/sin that want a gradient run HF's formula; anything else raises, naming the layouts."""
    if type(unsqueeze_dim) is not int:
        unsqueeze_dim = _index(unsqueeze_dim)
    ud = _kernel_layout(q, k, cos, sin, unsqueeze_dim)
    if (ud is None or _other_float(k.dtype) or _other_float(cos.dtype) or _other_float(sin.dtype) or k.numel() == 0
            or cos.requires_grad or sin.requires_grad):
        _check_any_layout(q, k, cos, sin, unsqueeze_dim)
        return OP.reference(q, k, cos, sin, int(unsqueeze_dim))
    _check_even(q, k)
    return call(OP, q, k, cos, sin, ud)


def _make_case(dims, dtype, device):
    """HF's layout: q, k transposed (B, S, H, D) views; cos/sin (1, S, D), random, unequal halves."""
    g = torch.Generator(device="cpu").manual_seed(0)
    hq, hk, d, t = dims["heads_q"], dims["heads_k"], dims["head_dim"], dims["tokens"]
    b = 2 if t % 2 == 0 and t >= 4 else 1
    s = t // b
    q, k = (torch.randn(b, s, h, d, generator=g).to(device, dtype).transpose(1, 2).requires_grad_() for h in (hq, hk))
    angle = 4.0 * torch.rand(1, s, d, generator=g)
    cos, sin = angle.cos().to(device, dtype), angle.sin().to(device, dtype)
    grads = tuple(torch.randn(b, h, s, d, generator=g).to(device, dtype) for h in (hq, hk))
    return Case(args=(q, k, cos, sin, 1), grads=grads)


def _config(arch, dims, *, pos: int, per_thread: int, split: int = 1) -> RoPEConfig:
    """POS positions per program; BLOCK_H heads per tile (all of the larger head count, divided by
    `split`, within MAX_TILE); warps so one half-tile gives `per_thread` values to each thread."""
    block_d = next_pow2(max(1, dims["head_dim"] // 2))
    heads = next_pow2(max(dims["heads_q"], dims["heads_k"]))
    block_h = max(1, min(heads // split, MAX_TILE // block_d))
    return RoPEConfig(POS=pos, BLOCK_H=block_h, num_warps=warps_for(block_h * block_d, per_thread, arch))


def _heuristic(arch, dims, dtype):
    """One position per program, all heads in one tile, 8 values per thread per half-tile (one
    16-byte bf16 vector per load): 4 warps at Qwen3-1.7B's 16 q heads x D 128; 8192 tokens are
    8192 programs, several waves on 132 SMs.  Not measured on a GPU yet: the sweep decides."""
    return _config(arch, dims, pos=1, per_thread=8)


# The GPU tuning space: positions per program, values per thread per half-tile, and (split) head tiles of
# 1/split of the heads.
LADDER = (
    dict(pos=1, per_thread=8), dict(pos=1, per_thread=4), dict(pos=1, per_thread=16),
    dict(pos=2, per_thread=8), dict(pos=2, per_thread=4), dict(pos=2, per_thread=16),
    dict(pos=4, per_thread=8), dict(pos=4, per_thread=16),
    dict(pos=1, per_thread=8, split=2), dict(pos=2, per_thread=8, split=2), dict(pos=1, per_thread=4, split=2),
)


def _configs(arch, dims, dtype):
    if arch.name == "cpu":  # the interpreter ignores warps: cover the code paths (head-tile loop, POS tails)
        return [_heuristic(arch, dims, dtype), RoPEConfig(POS=3, BLOCK_H=1, num_warps=1),
                RoPEConfig(POS=2, BLOCK_H=2, num_warps=2)]
    return [_config(arch, dims, **step) for step in LADDER]   # deduplicated by the runtime


def _supports(dims, dtype):
    if dims["head_dim"] % 2:
        return f"odd head_dim {dims['head_dim']} (rotate_half needs pairs)"
    if dims["head_dim"] > MAX_HEAD_DIM:
        return f"head_dim {dims['head_dim']} > {MAX_HEAD_DIM} (a position's half-rows in registers)"
    return None


def _plan(preset, arch, quick):
    cpu = arch.name == "cpu"
    if preset is not None and (preset.tiny or not cpu):
        heads = [(preset.heads, preset.kv_heads, preset.head_dim)]
    else:   # tiny on cpu; Qwen3-1.7B (16 q / 8 kv heads) and Llama/Qwen3-4B-style 32 / 8, D 128
        heads = [(4, 2, 16)] if cpu else [(16, 8, 128), (32, 8, 128)]
    if cpu:
        tokens = (8,) if quick else (8, 32)
    elif preset is not None:
        tokens = preset.quick_tokens if quick else preset.tokens
    else:
        tokens = (8192,) if quick else (4096, 8192)
    return [{"heads_q": hq, "heads_k": hk, "head_dim": d, "tokens": t} for hq, hk, d in heads for t in tokens]


def _bwd_fake(tensors, saved, grads, unsqueeze_dim, needs, config):
    """dq, dk laid out (B, S, H, D) like HF's q and k, as the kernel writes them (the runtime's
    default fake promises contiguous gradients, and inductor checks the promised layout)."""
    q, k = tensors[0], tensors[1]
    return [_new_out(x, x.dtype, unsqueeze_dim) if need else q.new_empty(0) for x, need in zip((q, k), needs)] + \
        [q.new_empty(0), q.new_empty(0)]


OP = register(Op(
    name="rope", static=("heads_q", "heads_k", "head_dim"), dynamic=("tokens",), dims=_dims,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available, supports=_supports,
                keep=(2, 3)),   # the backward rotates the gradients by cos and sin: q and k are freed
           Impl("torch", fn=_rope_torch)],
    config=RoPEConfig, candidates=_configs, heuristic=_heuristic,
    schema="Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim", fake=_fake, bwd_fake=_bwd_fake, outputs=2,
    make_case=_make_case, plan=_plan, compiler_fuses=True))
