"""The gated-MLP family: y = act(gate) * up (swiglu.py: silu, geglu.py: gelu_tanh), the activations of
Llama/Qwen3/LFM2 and Gemma MLPs.  Both ops stream the same bytes (fwd 3MN, bwd 5MN), so they share the
checks, the tile walk, the config, its tuning space and the op declaration.

Shapes: gate, up (..., cols) -> y (..., cols) in promote(gate.dtype, up.dtype).

    OP = gated_op("swiglu", _swiglu_torch, _forward, _backward)    # the whole declaration of an op
"""
from __future__ import annotations

import dataclasses

import torch

from .._triton import tl, triton
from ..config import WARPS, Config, knob, pow2
from ..dispatch import call, register
from ..dtypes import DTYPES
from ..op import REFERENCE_DTYPES, Case, Impl, Op
from ._common import block_problem, next_pow2, row_plan, triton_available, warps_for


@triton.jit
def _tile(M, N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Program -> (row offsets, column offsets, mask); column blocks vary fastest (memory order)."""
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(N, BLOCK_N)
    o_m = (pid // n_col_blocks) * ROWS + tl.arange(0, ROWS)
    o_n = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (o_m < M)[:, None] & (o_n < N)[None, :]
    return o_m.to(tl.int64)[:, None], o_n[None, :], mask


# The public name of the tile walk.  Its definition keeps the name `_tile`, which the op kernels call it
# by: the freshness hash of tuned rows covers each function's name and source.
tile = _tile


@dataclasses.dataclass(frozen=True)
class GatedMLPConfig(Config):
    BLOCK_N: int = knob(1024, pow2(1, 16384))        # columns per tile (at most next_pow2(cols))
    ROWS: int = knob(1, pow2(1, 16384))              # rows per tile (narrow cols: tile // BLOCK_N)
    num_warps: int = knob(4, WARPS)                  # forward
    bwd_num_warps: int = knob(4, WARPS)


ACCEPTED = (*DTYPES.values(), *REFERENCE_DTYPES)      # gate and up dtypes (fp64: the reference)


def dims(gate, up, name: str) -> dict:
    """{"rows", "cols"} of a call; a one-line error naming `name` for mismatched inputs."""
    if gate.shape != up.shape or gate.dim() < 1:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape "
                         f"(..., cols)")
    if gate.device != up.device:
        raise ValueError(f"{name}: gate on {gate.device}, up on {up.device}; both must be on one device")
    for what, t in (("gate", gate), ("up", up)):
        if t.dtype not in ACCEPTED:
            raise TypeError(f"{name}: unsupported {what} dtype {t.dtype}; accepted: floating point dtypes "
                            f"{', '.join(map(str, ACCEPTED))} (float64 runs the reference)")
    n = gate.shape[-1]
    return {"rows": gate.numel() // n if n else 0, "cols": n}


def fake(config, gate, up):
    return (gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype)),), ()


def run_gated(op: Op, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A gated activation's functional: other float dtypes (fp64) run the reference, the kernels compute in fp32."""
    if up.dtype in REFERENCE_DTYPES:
        op.dims(gate, up)                                                 # the prologue there too
        return op.reference(gate, up)
    return call(op, gate, up)


def make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    m, n = dims["rows"], dims["cols"]
    gate = (2.0 * torch.randn(m, n, generator=g)).to(device, dtype).requires_grad_()
    up = torch.randn(m, n, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    return Case(args=(gate, up), grads=(dy,))


def config_for(arch, *, cols: int, tile: int, fwd_per_thread: int, bwd_per_thread: int) -> GatedMLPConfig:
    """`tile` elements per program (BLOCK_N columns, tile // BLOCK_N rows where cols are narrow), with warps
    giving each thread fwd_per_thread (bwd_per_thread) values."""
    block_n = min(tile, next_pow2(cols))
    rows = max(1, tile // block_n)
    return GatedMLPConfig(BLOCK_N=block_n, ROWS=rows, num_warps=warps_for(rows * block_n, fwd_per_thread, arch),
                          bwd_num_warps=warps_for(rows * block_n, bwd_per_thread, arch))


def heuristic(arch, dims, dtype):
    """4096-element tiles, 16 values per thread (two 16-byte vectors of bf16 per tensor): small
    enough that several programs stay resident per SM in the 5-stream backward (~80 registers),
    large enough that the forward streams like Liger-Kernel's 8192-column, 16-warp rows (4.25 TB/s
    on the H200).  Estimate; sweeps decide."""
    if arch.name == "cpu":
        return config_for(arch, cols=dims["cols"], tile=1024, fwd_per_thread=8, bwd_per_thread=8)
    return config_for(arch, cols=dims["cols"], tile=4096, fwd_per_thread=16, bwd_per_thread=16)


# The GPU tuning space: elements per program, values per thread in the forward and the backward.
LADDER = (
    dict(tile=4096, fwd_per_thread=16, bwd_per_thread=16),
    dict(tile=4096, fwd_per_thread=8, bwd_per_thread=8),
    dict(tile=4096, fwd_per_thread=16, bwd_per_thread=8),
    dict(tile=2048, fwd_per_thread=8, bwd_per_thread=8),
    dict(tile=2048, fwd_per_thread=16, bwd_per_thread=16),
    dict(tile=1024, fwd_per_thread=8, bwd_per_thread=8),
    dict(tile=8192, fwd_per_thread=16, bwd_per_thread=16),
    dict(tile=8192, fwd_per_thread=32, bwd_per_thread=16),
    dict(tile=16384, fwd_per_thread=16, bwd_per_thread=16),
)


def candidates(arch, dims, dtype):
    n = dims["cols"]
    if arch.name == "cpu":  # the interpreter ignores warps: cover tiling paths (column blocks, rows)
        narrow = GatedMLPConfig(BLOCK_N=32, ROWS=8, num_warps=1, bwd_num_warps=1)
        return [heuristic(arch, dims, dtype), narrow,
                config_for(arch, cols=n, tile=4096, fwd_per_thread=16, bwd_per_thread=16)]
    return [config_for(arch, cols=n, **step) for step in LADDER]   # deduplicated by the runtime


def launchable(config, dims, arch, dtype) -> str | None:
    """Why `config` cannot launch at `dims` (None: it can): both kernels hold (ROWS, BLOCK_N) tiles, BLOCK_N at most
    the padded cols (the launcher's clamp), within Triton's largest block."""
    return block_problem(tile=config.ROWS * min(config.BLOCK_N, next_pow2(dims["cols"])))


def plan(preset, arch, quick):
    return row_plan(preset, arch, quick, width="cols", preset_width=preset and preset.intermediate,
                    cpu_widths=(96, 128), gpu_widths=(8192, 12288), gpu_tokens=(1024, 4096, 16384))


def gated_op(name: str, torch_fn, forward, backward) -> Op:
    """The registered spec of a gated activation act(gate) * up: the family's checks, config, tuning space and
    plan around one op's torch implementation and Triton launchers."""
    return register(Op(
        name=name, static=("cols",), dynamic=("rows",), dims=lambda gate, up: dims(gate, up, name),
        impls=[Impl("triton", forward=forward, backward=backward, available=triton_available),
               Impl("torch", fn=torch_fn)],
        config=GatedMLPConfig, candidates=candidates, heuristic=heuristic, launchable=launchable,
        schema="Tensor gate, Tensor up",
        fake=fake, make_case=make_case, plan=plan, compiler_fuses=True))
