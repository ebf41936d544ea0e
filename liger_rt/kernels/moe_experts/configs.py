"""moe_experts' launch configs: one :class:`Gemm` per GEMM family, the tilings a sweep measures per arch, the
pinned configs (``LIGER_FUSED_MOE_AUTOTUNE=0``) and the shared-memory estimate the Op prunes candidates with.

    MoEExpertsConfig(up=T128x128x64w8s3, up_bwd=T128x64x64w8s4, down=T128x256x64w8s3, wgrad=T128x256x64w8s3)
"""
from __future__ import annotations

import dataclasses

import torch

from ...config import STAGES, WARPS, Config, knob, pow2


@dataclasses.dataclass(frozen=True)
class Gemm(Config):
    """One GEMM family's launch: BLOCK_M x BLOCK_N tiles, BLOCK_K per step, GROUP_M row tiles per column walk."""
    BLOCK_M: int = knob(64, pow2(16, 256))
    BLOCK_N: int = knob(64, pow2(16, 256))
    BLOCK_K: int = knob(32, pow2(16, 256))
    num_warps: int = knob(4, WARPS)
    num_stages: int = knob(2, STAGES)
    GROUP_M: int = knob(8, pow2(1, 16))


@dataclasses.dataclass(frozen=True)
class MoEExpertsConfig(Config):
    """One launch per GEMM family: ``up`` (SwiGLU epilogue, two accumulators), ``up_bwd`` (dy @ down[e] with the
    SwiGLU backward: three more tiles loaded, so narrower tiles; ptxas spills at 128x128 with 8 warps), ``down``
    (down, dX and up_bwd_split's dy @ down GEMMs), ``wgrad`` (both weight gradients; BLOCK_K over an expert's rows)."""
    up: Gemm
    up_bwd: Gemm
    down: Gemm
    wgrad: Gemm
    # the weight gradients read 0: gathered rows, 1: sorted copies, 2: sorted copies through TMA (1 where it cannot run)
    wgrad_sorted: int = knob(1, (0, 1, 2))
    # through tensor descriptors (TMA; pointers where they cannot run): the up GEMMs' expert weights (forward, and
    # dy @ down), and both operands of the down and dX GEMMs. H200, T16384, fused up backward: neither helped alone
    # (E32 435.9-438.3 TFLOP/s on against 446.1 off); down_desc helps the split below.
    up_desc: int = knob(0, (0, 1))
    down_desc: int = knob(0, (0, 1))
    # 1: the up backward split in two: dy @ down[e] as a plain GEMM through the down/dX launch (its tiles,
    # dy copied into sorted order, down_desc applies), then the SwiGLU backward as its own pass over the rows.
    # The fused kernel (0) is held to 128x64 tiles by its epilogue's registers (222-231 TFLOP/s at E64 T16384,
    # H200, benchmarks/profile_moe.py), where the down GEMM runs at 600.
    up_bwd_split: int = knob(0, (0, 1))


# -- tiles, named T<BLOCK_M>x<BLOCK_N>x<BLOCK_K>w<num_warps>s<num_stages> (GROUP_M 8) ------------------------------
# Hopper (sm90, 227 KiB smem), bf16/fp16
T128x128x64w8s3 = Gemm(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
T128x64x64w8s4 = Gemm(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4)
T128x256x64w8s3 = Gemm(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
T128x128x64w8s4 = Gemm(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4)
T128x256x64w8s4 = Gemm(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4)
T64x128x64w4s4 = Gemm(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
T64x64x64w4s4 = Gemm(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
T64x256x64w4s4 = Gemm(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=4)
T128x128x32w4s4 = Gemm(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4)
T64x128x64w4s3 = Gemm(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)
T64x256x64w8s3 = Gemm(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
T128x64x128w8s3 = Gemm(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3)
# fp32 on NVIDIA (ieee dot, 4-byte tiles), also what other NVIDIA parts fall back to
T64x64x32w4s3 = Gemm(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
T64x128x32w4s3 = Gemm(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=3)
T32x64x32w4s2 = Gemm(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
T64x64x32w4s2 = Gemm(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
# AMD CDNA3 (MI300X/MI325X, gfx942): 64 KiB LDS, num_stages <= 2, num_warps <= 8 (wave64)
T64x64x64w4s2 = Gemm(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2)
T64x128x64w4s2 = Gemm(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=2)
T128x64x32w8s2 = Gemm(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=2)
T128x128x32w8s2 = Gemm(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=2)
T64x128x32w4s2 = Gemm(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=2)
T128x256x32w8s2 = Gemm(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32, num_warps=8, num_stages=2)
T32x64x64w4s2 = Gemm(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2)
T32x128x64w4s2 = Gemm(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=2)
T64x64x64w4s1 = Gemm(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=1)
# the interpreter
T16x32x32w4s1 = Gemm(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
T16x64x32w4s1 = Gemm(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=1)
T32x32x32w4s1 = Gemm(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
T32x32x16w2s1 = Gemm(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=2, num_stages=1)
T32x16x32w2s1 = Gemm(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, num_warps=2, num_stages=1)
T32x32x32w2s1 = Gemm(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=2, num_stages=1)
T16x64x16w2s1 = Gemm(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, num_warps=2, num_stages=1)

# -- tilings, one table: (the arch family's table, config), in sweep order --------------------------------------------
TILINGS = (
    # Hopper, bf16/fp16. Registers and smem checked by compiling every kernel for sm90 with ptxas (Triton 3.9, no
    # GPU): the up tiles 128x(2x128)/8 warps use 255 registers (16 B spill), 128x(2x64)/8 warps 128; up_bwd 128x64/8
    # warps 105 (128x128 spills 96 B); down 128x256/8 warps 216. BLOCK_M 64 variants serve few rows per expert. On
    # the H200 the heuristic's picks (the 6th row at T512, the first at T4096) beat both peers
    # (benchmarks/bench_moe_experts.py).
    ("hopper", MoEExpertsConfig(up=T128x128x64w8s3, up_bwd=T128x64x64w8s4,
                                down=T128x256x64w8s3, wgrad=T128x256x64w8s3)),
    ("hopper", MoEExpertsConfig(up=T128x128x64w8s3, up_bwd=T128x64x64w8s4,
                                down=T128x128x64w8s4, wgrad=T128x128x64w8s4)),
    ("hopper", MoEExpertsConfig(up=T128x64x64w8s4, up_bwd=T128x64x64w8s4,
                                down=T128x256x64w8s3, wgrad=T128x256x64w8s3)),
    ("hopper", MoEExpertsConfig(up=T128x64x64w8s4, up_bwd=T128x64x64w8s4,
                                down=T128x128x64w8s4, wgrad=T128x128x64w8s4)),
    ("hopper", MoEExpertsConfig(up=T128x128x64w8s4, up_bwd=T128x64x64w8s4,
                                down=T128x256x64w8s4, wgrad=T128x256x64w8s4)),
    ("hopper", MoEExpertsConfig(up=T64x128x64w4s4, up_bwd=T64x64x64w4s4,
                                down=T64x256x64w4s4, wgrad=T128x128x64w8s4)),
    ("hopper", MoEExpertsConfig(up=T64x64x64w4s4, up_bwd=T64x64x64w4s4,
                                down=T64x128x64w4s4, wgrad=T128x128x32w4s4)),
    ("hopper", MoEExpertsConfig(up=T64x128x64w4s3, up_bwd=T64x64x64w4s4,
                                down=T64x128x64w4s4, wgrad=T128x256x64w8s3)),
    # few rows per expert: 64-row up tiles, an 8-warp 64x256 down/dX GEMM, the wgrad tile that won at T4096 (smem:
    # up 160 KiB, down 120 KiB, wgrad 144 KiB)
    ("hopper", MoEExpertsConfig(up=T64x128x64w4s4, up_bwd=T64x64x64w4s4,
                                down=T64x256x64w8s3, wgrad=T128x256x64w8s3)),
    # many rows per expert: 4-stage up/down/wgrad, up_bwd with BLOCK_K 128 (half the K loop iterations for its
    # narrower tile; smem: up/down/wgrad 192 KiB, up_bwd 144 KiB)
    ("hopper", MoEExpertsConfig(up=T128x128x64w8s4, up_bwd=T128x64x128w8s3,
                                down=T128x256x64w8s4, wgrad=T128x256x64w8s4)),
    # fp32 (ieee dot, 4-byte tiles): small tiles
    ("nvidia_fp32", MoEExpertsConfig(up=T64x64x32w4s3, up_bwd=T64x64x32w4s3,
                                     down=T64x128x32w4s3, wgrad=T64x128x32w4s3)),
    ("nvidia_fp32", MoEExpertsConfig(up=T32x64x32w4s2, up_bwd=T32x64x32w4s2,
                                     down=T64x64x32w4s2, wgrad=T64x64x32w4s2)),
    # AMD CDNA3: every candidate is HIP-safe; LDS is counted for num_stages buffers (conservative)
    ("hip", MoEExpertsConfig(up=T64x64x64w4s2, up_bwd=T64x64x64w4s2,
                             down=T64x128x64w4s2, wgrad=T64x128x64w4s2)),
    ("hip", MoEExpertsConfig(up=T128x64x32w8s2, up_bwd=T128x64x32w8s2,
                             down=T128x128x32w8s2, wgrad=T128x128x32w8s2)),
    ("hip", MoEExpertsConfig(up=T64x128x32w4s2, up_bwd=T64x64x64w4s2,
                             down=T64x128x64w4s2, wgrad=T128x128x32w8s2)),
    ("hip", MoEExpertsConfig(up=T128x128x32w8s2, up_bwd=T128x64x32w8s2,
                             down=T128x256x32w8s2, wgrad=T128x128x32w8s2)),
    ("hip", MoEExpertsConfig(up=T32x64x64w4s2, up_bwd=T32x64x64w4s2,
                             down=T32x128x64w4s2, wgrad=T64x64x64w4s2)),
    ("hip", MoEExpertsConfig(up=T64x64x64w4s1, up_bwd=T64x64x64w4s1,
                             down=T64x64x64w4s1, wgrad=T64x64x64w4s1)),
    # The interpreter runs every program serially in numpy: few, mid-sized tiles are fastest there.
    ("cpu", MoEExpertsConfig(up=T16x32x32w4s1, up_bwd=T16x32x32w4s1,
                             down=T16x64x32w4s1, wgrad=T32x32x32w4s1)),
    ("cpu", MoEExpertsConfig(up=T32x32x16w2s1, up_bwd=T32x16x32w2s1,
                             down=T32x32x32w2s1, wgrad=T16x64x16w2s1)),
)
HOPPER, NVIDIA_FP32, HIP, CPU = ([config for table, config in TILINGS if table == name]
                                 for name in ("hopper", "nvidia_fp32", "hip", "cpu"))

# LIGER_FUSED_MOE_AUTOTUNE=0: fixed, known-safe configs (the first one that the arch keeps), and the last resort
PINNED_HIP = MoEExpertsConfig(up=T64x64x64w4s2, up_bwd=T64x64x64w4s2, down=T64x128x64w4s2, wgrad=T64x128x64w4s2)
PINNED_CUDA = MoEExpertsConfig(up=T128x64x64w8s4, up_bwd=T128x64x64w8s4, down=T128x128x64w8s4, wgrad=T128x128x64w8s4)
MINIMAL = MoEExpertsConfig(up=T32x32x32w4s1, up_bwd=T32x32x32w4s1, down=T32x32x32w4s1, wgrad=T32x32x32w4s1)


def smem(config: MoEExpertsConfig, dims: dict, dtype: torch.dtype) -> int:
    """Shared memory / LDS bytes of the hungriest GEMM: num_stages buffers of A and B tiles (two B tiles in up)."""
    return max(c.num_stages * (c.BLOCK_M * c.BLOCK_K + b_tiles * c.BLOCK_K * c.BLOCK_N) * dtype.itemsize
               for c, b_tiles in ((config.up, 2), (config.up_bwd, 1), (config.down, 1), (config.wgrad, 1)))


def candidates(arch, dims: dict, dtype: torch.dtype) -> list[MoEExpertsConfig]:
    """The tilings a sweep measures on `arch` (the Op prunes those past the arch's warps, stages and smem)."""
    if arch.name == "cpu":
        return CPU
    if arch.is_hip:   # sorted copies (the knob's default) and gathered rows: neither measured on AMD yet
        return HIP + [c.replace(wgrad_sorted=0) for c in HIP[:2]]
    if dtype == torch.float32:
        return NVIDIA_FP32
    # on the first tiles (the variants are independent of the tiles): the weight-gradient operand variants, the up
    # and down/dX GEMMs through tensor descriptors (both or one, with TMA weight gradients)
    desc = [c.replace(wgrad_sorted=2, **variant) for variant, tiles in ((dict(up_desc=1, down_desc=1), 4),
                                                                       (dict(up_desc=0, down_desc=1), 2),
                                                                       (dict(up_desc=1, down_desc=0), 2))
            for c in HOPPER[:tiles]]
    # and the split up backward (its GEMM on the down tiles), with pointer or descriptor loads there
    split = [c.replace(wgrad_sorted=2, up_bwd_split=1, down_desc=d) for d in (0, 1) for c in HOPPER[:4]]
    return HOPPER + [c.replace(wgrad_sorted=v) for c in HOPPER[:4] for v in (0, 2)] + desc + split + NVIDIA_FP32
