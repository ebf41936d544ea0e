"""MoE experts (SwiGLU experts of a sparse MoE block), transformers v5 layout.

    y = liger_rt.ops.moe_experts(x, gate_up_proj, down_proj, top_k_index, top_k_weights)

x (tokens, hidden); gate_up_proj (experts, 2*intermediate, hidden), gate in the FIRST half (HF: ``gate, up =
linear(x, gate_up_proj[e]).chunk(2, dim=-1)``); down_proj (experts, hidden, intermediate); top_k_index (tokens, k)
expert ids in [0, experts); top_k_weights (tokens, k). Returns (tokens, hidden):

    y[t] = sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = idx[t, j]

An expert id outside [0, experts) gets one outcome whatever implementation runs: on CPU tensors a ValueError at the
call (the prologue reads the ids); on the GPU, where reading them would cost a host sync per call, every
implementation stops with the device-side assertion "moe_experts: top_k_index holds ids outside [0, E)" (a
RuntimeError at the next sync; as after any device assert, the CUDA context is unusable); under torch.compile the
same assertion on any device.

Implementations: ``triton`` (fused, below), ``grouped_mm`` (CUDA bf16) and ``torch`` (fp32 loop, the reference).
Fused path, S = tokens * k routed slots (slot s = t * k + j), no host sync: a stable sort of the slots by expert gives
``perm`` (sorted row -> slot) and ``bounds`` (E+1 row offsets), and a small launch the tile schedule of a BLOCK_M
(grids cover an upper bound of tiles; the surplus returns at once); the backward reuses all three. The up GEMM
gathers x rows by token in its loads (no permuted copy) and stores h = SwiGLU (S, I) sorted, plus gate|up (S, 2I)
when a backward follows (3*S*I*2 bytes, against recomputing 2/3 of the forward's flops). The down GEMM scales rows by
their routing weight and scatters them to slot rows; y[t] = sum_j y_slot[t*k + j] in fp32, deterministic and with
no fp32 temporary or memset as atomics would need, costs 2*S*H*2 bytes (~0.13 ms at T=16384 on an H200, under 2% of
the fused fwd+bwd). The backward's dX and d top_k_weights are summed the same way; dW is one grouped kernel per
weight with an fp32 accumulator per (expert, tile). DOT_FP32 upcasts tiles for fp32 inputs and for bf16 under the
interpreter (no bf16 arithmetic there); on a GPU 16-bit tiles feed the tensor cores directly.

This module is the op (reference, grouped MM, heuristics, functional, registration); kernels.py holds the Triton
kernels and their launchers, configs.py the launch configs and the tilings a sweep measures.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from ... import backend
from ...dispatch import call, register
from ...op import Case, Impl, Op, check_dtype, host_values
from .configs import (CPU, HIP, HOPPER, MINIMAL, NVIDIA_FP32, PINNED_CUDA, PINNED_HIP, Gemm, MoEExpertsConfig,
                      candidates, smem)
from .kernels import TRITON, fake

__all__ = ["OP", "PROBE_FAILURES", "HIP_GROUPED_MM_FROM", "Gemm", "MoEExpertsConfig", "moe_experts", "moe_experts_ref",
           "moe_experts_grouped_mm"]


# ================================================================================ reference
def _check_ids(top_k_index: torch.Tensor, experts: int) -> None:
    """Expert ids outside [0, experts) where the prologue cannot read them (on the GPU, where reading is a host
    sync; under torch.compile): the device-side assertion the fused path's routing makes, with its message."""
    if top_k_index.numel() and not host_values(top_k_index):
        lo, hi = torch.aminmax(top_k_index)
        torch._assert_async((lo >= 0) & (hi < experts), f"moe_experts: top_k_index holds ids outside [0, {experts})")


def moe_experts_ref(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The HF eager experts loop computed in fp32: (T, H) in x.dtype. Also the ``torch`` impl."""
    _check_ids(top_k_index, gate_up_proj.shape[0])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    idx = top_k_index.long()
    for e in range(gate_up_proj.shape[0]):
        tok, pos = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        gate, up = (xf[tok] @ gate_up_proj[e].float().t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down_proj[e].float().t()
        out = out.index_add(0, tok, y * top_k_weights[tok, pos, None].float())
    return out.to(x.dtype)


# ================================================================================ grouped MM
def _grouped_mm_fn():
    """torch.nn.functional.grouped_mm (torch >= 2.10) or torch._grouped_mm (2.8, 2.9), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def moe_experts_grouped_mm(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Sort slots by expert, two grouped GEMMs (CUTLASS on sm90: bf16, int32 end offsets per expert, 16-byte aligned
    rows, column-major weight views), weighted top-k sum; torch autograd backward."""
    _check_ids(top_k_index, gate_up_proj.shape[0])
    gmm = _grouped_mm_fn()
    if gmm is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has neither torch.nn.functional.grouped_mm nor "
                           "torch._grouped_mm; use the triton or torch implementation of moe_experts")
    T, H = x.shape
    K = top_k_index.shape[1]
    sorted_e, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_e, torch.arange(gate_up_proj.shape[0], device=x.device), right=True).int()
    gate, up = gmm(x.index_select(0, perm // K), gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = gmm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offs)
    y = y * top_k_weights.reshape(-1).index_select(0, perm).to(y.dtype).unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return y.index_select(0, inv).view(T, K, H).sum(1)


_PROBED: dict[int, bool] = {}      # device index -> grouped_mm launched there (only successes are kept)
PROBE_FAILURES: dict[int, str] = {}  # device index -> why the last probe failed (warned once per reason)


def _grouped_mm_probe(device_index: int) -> bool:
    """Does a tiny bf16 grouped MM launch here? (sync debug mode off: its offsets copy syncs.) Failures are warned once
    per reason, never cached: on the H200 a cached failure (an RNG-state error after a peer's failed CUDA-graph
    capture) hid grouped_mm from every later case."""
    if _PROBED.get(device_index):
        return True
    gmm = _grouped_mm_fn()
    if gmm is None:
        return False
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        dev = torch.device("cuda", device_index)
        # constant inputs: no RNG call, which failed here after a peer's failed CUDA-graph capture (see above)
        a = torch.ones(32, 64, device=dev, dtype=torch.bfloat16)
        b = torch.ones(2, 32, 64, device=dev, dtype=torch.bfloat16).transpose(-2, -1)
        gmm(a, b, offs=torch.tensor([16, 32], device=dev, dtype=torch.int32))
        _PROBED[device_index] = True
        PROBE_FAILURES.pop(device_index, None)
        return True
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if PROBE_FAILURES.get(device_index) != why:
            warnings.warn(f"liger_rt: grouped_mm probe failed on cuda:{device_index} ({why}); moe_experts "
                          "dispatches without grouped_mm until a probe succeeds", RuntimeWarning)
        PROBE_FAILURES[device_index] = why
        return False
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _grouped_mm_available(target) -> bool:
    """CUDA/ROCm where the op runs: a probe with the GPU present; planning or capturing a CUDA graph, the op's rules
    (torch <= 2.8 sm90 only; torch >= 2.9 sm80+ and gfx942/gfx950)."""
    if target.device_type != "cuda" or _grouped_mm_fn() is None:
        return False
    arch = target.arch
    if backend.gpu_present() and backend.detect().name == arch.name and not torch.cuda.is_current_stream_capturing():
        return _grouped_mm_probe(torch.cuda.current_device())
    torch_2_9 = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 9)
    if arch.vendor == "nvidia":
        sm = int(arch.capability[2:]) if arch.capability[2:].isdigit() else 0
        return sm // 10 == 9 or (torch_2_9 and sm >= 80)
    return arch.vendor == "amd" and torch_2_9 and arch.capability in ("gfx942", "gfx950")


def _supports_grouped_mm(dims: dict, dtype: torch.dtype) -> str | None:
    if dtype != torch.bfloat16:
        return "grouped_mm runs bf16 only (CUTLASS grouped GEMM); use triton or torch for fp32/fp16"
    if dims["hidden"] % 8 or dims["intermediate"] % 8:
        return "grouped_mm needs hidden and intermediate multiples of 8 (16-byte aligned rows)"
    return None


# ================================================================================ functional
def _dims(x, gate_up_proj, down_proj, top_k_index, top_k_weights, save=False) -> dict:
    H = x.shape[-1] if x.dim() else -1
    E, I2, H2 = gate_up_proj.shape if gate_up_proj.dim() == 3 else (-1, -1, -1)
    if H < 0 or E < 0 or H2 != H or I2 % 2 or tuple(down_proj.shape) != (E, H, I2 // 2):
        raise ValueError(f"moe_experts takes x (tokens, hidden), gate_up_proj (experts, 2*intermediate, hidden) and "
                         f"down_proj (experts, hidden, intermediate) (the transformers v5 experts layout); got "
                         f"{tuple(x.shape)}, {tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"moe_experts: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must both be (tokens, k) for x {tuple(x.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"moe_experts: top_k_index must be an integer tensor, got {top_k_index.dtype}")
    if not (x.dtype == gate_up_proj.dtype == down_proj.dtype):
        raise TypeError(f"moe_experts: x, gate_up_proj and down_proj must share a dtype (got {x.dtype}, "
                        f"{gate_up_proj.dtype}, {down_proj.dtype}); cast x to the weights' dtype first")
    check_dtype("moe_experts", "top_k_weights", top_k_weights, OP.accepted_dtypes)
    if top_k_index.numel() and host_values(top_k_index):     # on the GPU: see _check_ids
        lo, hi = (int(v) for v in torch.aminmax(top_k_index))
        if lo < 0 or hi >= E:
            raise ValueError(f"moe_experts: top_k_index holds ids outside [0, {E}) (min {lo}, max {hi}); valid: "
                             f"expert ids 0..{E - 1} of gate_up_proj {tuple(gate_up_proj.shape)}")
    T = x.numel() // H if H else 0
    return dict(tokens=T, experts=E, top_k=top_k_index.shape[-1], hidden=H, intermediate=I2 // 2)


def moe_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts (shapes in the module docstring, leading dims of x any), dispatched by arch, dtype, shape.

    >>> y = liger_rt.ops.moe_experts(x, experts.gate_up_proj, experts.down_proj, idx, w)   # x.shape, x.dtype
    """
    # the fused forward stores gate|up for the backward only when one can follow
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate_up_proj, down_proj, top_k_weights))
    if x.dim() == 2:
        return call(OP, x, gate_up_proj, down_proj, top_k_index, top_k_weights, save)
    d = _dims(x, gate_up_proj, down_proj, top_k_index, top_k_weights)
    T, K, H = d["tokens"], d["top_k"], d["hidden"]
    y = call(OP, x.reshape(T, H), gate_up_proj, down_proj, top_k_index.reshape(T, K), top_k_weights.reshape(T, K), save)
    return y.view(*x.shape[:-1], H)


# ================================================================================ heuristics
def _first_fit(preferred: list[MoEExpertsConfig], arch, dims, dtype) -> MoEExpertsConfig:
    """The first of `preferred` (candidates of this arch and dtype) that the Op keeps on `arch` (its warps, stages and
    shared memory: Op.candidates_for), else the minimal config."""
    kept = set(OP.candidates_for(OP.impl("triton"), arch, dims, dtype))
    return next((c for c in preferred if c in kept), MINIMAL)


def _rows_per_expert(dims: dict) -> float:
    return dims["tokens"] * dims["top_k"] / max(1, dims["experts"])


def _heuristic(arch: backend.Arch, dims: dict, dtype: torch.dtype) -> MoEExpertsConfig:
    """Default config: BLOCK_M 64 below 128 routed rows per expert (a 128-row tile would be over half padding)."""
    if arch.name == "cpu" or arch.is_hip:
        return _pinned(arch, dims, dtype)
    if dtype == torch.float32:
        return _first_fit(NVIDIA_FP32, arch, dims, dtype)
    order = [HOPPER[5], HOPPER[0]] if _rows_per_expert(dims) < 128 else [HOPPER[0], HOPPER[5]]
    cfg = _first_fit(order + HOPPER + NVIDIA_FP32, arch, dims, dtype)
    # bf16: the weight gradients through tensor descriptors (sorted copies where TMA cannot run). H200,
    # benchmarks/profile_moe_wgrad.py at these tiles, fwd+bwd: 33.9 / 9.9 / 9.2 ms against 36.5 / 10.2 /
    # 9.4 with sorted copies and 42.7 / 11.7 / 10.4 with gathered rows (E8 H4096 T8192, E32 and E64 at T16384)
    if dtype != torch.bfloat16:
        return cfg
    # and on Hopper from 1024 rows per expert the split up backward with TMA down/dX operands. H200,
    # benchmarks/profile_moe_wgrad.py at T16384, fwd+bwd medians of 3: 8.82 against 9.61 ms (E32), 8.20 against
    # 8.97 (E64); sweeps chose it at T8192 and T16384. Measured at H 2048 only; not below 1024 rows per expert
    big = arch.name == "hopper" and _rows_per_expert(dims) >= 1024
    return cfg.replace(wgrad_sorted=2, up_bwd_split=int(big), down_desc=int(big))


def _pinned(arch: backend.Arch, dims: dict, dtype: torch.dtype) -> MoEExpertsConfig:
    """LIGER_FUSED_MOE_AUTOTUNE=0: HIP-safe on AMD, the fixed CUDA config otherwise; shrunk to the arch's limits."""
    if arch.name == "cpu":
        return CPU[0]
    if arch.is_hip:
        return _first_fit([PINNED_HIP, *HIP], arch, dims, dtype)
    return _first_fit([PINNED_CUDA, *NVIDIA_FP32], arch, dims, dtype)


# Hopper heuristic between implementations, measured on an H200 (torch 2.11, Triton 3.6, bf16
# fwd+bwd ms, uniform routing; benchmarks/bench_moe_experts.py, heuristic configs):
#                 hf_grouped_mm  liger_kernel  ours grouped_mm  ours triton
#   E32 T512          1.306         1.621          1.341           1.305
#   E32 T4096         4.151         3.933          3.512           3.455
#   E64 T512          2.123         1.823          1.620           1.439
#   E64 T4096         4.201         4.125          3.621           3.653
# The fused Triton path was fastest or within 1% of grouped MM at every point measured, from 32 to 512 routed rows per
# expert (the grouped-MM-below-128-rows-per-expert crossover measured with Liger-Kernel 0.8.5 does not hold for this
# kernel). So: triton everywhere on Hopper; a measured crossover row (`bench_moe_experts.py --emit-crossover`,
# `liger-tune`) overrides it. MI325X (Liger-Kernel PR #1317, bf16 fwd+bwd): the fused path wins below ~256 routed
# rows per expert, grouped MM above. The same numbers ship as published crossover rows in defaults/mi325x.jsonl.
HIP_GROUPED_MM_FROM = 256.0


def _heuristic_impl(target, dims: dict, dtype: torch.dtype, avail: list[str]) -> str:
    if "grouped_mm" in avail and target.arch.is_hip and _rows_per_expert(dims) >= HIP_GROUPED_MM_FROM:
        return "grouped_mm"
    return next((impl for impl in ("triton", "grouped_mm") if impl in avail), "torch")


# ================================================================================ the op
def _routing(T: int, E: int, K: int, tag: str, g: torch.Generator, device) -> torch.Tensor:
    """(T, K) distinct expert ids: ``uniform`` random, or ``skewed`` (Zipf-like, a quarter of the experts empty)."""
    if tag == "uniform":
        return torch.rand(T, E, generator=g, device=device).topk(K, dim=-1).indices
    if tag != "skewed":
        raise ValueError(f"moe_experts routing tag {tag!r}; valid: uniform, skewed")
    live = max(K, E - E // 4)
    p = torch.zeros(E, device=device)
    p[:live] = 1.0 / torch.arange(1, live + 1, device=device, dtype=torch.float32) ** 1.2
    p = p[torch.randperm(E, generator=g, device=device)]
    return torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)


def _make_case(dims: dict, dtype: torch.dtype, device: str, tag: str = "uniform") -> Case:
    T, E, K, H, I = (dims[k] for k in ("tokens", "experts", "top_k", "hidden", "intermediate"))
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype).requires_grad_()

    x = randn(T, H)
    gate_up = randn(E, 2 * I, H, scale=H ** -0.5)
    down = randn(E, H, I, scale=I ** -0.5)
    idx = _routing(T, E, K, tag, g, device)
    w = torch.rand(T, K, generator=g, device=device) + 0.1
    w = (w / w.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    # dy ~ N(0, 1/16) gives gradients the outputs' magnitudes; with unit dy the dW and d-weights sums (thousands of
    # O(1) terms) make the bf16 atol meaningless and every bf16 implementation fails it at a few extreme elements
    dy = (torch.randn(T, H, generator=g, device=device) * 0.25).to(dtype)
    return Case(args=(x, gate_up, down, idx, w, True), grads=(dy,))


def _plan(preset, arch: backend.Arch, quick: bool) -> list[dict]:
    """Sweep grid: T 512..16384 at the preset's experts (E32 K4 H2048 I1792 without one); tiny shapes on cpu."""
    moe = preset is not None and preset.experts
    static = (preset.experts, preset.top_k, preset.hidden, preset.moe_intermediate) if moe else (32, 4, 2048, 1792)
    if arch.name == "cpu":
        if moe and getattr(preset, "tiny", False):
            statics, tokens = [static], (preset.quick_tokens if quick else preset.tokens)
        else:   # (experts, top_k, hidden, intermediate)
            statics, tokens = [(4, 2, 32, 32), (8, 2, 64, 32)], (16, 64)
        if quick:
            statics, tokens = statics[:1], tokens[:1]
    elif preset is not None and not moe:
        return []
    else:
        statics, tokens = [static], ((512, 4096) if quick else (512, 2048, 4096, 16384))
    names = ("experts", "top_k", "hidden", "intermediate")
    return [dict(tokens=t, **dict(zip(names, s))) for s in statics for t in tokens]


def _reduce_len(dims: dict) -> int:
    # the longest fp32 sum: hidden (up GEMMs), 2*intermediate (dX) or one expert's rows (dW), up to `tokens` under
    # skewed routing (distinct experts per token), not the mean
    return max(dims["hidden"], 2 * dims["intermediate"], dims["tokens"])


def _native(fn):
    """A native implementation on the op's args (the trailing `save` is the fused path's alone)."""
    return functools.wraps(fn)(lambda x, gate_up_proj, down_proj, top_k_index, top_k_weights, save=False:
                               fn(x, gate_up_proj, down_proj, top_k_index, top_k_weights))


OP = register(Op(
    name="moe_experts", static=("experts", "top_k", "hidden", "intermediate"), dynamic=("tokens",), dims=_dims,
    impls=[TRITON,
           Impl("grouped_mm", fn=_native(moe_experts_grouped_mm), available=_grouped_mm_available,
                supports=_supports_grouped_mm),
           Impl("torch", fn=_native(moe_experts_ref))],
    config=MoEExpertsConfig, candidates=candidates, heuristic=_heuristic, pinned=_pinned, smem=smem,
    schema="Tensor x, Tensor gate_up_proj, Tensor down_proj, Tensor top_k_index, Tensor top_k_weights, bool save",
    fake=fake, make_case=_make_case, plan=_plan, reduce_len=_reduce_len, heuristic_impl=_heuristic_impl,
    crossover_axis=_rows_per_expert, crossover_axis_name="rows_per_expert", pinned_by_fused_moe_env=True,
    tags=("uniform", "skewed"), schema_version=4))   # the config layout's version: DB rows of another are stale
