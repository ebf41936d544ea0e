"""Cross-entropy over a vocabulary: one row per program, online softmax over BLOCK_V chunks.

    loss = liger_rt.ops.cross_entropy(logits, target, label_smoothing=0.1)     # logits (rows, vocab)

Forward: one pass over each row gives the loss and its log-sum-exp, saved (4 bytes a row).
Backward: one pass writes the gradient with grad_output folded in: Liger-Kernel's traffic (two
reads and one write of the logits) without its second logits-sized buffer or scale pass.  All
arithmetic is fp32; the gradient is stored in the logits dtype, like PyTorch's.

Semantics (PyTorch's ``F.cross_entropy`` on fp32 logits, plus three extensions):
- ``reduction="mean"`` divides by the count of non-ignored targets (or by ``num_items_in_batch``);
  an all-ignored batch gives loss 0 and zero gradients instead of PyTorch's NaN.
- ``label_smoothing`` eps: ``(1 - eps) * nll + eps * mean_j(-log p_j)`` per row (PyTorch's).
- ``lse_square_scale`` s: PaLM's z-loss, ``s * lse**2`` added to each non-ignored row's loss.
- ``softcap`` c: Gemma-2's final-logit softcapping, the loss is taken on ``c * tanh(logits / c)``.
- A target outside [0, vocab) that is not ``ignore_index`` gives that row a NaN loss and NaN
  gradient on every implementation, the torch one included (PyTorch's ``F.cross_entropy`` raises).
  Raising needs the targets on the host, a device sync per call that stops the host running ahead
  of the GPU; ``tl.device_assert`` is compiled out unless Triton runs with debug on, and when it
  fires it leaves the CUDA context unusable.

The argument checks, the reduction, the launch space and the online softmax of the forward pass are
the linear-softmax family's (linear_softmax.py), shared with the fused linear losses.
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
from ._common import as_rows, next_pow2, to_dtype, triton_available
from .linear_softmax import (ce_launch, ce_launches, check_args, check_target, denominator, grad_scale,
                             increment_version, online_softmax, out_of_range, reduce_rows, tanh, zero_row)


def cross_entropy_ref(logits, target, ignore_index: int = -100, reduction: str = "mean",
                      label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap=None,
                      num_items_in_batch=None, inplace_backward: bool = False):
    """The loss in fp32 with PyTorch ops (the `torch` implementation; `inplace_backward` is ignored):
    logits (..., vocab), target (...) int -> 0-d fp32, or target's shape for "none".  A target outside [0, vocab)
    that is not ignore_index gives the kernel's NaN loss and NaN gradient row (module docstring), not an error."""
    check_args("cross_entropy", reduction, label_smoothing, softcap, num_items_in_batch)
    vocab = logits.shape[-1]
    x = logits.reshape(-1, vocab).float()
    t = target.reshape(-1).long()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    bad = out_of_range(t, ignore_index, vocab)
    safe = torch.where(bad, 0 if ignore_index != 0 else vocab - 1, t)     # a class, not ignore_index
    loss = F.cross_entropy(x, safe, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = t != ignore_index
    if lse_square_scale:
        lse = torch.logsumexp(x, dim=-1)
        loss = loss + lse_square_scale * lse.square() * valid
    loss = loss * torch.where(bad, float("nan"), 1.0)       # NaN there, and NaN through its gradient row
    if reduction == "none":
        return loss.reshape(target.shape)
    total = loss.sum()
    if reduction == "sum" and num_items_in_batch is None:
        return total
    return total / denominator(valid, num_items_in_batch, total.device)


@triton.jit
def _cross_entropy_kernel(
    X, stride_x,              # logits (rows, n_cols), last dim contiguous
    G, stride_g,              # gradient out (HAS_GRAD; may be X itself: in place)
    Y,                        # targets (rows,)
    LOSS, LSE,                # fp32 (rows,): written by the forward pass (FWD), LSE read otherwise
    SCALE, stride_s,          # fp32 gradient scale: one (stride_s 0) or one per row (stride_s 1)
    n_cols, ignore_index, label_smoothing, lse_square_scale, softcap,
    BLOCK_V: tl.constexpr, FWD: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, RNE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_x = X + row * stride_x
    p_g = G + row * stride_g
    y = tl.load(Y + row).to(tl.int64)

    if y == ignore_index:
        if FWD:
            tl.store(LOSS + row, 0.0)
            tl.store(LSE + row, 0.0)
        if HAS_GRAD:
            zero_row(p_g, n_cols, BLOCK_V)
        return

    in_range = (y >= 0) & (y < n_cols)   # outside: NaN loss and gradient (see the module docstring)
    if FWD:
        # one online pass: running max m, running sum d of exp(x - m), and the row sum for label smoothing
        m, d, _, x_sum = online_softmax(p_x, p_x, n_cols, 1.0, softcap, BLOCK_V, HAS_SOFTCAP=HAS_SOFTCAP,
                                        ROW_SUM=HAS_SMOOTHING)
        lse = m + tl.log(d)
        x_y = tl.load(p_x + y, mask=in_range, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            x_y = softcap * tanh(x_y / softcap)
        loss = lse - (1.0 - label_smoothing) * x_y
        if HAS_SMOOTHING:
            loss -= label_smoothing / n_cols * x_sum
        if HAS_Z_LOSS:
            loss += lse_square_scale * lse * lse
        tl.store(LOSS + row, tl.where(in_range, loss, float("nan")))
        tl.store(LSE + row, lse)
    else:
        lse = tl.load(LSE + row)

    # d loss / d x = softmax * (1 + 2 s lse) - eps / V - (1 - eps) [j == y], through the cap
    if HAS_GRAD:
        scale = tl.where(in_range, tl.load(SCALE + row * stride_s), float("nan"))
        p_scale = scale
        if HAS_Z_LOSS:
            p_scale = scale * (1.0 + 2.0 * lse_square_scale * lse)
        o_v = tl.arange(0, BLOCK_V)
        for start in range(0, n_cols, BLOCK_V):
            o = start + o_v
            m_v = o < n_cols
            x = tl.load(p_x + o, mask=m_v, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = tanh(x / softcap)
                x = softcap * t
            g = tl.exp(x - lse) * p_scale
            if HAS_SMOOTHING:
                g -= label_smoothing / n_cols * scale
            g = tl.where(o == y, g - (1.0 - label_smoothing) * scale, g)
            if HAS_SOFTCAP:
                g *= 1.0 - t * t
            tl.store(p_g + o, to_dtype(g, G.dtype.element_ty, RNE_BF16), mask=m_v)


def cross_entropy_rows(config, logits, target, loss, lse, ignore_index, label_smoothing, lse_square_scale,
                       softcap, *, grad=None, scale=None, fwd=True) -> None:
    """One launch over `logits` (rows, vocab), last dim contiguous, and targets (rows,).  fwd: fp32
    losses into `loss`, log-sum-exps into `lse`; else `lse` is read.  With `grad` (may be `logits`)
    the gradient of sum(loss * scale) goes there; scale is fp32 (1,) or (rows,)."""
    rows, n_cols = logits.shape
    if rows == 0:
        return
    _cross_entropy_kernel[(rows,)](
        logits, logits.stride(0), logits if grad is None else grad, 0 if grad is None else grad.stride(0),
        target, lse if loss is None else loss, lse, lse if scale is None else scale,
        0 if scale is None or scale.numel() == 1 else 1,
        n_cols, int(ignore_index), float(label_smoothing), float(lse_square_scale),
        1.0 if softcap is None else float(softcap),
        BLOCK_V=min(config.BLOCK_V, next_pow2(n_cols)), FWD=fwd, HAS_GRAD=grad is not None,
        HAS_SMOOTHING=label_smoothing > 0.0, HAS_Z_LOSS=lse_square_scale != 0.0, HAS_SOFTCAP=softcap is not None,
        RNE_BF16=interpreter_on(), num_warps=config.num_warps)


def _forward(config, logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
             num_items, inplace):
    x, t = as_rows(logits, logits.shape[-1]), target.reshape(-1).contiguous()
    loss = torch.empty(t.shape[0], device=x.device, dtype=torch.float32)
    lse = torch.empty_like(loss)
    cross_entropy_rows(config, x, t, loss, lse, ignore_index, label_smoothing, lse_square_scale, softcap)
    scale = grad_scale(t, ignore_index, reduction, num_items)
    return (reduce_rows(loss, scale, reduction, target.shape),), (lse, scale)


def _backward(config, args, saved, needs, dloss):
    logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, num_items, inplace = args
    none = (None,) * (len(args) - 1)
    if not needs[0]:
        return (None, *none)
    lse, scale = saved
    x = as_rows(logits, logits.shape[-1])
    grad = x if inplace else torch.empty_like(x)
    s = dloss.reshape(-1).float().contiguous() if reduction == "none" else scale * dloss.float()
    cross_entropy_rows(config, x, target.reshape(-1).contiguous(), None, lse, ignore_index, label_smoothing,
                       lse_square_scale, softcap, grad=grad, scale=s, fwd=False)
    if inplace:
        increment_version(logits)     # a second backward through this graph now raises
    return (grad.view(logits.shape), *none)


def _fake(config, logits, target, ignore_index, reduction, *rest):
    f32 = torch.float32
    loss = logits.new_empty(target.shape if reduction == "none" else (), dtype=f32)
    return (loss,), (logits.new_empty((target.numel(),), dtype=f32), logits.new_empty((1,), dtype=f32))


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig(Config):
    BLOCK_V: int = knob(1024, pow2(1, 65536))     # vocab columns per loop trip (clamped to the vocab)
    num_warps: int = knob(8, WARPS)


def _dims(logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, num_items,
          inplace) -> dict:
    check_args("cross_entropy", reduction, label_smoothing, softcap, num_items)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"cross_entropy: logits must be (..., vocab) with vocab >= 1, got {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    check_target("cross_entropy", target, logits.numel() // vocab, f"logits {tuple(logits.shape)}", logits.device)
    return {"rows": target.numel(), "vocab": vocab}


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                  *, label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                  num_items_in_batch=None, inplace_backward: bool = False) -> torch.Tensor:
    """Cross-entropy of `logits` (..., vocab) against integer `target` (...), fp32 result; the
    options are the module docstring's.  num_items_in_batch (int or tensor) divides the summed
    loss instead (HF's gradient-accumulation convention).  inplace_backward=True writes the
    gradient over `logits` (no second logits-sized buffer): safe only when nothing reads them after
    the backward.  Their autograd version is bumped, so another op that saved them raises in its
    backward; leaf tensors are never overwritten, nor are compiled graphs' inputs.
    Example: logits (4, 128, 151936) bf16 and labels (4, 128) -> cross_entropy(logits, labels)
    """
    if logits.dim() >= 1 and logits.stride(-1) != 1:
        logits = logits.contiguous()
    inplace = bool(inplace_backward) and not logits.is_leaf and not torch.compiler.is_compiling()
    if isinstance(num_items_in_batch, (int, float)):
        num_items_in_batch = torch.full((), float(num_items_in_batch), device=logits.device)
    return call(OP, logits, target, int(ignore_index), str(reduction), float(label_smoothing),
                float(lse_square_scale), None if softcap is None else float(softcap), num_items_in_batch, inplace)


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, vocab = dims["rows"], dims["vocab"]
    logits = (torch.randn(rows, vocab, generator=g) * 2.0).to(device, dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < 0.1] = -100   # some padding, as in real batches
    return Case(args=(logits, target.to(device), -100, "mean", 0.0, 0.0, None, None, False),
                grads=(torch.tensor(1.0, device=device),))


def _configs(arch, dims, dtype):
    return [CrossEntropyConfig(**launch) for launch in ce_launches(arch, dims["vocab"])]


def _heuristic(arch, dims, dtype):
    return CrossEntropyConfig(**ce_launch(arch, dims["vocab"]))


def _plan(preset, arch, quick):
    if arch.name == "cpu":
        vocab = preset.vocab if (preset is not None and preset.tiny) else 199
        return [{"rows": r, "vocab": vocab} for r in ((16,) if quick else (16, 64))]
    if preset is not None:
        tokens = preset.quick_tokens if quick else preset.tokens
        return [{"rows": t, "vocab": preset.vocab} for t in tokens]
    vocabs = (151936,) if quick else (32000, 65536, 128256, 151936)
    rows = (8192,) if quick else (4096, 8192, 16384)
    return [{"rows": r, "vocab": v} for v in vocabs for r in rows]


OP = register(Op(
    name="cross_entropy", static=("vocab",), dynamic=("rows",), dims=_dims,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available),
           Impl("torch", fn=cross_entropy_ref)],
    config=CrossEntropyConfig, candidates=_configs, heuristic=_heuristic, fake=_fake, make_case=_make_case, plan=_plan,
    # reduce_len 1 (the default): fp32 accumulation, the loss and gradient differ from the reference by rounding only
    schema="Tensor logits, Tensor target, int ignore_index, str reduction, float label_smoothing, "
           "float lse_square_scale, float? softcap, Tensor? num_items, bool inplace"))
