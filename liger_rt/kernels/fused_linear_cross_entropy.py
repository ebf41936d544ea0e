"""Fused linear + cross-entropy: the lm_head matmul and the loss, chunked over tokens, so the full
(tokens, vocab) logits never exist.

    loss = liger_rt.ops.fused_linear_cross_entropy(hidden, lm_head.weight, labels)

For each chunk of `chunk` token rows:
  1. logits = x[chunk] @ W.T (+ b)             cuBLAS, into one reused (chunk, vocab) buffer, x's dtype
  2. loss rows and dlogits, in place            the cross-entropy Triton kernel (fp32 math)
  3. dX[chunk] = dlogits @ W; dW (+)= dlogits.T @ x[chunk] (addmm, W's dtype); db += dlogits.sum(0) (fp32)
Gradients are computed in forward (as Liger-Kernel does), so backward is only a scale by
grad_output (a launch that moves nothing when grad_output == 1, the usual case).

Memory: beyond the inputs, one chunk of logits (see `budget_chunk`) plus dX and dW.  dW
accumulates in the weight dtype: an fp32 dW (1.56 GB at V151936 H2560) alone breaks that
shape's 1.0 GB budget; the price is one bf16 rounding per chunk, the trade Liger-Kernel makes too.
reduction="none" cannot fold a per-row grad_output into a dW summed in forward: forward then
computes the loss only, and backward recomputes each chunk's logits (one extra GEMM).
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
from ._common import as_rows, to_dtype, triton_available
from .cross_entropy import cross_entropy_ref, cross_entropy_rows
from .linear_softmax import (FLOOR, MiB, ce_launch, ce_launches, check_args, check_target, chunk_grads, chunk_spans,
                             device_kind, grad_scale, increment_version, linear_plan, reduce_rows)


def fused_linear_cross_entropy_ref(x, weight, target, bias=None, ignore_index: int = -100, reduction: str = "mean",
                                   label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap=None,
                                   num_items_in_batch=None, *launch_flags):
    """logits = x @ W.T (+ b) in x's dtype, then cross-entropy in fp32 (the `torch` implementation)."""
    logits = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return cross_entropy_ref(logits, target, ignore_index, reduction, label_smoothing=label_smoothing,
                             lse_square_scale=lse_square_scale, softcap=softcap, num_items_in_batch=num_items_in_batch)


@triton.jit
def _scale_kernel(SRC, DST, S, numel, BLOCK: tl.constexpr, IN_PLACE: tl.constexpr, RNE_BF16: tl.constexpr):
    """DST = SRC * S[0] over flat dense tensors.  In place nothing moves when S[0] == 1 (the usual
    grad_output of a loss), so that backward costs one launch and no host sync."""
    s = tl.load(S).to(tl.float32)
    if IN_PLACE:
        numel = tl.where(s != 1.0, numel, 0)
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < numel
    g = tl.load(SRC + o, mask=m, other=0.0).to(tl.float32)
    tl.store(DST + o, to_dtype(g * s, DST.dtype.element_ty, RNE_BF16), mask=m)


def _scale(t: torch.Tensor, s: torch.Tensor, in_place: bool) -> torch.Tensor:
    """t * s[0] (s fp32 on the device): in place in eager mode, where the autograd Function owns
    t (its version is bumped, so a second backward through the graph raises), else fresh."""
    out = t if in_place else torch.empty_like(t)
    _scale_kernel[(triton.cdiv(t.numel(), 4096),)](t, out, s, t.numel(), BLOCK=4096, IN_PLACE=in_place,
                                                   RNE_BF16=interpreter_on(), num_warps=4)
    if in_place:
        increment_version(t)
    return out


def _run(config, args, need, scale):
    """The chunk loop over the call's args: per-row fp32 losses and, where `need` says, [dX, dW,
    db] of sum(loss * scale) (scale fp32 (1,) or (tokens,)), else None in their place."""
    x, weight, target, bias, ignore_index, _, label_smoothing, lse_square_scale, softcap = args[:9]
    x, target = as_rows(x, x.shape[-1]), target.reshape(-1).contiguous()
    tokens, vocab = x.shape[0], weight.shape[0]
    gx, gw = (torch.empty_like(t) if n else None for t, n in ((x, need[0]), (weight, need[1])))
    gb = torch.zeros(vocab, device=x.device, dtype=torch.float32) if need[2] else None
    loss, lse = (torch.empty(tokens, device=x.device, dtype=torch.float32) for _ in range(2))
    spans = chunk_spans(config.chunk, tokens)
    buf = torch.empty(max((e - s for s, e in spans), default=0), vocab, device=x.device, dtype=x.dtype)
    with torch.autocast(x.device.type, enabled=False):     # the launchers chose the dtypes; out= GEMMs
        for i, (s, e) in enumerate(spans):
            xc, logits = x[s:e], buf[: e - s]
            if bias is None:
                torch.matmul(xc, weight.t(), out=logits)
            else:
                torch.addmm(bias, xc, weight.t(), out=logits)
            cross_entropy_rows(config, logits, target[s:e], loss[s:e], lse[s:e], ignore_index, label_smoothing,
                               lse_square_scale, softcap, grad=logits if any(need) else None,
                               scale=scale if scale.numel() == 1 else scale[s:e])
            chunk_grads(logits, xc, weight, (s, e), gx, gw, gb, first=i == 0)
    return loss, [gx, gw, None if gb is None else gb.to(bias.dtype)]


def _stored(grads: int, bias, reduction: str) -> tuple[bool, bool, bool]:
    """dX, dW, db computed in forward: those asked for (bits 1, 2, 4 of `grads`), none for "none"."""
    on = reduction != "none"
    return on and bool(grads & 1), on and bool(grads & 2), on and bool(grads & 4) and bias is not None


def _forward(config, *args):
    x, _, target, bias, ignore_index, reduction, _, _, _, num_items, grads, _ = args
    scale = grad_scale(target.reshape(-1), ignore_index, reduction, num_items)
    # fp16: p / n underflows at large n, so store unscaled dlogits and scale dX/dW in backward
    loss, out = _run(config, args, _stored(grads, bias, reduction),
                     torch.ones_like(scale) if x.dtype == torch.float16 else scale)
    saved = (x.new_empty(0) if g is None else g for g in out)    # distinct: custom-op outputs may not alias
    return (reduce_rows(loss, scale, reduction, target.shape),), (*saved, scale)


def _backward(config, args, saved, needs, dloss):
    x, _, _, bias, _, reduction, _, _, _, _, grads, inplace = args
    want = (needs[0], needs[1], needs[3] and bias is not None)
    *out, scale = saved
    if all(h or not w for w, h in zip(want, _stored(grads, bias, reduction))):   # computed in forward
        s = dloss.reshape(1).float() * scale if x.dtype == torch.float16 else dloss.reshape(1).float()
        out = [_scale(g, s, inplace) if w else None for g, w in zip(out, want)]
    else:     # reduction="none": recompute each chunk's logits with grad_output per row folded in
        s = dloss.reshape(-1).float().contiguous() if reduction == "none" else scale * dloss.float()
        out = _run(config, args, want, s)[1]
    gx, gw, gb = out
    return (None if gx is None else gx.view(x.shape), gw, None, gb, *(None,) * 8)


def _traced_backward(args, saved, needs, dloss):
    """Under torch.compile, where forward computed the gradients: those times grad_output as torch
    ops, which inductor may write into the saved buffers (a backward custom op may not mutate its
    inputs and would allocate a fresh dW); None (the backward op) for fp16 and reduction="none"."""
    x, _, _, bias, _, reduction, _, _, _, _, grads, _ = args
    want = (needs[0], needs[1], needs[3] and bias is not None)
    if x.dtype == torch.float16 or not all(h or not w for w, h in zip(want, _stored(grads, bias, reduction))):
        return None
    s = dloss.reshape(()).float()
    gx, gw, gb = ((g * s).to(g.dtype) if w else None for g, w in zip(saved[:3], want))
    return (None if gx is None else gx.view(x.shape), gw, None, gb, *(None,) * 8)


def _fake(config, x, weight, target, bias, ignore_index, reduction, *rest):
    shapes = ((target.numel(), x.shape[-1]), weight.shape, (weight.shape[0],))
    saved = (x.new_empty(shape if n else (0,)) for shape, n in zip(shapes, _stored(rest[-2], bias, reduction)))
    loss = x.new_empty(target.shape if reduction == "none" else (), dtype=torch.float32)
    return (loss,), (*saved, x.new_empty((1,), dtype=torch.float32))


CHUNKS = (0, *range(1, 65), *range(128, 65537, 128))     # token rows per chunk; 0 = all


@dataclasses.dataclass(frozen=True)
class FusedLinearCrossEntropyConfig(Config):
    chunk: int = knob(0, CHUNKS)
    BLOCK_V: int = knob(1024, pow2(1, 65536))     # the cross-entropy kernel's launch
    num_warps: int = knob(8, WARPS)


def _dims(x, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, num_items,
          grads, inplace) -> dict:
    op = "fused_linear_cross_entropy"
    check_args(op, reduction, label_smoothing, softcap, num_items)
    hidden = x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or hidden < 1:
        raise ValueError(f"{op}: x must be (..., hidden) with hidden >= 1; got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden or weight.shape[0] < 1:
        raise ValueError(f"{op}: weight must be (vocab, hidden={hidden}) with vocab >= 1; got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be ({weight.shape[0]},); got {tuple(bias.shape)}")
    check_target(op, target, x.numel() // hidden, f"x {tuple(x.shape)}", x.device)
    return {"tokens": target.numel(), "hidden": hidden, "vocab": weight.shape[0]}


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                               *, label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                               softcap: float | None = None, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy of x @ weight.T (+ bias) against `target`, without materialising the logits.

    x (..., hidden); weight (vocab, hidden), e.g. lm_head.weight (only read: a tied embedding's
    gradient is summed by autograd); target (...) int with x's leading dims; bias (vocab,).
    weight/bias are cast to x's dtype (differentiably), and under torch.autocast all three to the
    autocast dtype, as F.linear would be.  Returns a 0-d fp32 loss, or target's shape for "none".
    The other options are `liger_rt.ops.cross_entropy`'s.  Hugging Face's ``ForCausalLMLoss``
    (shifting the labels is the caller's job)::

        y = F.pad(labels, (0, 1), value=-100)[..., 1:]   # HF's shift (or its `shift_labels` kwarg)
        loss = fused_linear_cross_entropy(hidden_states, model.lm_head.weight, y, ignore_index=-100,
                                          num_items_in_batch=num_items_in_batch)
    """
    if torch.is_autocast_enabled(x.device.type) and x.dtype != torch.get_autocast_dtype(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))     # what F.linear would do under autocast
    weight = weight.to(x.dtype).contiguous()
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    grads = sum(bit for bit, t in ((1, x), (2, weight), (4, bias)) if t is not None and t.requires_grad
                ) if torch.is_grad_enabled() else 0
    if isinstance(num_items_in_batch, (int, float)):
        num_items_in_batch = torch.full((), float(num_items_in_batch), device=x.device)
    return call(OP, x, weight, target, bias, int(ignore_index), str(reduction), float(label_smoothing),
                float(lse_square_scale), None if softcap is None else float(softcap), num_items_in_batch, grads,
                not torch.compiler.is_compiling())


# Peak bytes of one chunk of logits (chunk * vocab * element bytes) that a config may use: the sweep
# measures only chunks under it and the heuristic takes the largest, so a tuned DB row never trades more
# memory than this for speed.
#  - HIP and unknown GPUs: 128 MiB, upstream's ROCm cap (Liger-Kernel PR #1317, "capped at 128 MiB" on MI325X).
#  - hopper: 320 MiB (1024 rows at V151936, 2560 at V65536), from whole training steps
#    (benchmarks/data/profile/flce_budget_step-h100-2026-12-07.csv): on an H100, compiled Qwen3-1.7B steps at
#    B4 x T2048 ran 1.3% and 1.9% faster (two runs) with 1024-row chunks than with 512 (160 MiB), for 0.16 GB
#    more peak memory out of 28 GB.
#    The loss alone at T8192 H2560 V151936 then holds 1.13 GB beyond its inputs (dW 0.78 + dX 0.04 + logits
#    0.31) against torch.compile's 3.31 (docs/losses.md).
#  - blackwell/ampere: 160 MiB (1280 rows at V65536, 512 at V151936); not timed on those GPUs.
#  - cpu (interpreter): tiny, so that CI shapes run several chunks.
LOGITS_BUDGET = {"hopper": 320 * MiB, "blackwell": 160 * MiB, "ampere": 160 * MiB, "cpu": 4 * 1024}
HIP_BUDGET = 128 * MiB
# chunks never go below linear_softmax.FLOOR (256 token rows on a GPU), whatever the budget
_GRAIN = {"gpu": 128, "cpu": 4}       # chunk sizes are multiples of this (GEMM tile friendly)
_CHUNKS = {"gpu": (256, 512, 768, 1024, 1280, 1536, 2048, 3072, 4096, 8192, 16384), "cpu": (4, 8, 16)}


def logits_budget(arch) -> int:
    return HIP_BUDGET if arch.is_hip else LOGITS_BUDGET.get(arch.name, HIP_BUDGET)


def budget_chunk(arch, vocab: int, dtype: torch.dtype) -> int:
    """The largest chunk (a multiple of the grain) whose logits fit the budget, never below the floor."""
    kind = device_kind(arch)
    rows = logits_budget(arch) // (vocab * torch.empty((), dtype=dtype).element_size())
    return max(c for c in (FLOOR[kind], *CHUNKS) if c % _GRAIN[kind] == 0 and (c <= rows or c == FLOOR[kind]))


def _configs(arch, dims, dtype):
    """Chunks under the budget (0: all tokens at once, where they fit) x the cross-entropy heuristic
    launch and its neighbours (half the block, half the warps)."""
    tokens, cap = dims["tokens"], budget_chunk(arch, dims["vocab"], dtype)
    chunks = sorted({c for c in (*_CHUNKS[device_kind(arch)], cap) if c <= cap and c < tokens})
    base = ce_launch(arch, dims["vocab"])
    launches = [base] + [ln for ln in ce_launches(arch, dims["vocab"]) if ln != base
                         and ln["BLOCK_V"] in (base["BLOCK_V"], base["BLOCK_V"] // 2)
                         and ln["num_warps"] in (base["num_warps"], base["num_warps"] // 2)]
    return [FusedLinearCrossEntropyConfig(chunk=c, **launch) for c in chunks + [0] * (tokens <= cap)
            for launch in launches]


def _heuristic(arch, dims, dtype):
    # the largest chunk under the budget (fewest, largest GEMMs; dW read once per chunk), Liger's CE launch
    cap = budget_chunk(arch, dims["vocab"], dtype)
    return FusedLinearCrossEntropyConfig(chunk=0 if dims["tokens"] <= cap else cap, **ce_launch(arch, dims["vocab"]))


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens, hidden, vocab = dims["tokens"], dims["hidden"], dims["vocab"]
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[torch.rand(tokens, generator=g) < 0.1] = -100
    # reduction "sum": dW and dX keep magnitudes the validation tolerance can see
    return Case(args=(x, w, target.to(device), None, -100, "sum", 0.0, 0.0, None, None, 3, True),
                grads=(torch.tensor(1.0, device=device),))


def _plan(preset, arch, quick):
    shapes = ((2048, 65536), (2560, 151936)) + (() if quick else ((2048, 128256), (4096, 151936)))
    tokens = (8192,) if quick else (4096, 8192, 16384)
    return linear_plan(preset, arch, quick, [(t, h, v) for h, v in shapes for t in tokens])


OP = register(Op(
    name="fused_linear_cross_entropy", static=("hidden", "vocab"), dynamic=("tokens",), dims=_dims,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available,
                traced_backward=_traced_backward),
           Impl("torch", fn=fused_linear_cross_entropy_ref)],
    config=FusedLinearCrossEntropyConfig, candidates=_configs, heuristic=_heuristic,
    schema="Tensor x, Tensor weight, Tensor target, Tensor? bias, int ignore_index, str reduction, "
           "float label_smoothing, float lse_square_scale, float? softcap, Tensor? num_items, int grads, "
           "bool inplace",
    fake=_fake, make_case=_make_case, plan=_plan,
    # dW adds one rounding in the weight dtype per chunk (token rows); dX and the loss reduce in fp32
    reduce_len=lambda d: d["tokens"]))
