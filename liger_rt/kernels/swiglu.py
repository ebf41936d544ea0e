"""SwiGLU: y = silu(gate) * up, the gated activation of Llama/Qwen3/LFM2 MLPs.

Shapes: gate, up (..., cols) -> y (..., cols) in promote(gate.dtype, up.dtype).

    y = liger_rt.ops.swiglu(gate_proj(x), up_proj(x))       # (2, 128, 8192) bf16 each

Casting follows ``act_fn(gate) * up`` in the input dtype: silu is computed in fp32 and rounded to
the gate dtype, then multiplied by up in fp32 and rounded once more.

Kernels are elementwise over (ROWS, BLOCK_N) tiles of a 2-D view with one row stride per tensor,
so the halves of a fused gate_up projection (``gate_up.chunk(2, -1)``) are read in place.  The
backward recomputes sigmoid(gate) (cheaper than storing it).  Minimum traffic: fwd 3MN, bwd 5MN.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..backend import interpreter_on
from ..config import WARPS, Config, knob, pow2
from ..dispatch import call, register
from ..dtypes import DTYPES
from ..launch import bind, launch_memo
from ..op import Case, Impl, Op
from ._common import as_rows, next_pow2, row_layout, row_plan, to_dtype, triton_available, warps_for


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp32 compute; silu(gate) rounded to gate.dtype before the multiply, as the eager module does."""
    s = F.silu(gate.float()).to(gate.dtype)
    return (s.float() * up.float()).to(torch.promote_types(gate.dtype, up.dtype))


def _swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What the Hugging Face MLP runs (the `torch` implementation)."""
    return F.silu(gate) * up


@triton.jit
def _tile(M, N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Program -> (row offsets, column offsets, mask); column blocks vary fastest (memory order)."""
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(N, BLOCK_N)
    o_m = (pid // n_col_blocks) * ROWS + tl.arange(0, ROWS)
    o_n = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (o_m < M)[:, None] & (o_n < N)[None, :]
    return o_m.to(tl.int64)[:, None], o_n[None, :], mask


@triton.jit(do_not_specialize=["M"])
def _swiglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, M, N,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_m, o_n, mask = _tile(M, N, BLOCK_N, ROWS)
    g = tl.load(G + o_m * stride_g + o_n, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + o_m * stride_u + o_n, mask=mask, other=0.0).to(tl.float32)
    s = to_dtype(g * tl.sigmoid(g), G.dtype.element_ty, RNE_BF16).to(tl.float32)
    tl.store(Y + o_m * stride_y + o_n, to_dtype(s * u, Y.dtype.element_ty, RNE_BF16), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _swiglu_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, M, N,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_m, o_n, mask = _tile(M, N, BLOCK_N, ROWS)
    dy = tl.load(DY + o_m * stride_dy + o_n, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + o_m * stride_g + o_n, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + o_m * stride_u + o_n, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    s = g * sig
    du = dy * to_dtype(s, G.dtype.element_ty, RNE_BF16).to(tl.float32)
    dg = dy * u * (sig + s * (1.0 - sig))          # silu'(g) = sig * (1 + g * (1 - sig))
    tl.store(DG + o_m * stride_dg + o_n, to_dtype(dg, DG.dtype.element_ty, RNE_BF16), mask=mask)
    tl.store(DU + o_m * stride_du + o_n, to_dtype(du, DU.dtype.element_ty, RNE_BF16), mask=mask)


def _rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int]:
    """row_layout(t, n); at n == 1 as_rows, which passes a one-element tensor's own stride."""
    if n > 1:
        return row_layout(t, n)
    t2 = as_rows(t, n)
    return t2, t2.shape[0], t2.stride(0)


@launch_memo
def _launch(kernel, config, num_warps: int, m: int, n: int):
    block_n = min(config.BLOCK_N, next_pow2(n))
    return bind(kernel, (triton.cdiv(m, config.ROWS) * triton.cdiv(n, block_n),), BLOCK_N=block_n, ROWS=config.ROWS,
                RNE_BF16=interpreter_on(), num_warps=num_warps)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, config) -> torch.Tensor:
    n = gate.shape[-1]
    (g2, m, stride_g), (u2, _, stride_u) = _rows(gate, n), _rows(up, n)
    dtype = gate.dtype if up.dtype == gate.dtype else torch.promote_types(gate.dtype, up.dtype)
    y = torch.empty_like(gate, dtype=dtype, memory_format=torch.contiguous_format)    # rows of n
    if m > 0 and n > 0:
        _launch(_swiglu_fwd_kernel, config, config.num_warps, m, n)(g2, u2, y, stride_g, stride_u, n, m, n)
    return y


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dgate in gate.dtype, dup in up.dtype), fresh contiguous tensors."""
    n = gate.shape[-1]
    (g2, m, stride_g), (u2, _, stride_u), (dy2, _, stride_dy) = _rows(gate, n), _rows(up, n), _rows(dy, n)
    dg = torch.empty_like(gate, memory_format=torch.contiguous_format)    # rows of n
    du = torch.empty_like(up, memory_format=torch.contiguous_format)
    if m > 0 and n > 0:
        _launch(_swiglu_bwd_kernel, config, config.bwd_num_warps, m, n)(dy2, g2, u2, dg, du, stride_dy, stride_g,
                                                                        stride_u, n, n, m, n)
    return dg, du


@dataclasses.dataclass(frozen=True)
class SwiGLUConfig(Config):
    BLOCK_N: int = knob(1024, pow2(1, 16384))        # columns per tile (at most next_pow2(cols))
    ROWS: int = knob(1, pow2(1, 16384))              # rows per tile (narrow cols: tile // BLOCK_N)
    num_warps: int = knob(4, WARPS)                  # forward
    bwd_num_warps: int = knob(4, WARPS)


def _dims(gate, up, name: str = "swiglu") -> dict:
    if gate.shape != up.shape or gate.dim() < 1:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape "
                         f"(..., cols)")
    if gate.device != up.device:
        raise ValueError(f"{name}: gate on {gate.device}, up on {up.device}; both must be on one device")
    if not up.dtype.is_floating_point:
        raise TypeError(f"{name}: unsupported up dtype {up.dtype}; accepted: floating point dtypes")
    n = gate.shape[-1]
    return {"rows": gate.numel() // n if n else 0, "cols": n}


def _forward(config, gate, up):
    return (swiglu_fwd(gate, up, config),), ()


def _backward(config, args, saved, needs, dy):
    return swiglu_bwd(dy, *args, config)


def _fake(config, gate, up):
    return (gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype)),), ()


def run_gated(op: Op, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A gated activation's functional: other float dtypes (fp64) run the reference, the kernels compute in fp32."""
    if up.dtype not in DTYPES.values() and up.dtype.is_floating_point:
        op.dims(gate, up)                                                 # no broadcasting there either
        return op.reference(gate, up)
    return call(op, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate, up (..., cols).  Dispatched per call."""
    return run_gated(OP, gate, up)


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    m, n = dims["rows"], dims["cols"]
    gate = (2.0 * torch.randn(m, n, generator=g)).to(device, dtype).requires_grad_()
    up = torch.randn(m, n, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    return Case(args=(gate, up), grads=(dy,))


def _config(arch, cols: int, tile: int, fwd_per_thread: int, bwd_per_thread: int) -> SwiGLUConfig:
    block_n = min(tile, next_pow2(cols))
    rows = max(1, tile // block_n)
    return SwiGLUConfig(BLOCK_N=block_n, ROWS=rows, num_warps=warps_for(rows * block_n, fwd_per_thread, arch),
                        bwd_num_warps=warps_for(rows * block_n, bwd_per_thread, arch))


def _heuristic(arch, dims, dtype):
    """4096-element tiles, 16 values per thread (two 16-byte vectors of bf16 per tensor): small
    enough that several programs stay resident per SM in the 5-stream backward (~80 registers),
    large enough that the forward streams like Liger-Kernel's 8192x16-warp rows (4.25 TB/s on the
    H200, anchors/h200-anchor.json).  Estimate; sweeps decide."""
    if arch.name == "cpu":
        return _config(arch, dims["cols"], 1024, 8, 8)
    return _config(arch, dims["cols"], 4096, 16, 16)


def _configs(arch, dims, dtype):
    n = dims["cols"]
    if arch.name == "cpu":  # the interpreter ignores warps: cover tiling paths (column blocks, rows)
        narrow = SwiGLUConfig(BLOCK_N=32, ROWS=8, num_warps=1, bwd_num_warps=1)
        return [_heuristic(arch, dims, dtype), narrow, _config(arch, n, 4096, 16, 16)]
    shapes = [(4096, 16, 16), (4096, 8, 8), (4096, 16, 8), (2048, 8, 8), (2048, 16, 16), (1024, 8, 8),
              (8192, 16, 16), (8192, 32, 16), (16384, 16, 16)]
    return [_config(arch, n, tile, fpt, bpt) for tile, fpt, bpt in shapes]   # deduplicated by the runtime


def _plan(preset, arch, quick):
    return row_plan(preset, arch, quick, "cols", preset and preset.intermediate, (96, 128), (8192, 12288),
                    (1024, 4096, 16384))


def gated_op(name: str, torch_fn, forward, backward) -> Op:
    """The spec of a gated activation act(gate) * up: swiglu's, and geglu's, which streams the same bytes and
    shares the checks, config and tuning space."""
    return register(Op(
        name=name, static=("cols",), dynamic=("rows",), dims=lambda gate, up: _dims(gate, up, name),
        impls=[Impl("triton", forward=forward, backward=backward, available=triton_available),
               Impl("torch", fn=torch_fn)],
        config=SwiGLUConfig, candidates=_configs, heuristic=_heuristic, schema="Tensor gate, Tensor up", fake=_fake,
        make_case=_make_case, plan=_plan, compiler_fuses=True))


OP = gated_op("swiglu", _swiglu_torch, _forward, _backward)
