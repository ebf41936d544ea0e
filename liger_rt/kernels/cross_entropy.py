"""Cross-entropy over a vocabulary: one row per program, online softmax over BLOCK_V chunks.

    loss = liger_rt.ops.cross_entropy(logits, target)                 # logits (rows, vocab)
    loss = liger_rt.ops.cross_entropy(logits, target, label_smoothing=0.1, softcap=30.0)

The forward kernel computes each row's loss *and* its gradient (the Liger-Kernel scheme: one
launch reads the row twice and writes the gradient once), so backward is at most a scale by
grad_output. All arithmetic is fp32 whatever the logits dtype; the gradient is stored in the
logits dtype, like PyTorch's.

Semantics (PyTorch's ``F.cross_entropy`` on fp32 logits, plus three extensions):
- ``reduction="mean"`` divides by the count of non-ignored targets (or by
  ``num_items_in_batch`` when given); an all-ignored batch gives loss 0 and zero gradients
  instead of PyTorch's NaN.
- ``label_smoothing`` eps: ``(1 - eps) * nll + eps * mean_j(-log p_j)`` per row (PyTorch's).
- ``lse_square_scale`` s: the z-loss of PaLM (Liger-Kernel's name for it), ``s * lse**2`` added to
  each non-ignored row's loss, where lse is the row's log-sum-exp (after softcapping).
- ``softcap`` c: Gemma-2's final-logit softcapping, the loss is taken on ``c * tanh(logits / c)``
  and the gradient flows through the tanh.

The module also holds the kernels fused_linear_cross_entropy reuses (the forward kernel, which
can take a per-row gradient scale, and the grad_output scale kernel).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import next_pow2

REDUCTIONS = ("mean", "sum", "none")


# -- reference ----------------------------------------------------------------------------------

def cross_entropy_ref(logits, target, ignore_index: int = -100, reduction: str = "mean", *,
                      label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap=None,
                      num_items_in_batch=None, inplace_backward: bool = False):
    """The loss in fp32 with PyTorch ops (also the `torch` implementation).

    logits (..., vocab), target (...) int; returns a 0-d fp32 tensor, or target's shape for "none".
    `inplace_backward` is accepted for signature parity and ignored.
    """
    _check_args(reduction, label_smoothing, softcap, num_items_in_batch)
    vocab = logits.shape[-1]
    x = logits.reshape(-1, vocab).float()
    t = target.reshape(-1)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    loss = F.cross_entropy(x, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = t != ignore_index
    if lse_square_scale:
        lse = torch.logsumexp(x, dim=-1)
        loss = loss + lse_square_scale * lse.square() * valid
    if reduction == "none":
        return loss.reshape(target.shape)
    total = loss.sum()
    if reduction == "sum" and num_items_in_batch is None:
        return total
    return total / _denominator(valid, num_items_in_batch, total.device)


def _check_args(reduction, label_smoothing, softcap, num_items_in_batch) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; valid: {', '.join(REDUCTIONS)}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap={softcap} must be a positive number (or None to disable)")
    if num_items_in_batch is not None and reduction == "none":
        raise ValueError("num_items_in_batch divides a summed loss; use reduction='sum' or 'mean' with it")


def _denominator(valid: torch.Tensor, num_items_in_batch, device) -> torch.Tensor:
    """fp32 0-d divisor on `device`, without a host sync: the non-ignored count or
    num_items_in_batch; 0 becomes 1 so that an all-ignored batch gives 0, not NaN."""
    if num_items_in_batch is None:
        n = valid.sum().to(torch.float32)
    else:
        n = torch.as_tensor(num_items_in_batch, device=device).to(torch.float32)
    return torch.where(n == 0, torch.ones_like(n), n)


# -- Triton kernels -----------------------------------------------------------------------------

@triton.jit
def _tanh(x):
    # tl.tanh is not in every Triton release (3.6 and 3.9 must both work); exp-based tanh is exact
    # to fp32 rounding in absolute terms, which is what a softcapped logit needs. exp overflow
    # at large |x| saturates correctly to +-1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _cross_entropy_fwd_kernel(
    X, stride_x,              # logits (rows, n_cols), last dim contiguous
    G, stride_g,              # gradient out (may alias X: in place)
    Y,                        # targets (rows,)
    LOSS,                     # fp32 per-row loss out (rows,)
    SCALE,                    # fp32 scalar: gradient scale (1/n for mean, 1 for sum)
    ROW_SCALE,                # fp32 per-row gradient scale (HAS_ROW_SCALE): grad_output of "none"
    n_cols, ignore_index, label_smoothing, lse_square_scale, softcap,
    BLOCK_V: tl.constexpr,
    HAS_GRAD: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_x = X + row * stride_x
    p_g = G + row * stride_g
    y = tl.load(Y + row).to(tl.int64)
    o_v = tl.arange(0, BLOCK_V)

    if y == ignore_index:
        tl.store(LOSS + row, 0.0)
        if HAS_GRAD:
            for start in range(0, n_cols, BLOCK_V):
                o = start + o_v
                tl.store(p_g + o, tl.zeros([BLOCK_V], dtype=tl.float32).to(G.dtype.element_ty), mask=o < n_cols)
        return

    # pass 1: running max m, running sum d of exp(x - m), and the row sum for label smoothing
    m = float("-inf")
    d = 0.0
    b_sum = 0.0
    for start in range(0, n_cols, BLOCK_V):
        o = start + o_v
        m_v = o < n_cols
        x = tl.load(p_x + o, mask=m_v, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            x = softcap * _tanh(x / softcap)
        if HAS_SMOOTHING:
            b_sum += tl.sum(tl.where(m_v, x, 0.0), axis=0)
        x = tl.where(m_v, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)

    m_y = (y >= 0) & (y < n_cols)   # an out-of-range target reads nothing (PyTorch would raise)
    x_y = tl.load(p_x + y, mask=m_y, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x_y = softcap * _tanh(x_y / softcap)
    loss = lse - (1.0 - label_smoothing) * x_y
    if HAS_SMOOTHING:
        loss -= label_smoothing / n_cols * b_sum
    if HAS_Z_LOSS:
        loss += lse_square_scale * lse * lse
    tl.store(LOSS + row, loss)

    # pass 2: d loss / d x = softmax * (1 + 2 s lse) - eps / V - (1 - eps) [j == y], through the cap
    if HAS_GRAD:
        scale = tl.load(SCALE).to(tl.float32)
        if HAS_ROW_SCALE:
            scale *= tl.load(ROW_SCALE + row).to(tl.float32)
        p_scale = scale
        if HAS_Z_LOSS:
            p_scale = scale * (1.0 + 2.0 * lse_square_scale * lse)
        for start in range(0, n_cols, BLOCK_V):
            o = start + o_v
            m_v = o < n_cols
            x = tl.load(p_x + o, mask=m_v, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(x / softcap)
                x = softcap * t
            g = tl.exp(x - lse) * p_scale
            if HAS_SMOOTHING:
                g -= label_smoothing / n_cols * scale
            g = tl.where(o == y, g - (1.0 - label_smoothing) * scale, g)
            if HAS_SOFTCAP:
                g *= 1.0 - t * t
            tl.store(p_g + o, g.to(G.dtype.element_ty), mask=m_v)


@triton.jit
def _scale_kernel(G, S, numel, BLOCK: tl.constexpr):
    """G *= S[0] over a flat contiguous tensor; reads nothing else when S[0] == 1 (the usual
    grad_output of a loss), so backward costs one launch and no host sync."""
    s = tl.load(S).to(tl.float32)
    if s != 1.0:
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = o < numel
        g = tl.load(G + o, mask=m, other=0.0).to(tl.float32)
        tl.store(G + o, (g * s).to(G.dtype.element_ty), mask=m)


@triton.jit
def _scale_rows_kernel(G, stride_g, S, n_cols, BLOCK: tl.constexpr):
    """G[r, :] *= S[r] (grad_output of reduction="none")."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(S + row).to(tl.float32)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < n_cols
    g = tl.load(G + row * stride_g + o, mask=m, other=0.0).to(tl.float32)
    tl.store(G + row * stride_g + o, (g * s).to(G.dtype.element_ty), mask=m)


# -- launchers ----------------------------------------------------------------------------------

def cross_entropy_fwd(logits: torch.Tensor, target: torch.Tensor, config, *, ignore_index: int = -100,
                      label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap=None,
                      grad: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                      row_scale: torch.Tensor | None = None, loss: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row fp32 losses of 2-D `logits` (rows, vocab), last dim contiguous; when `grad` is
    given (it may be `logits` itself), the gradient of sum(loss * scale * row_scale) goes there.

    scale: fp32 1-element device tensor (default 1); row_scale: fp32 (rows,) or None.
    """
    rows, n_cols = logits.shape
    if logits.stride(1) != 1 or (grad is not None and grad.stride(1) != 1):
        raise ValueError("cross_entropy_fwd takes logits and grad with a contiguous last dim; "
                         "the functional makes them so")
    if target.shape != (rows,):
        raise ValueError(f"target has shape {tuple(target.shape)}, expected ({rows},) for logits {tuple(logits.shape)}")
    if loss is None:
        loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows == 0:
        return loss
    if scale is None:
        scale = torch.ones(1, device=logits.device, dtype=torch.float32)
    has_grad = grad is not None
    block = min(int(config.get("BLOCK_V", 1024)), next_pow2(n_cols))
    _cross_entropy_fwd_kernel[(rows,)](
        logits, logits.stride(0),
        grad if has_grad else logits, grad.stride(0) if has_grad else 0,
        target, loss, scale, row_scale if row_scale is not None else scale,
        n_cols, int(ignore_index), float(label_smoothing), float(lse_square_scale),
        float(softcap) if softcap is not None else 1.0,
        BLOCK_V=block, HAS_GRAD=has_grad, HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_Z_LOSS=lse_square_scale != 0.0, HAS_SOFTCAP=softcap is not None,
        HAS_ROW_SCALE=row_scale is not None,
        num_warps=int(config.get("num_warps", 8)),
    )
    return loss


_SCALE_BLOCK = 4096


def scale_(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """t *= s in place, s a 1-element device tensor (no host sync; nothing moves when s == 1)."""
    if t.numel() == 0:
        return t
    if not t.is_contiguous():
        raise ValueError("scale_ takes a contiguous tensor")
    s = s.reshape(1).to(torch.float32)
    _scale_kernel[(triton.cdiv(t.numel(), _SCALE_BLOCK),)](t, s, t.numel(), BLOCK=_SCALE_BLOCK, num_warps=4)
    return t


def scale_rows_(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """t[r, :] *= s[r] in place for a 2-D `t` with a contiguous last dim."""
    rows, n_cols = t.shape
    if rows == 0 or n_cols == 0:
        return t
    s = s.reshape(rows).to(torch.float32).contiguous()
    block = min(_SCALE_BLOCK, next_pow2(n_cols))
    _scale_rows_kernel[(rows, triton.cdiv(n_cols, block))](t, t.stride(0), s, n_cols, BLOCK=block, num_warps=4)
    return t


def _grad_scale(valid: torch.Tensor, reduction: str, num_items_in_batch, device) -> torch.Tensor:
    """fp32 (1,) gradient scale of the summed per-row losses: 1/n for mean or with num_items."""
    if reduction == "none" or (reduction == "sum" and num_items_in_batch is None):
        return torch.ones(1, device=device, dtype=torch.float32)
    return (1.0 / _denominator(valid, num_items_in_batch, device)).reshape(1)


def _reduce(loss_rows: torch.Tensor, scale: torch.Tensor, reduction: str, shape) -> torch.Tensor:
    if reduction == "none":
        return loss_rows.reshape(shape)
    return loss_rows.sum() * scale[0]


def _increment_version(t: torch.Tensor) -> None:
    fn = getattr(torch.autograd.graph, "increment_version", None)
    if fn is not None:
        fn(t)


# -- autograd.Function --------------------------------------------------------------------------

class CrossEntropyFunction(torch.autograd.Function):
    """Loss and gradient in one forward launch; backward scales the stored gradient."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                num_items_in_batch, inplace, config, grad_enabled=True):
        # logits: 2-D, last dim contiguous (the functional flattens); target: (rows,).
        # grad_enabled: torch.is_grad_enabled() of the caller (forward itself runs without grad mode,
        # and needs_input_grad stays True under torch.no_grad()).
        valid = target != ignore_index
        scale = _grad_scale(valid, reduction, num_items_in_batch, logits.device)
        needs_grad = ctx.needs_input_grad[0] and grad_enabled
        grad = None
        if needs_grad:
            grad = logits if inplace else torch.empty_like(logits)
        loss_rows = cross_entropy_fwd(logits, target, config, ignore_index=ignore_index,
                                      label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
                                      softcap=softcap, grad=grad, scale=scale)
        if needs_grad and inplace:
            # the logits now hold their gradient: bump the version counter so that any other autograd
            # node that saved these logits raises at backward instead of silently using gradients
            _increment_version(logits)
        ctx.reduction = reduction
        ctx.grad = grad
        return _reduce(loss_rows, scale, reduction, target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError("liger_rt cross_entropy computes its gradient in forward and hands it out once: "
                               "backward through the same graph twice (retain_graph=True) is not supported; "
                               "recompute the loss instead")
        ctx.grad = None   # released now, so autograd can hand the buffer on without a copy
        if ctx.reduction == "none":
            scale_rows_(grad, grad_output.reshape(-1))
        else:
            scale_(grad, grad_output)
        return grad, None, None, None, None, None, None, None, None, None, None


# -- functional ---------------------------------------------------------------------------------

@torch.compiler.disable
def _apply(fn, *args):
    # Under torch.compile the Triton launches and the gradient handed over from forward run eagerly
    # (one graph break at the loss, the last op of a model) rather than being traced. Autocast is off
    # inside: the launchers chose the dtypes, and matmuls with out= must not be re-cast.
    device_type = args[0].device.type
    with torch.autocast(device_type=device_type, enabled=False):
        return fn.apply(*args)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                  *, label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                  num_items_in_batch=None, inplace_backward: bool = False) -> torch.Tensor:
    """Cross-entropy of `logits` (..., vocab) against integer `target` (...), fp32 result.

    reduction: "mean" (over non-ignored targets, 0 when all are ignored), "sum" or "none"
    (target's shape). label_smoothing (PyTorch's), lse_square_scale (z-loss, s * lse**2 per row),
    softcap (loss on c * tanh(logits / c)): see the module docstring. num_items_in_batch (int or
    tensor): divide the summed loss by it instead (HF's gradient-accumulation convention).

    inplace_backward=True writes the gradient over `logits` during forward (Liger-Kernel's
    behaviour: no second logits-sized buffer). Safe only when the logits are a temporary that
    nothing else reads afterwards (e.g. an lm_head output that is not returned to the caller). The
    logits' autograd version counter is bumped, so another op that saved them for its backward
    raises instead of computing garbage; leaf tensors and non-contiguous inputs are never
    overwritten (they get a separate gradient buffer). Default False: the gradient gets its own
    buffer and `logits` keep their values.

    Example: logits (4, 128, 151936) bf16 and labels (4, 128) -> cross_entropy(logits, labels)
    """
    _check_args(reduction, label_smoothing, softcap, num_items_in_batch)
    vocab = logits.shape[-1]
    x2d = logits.reshape(-1, vocab)
    t1d = target.reshape(-1)
    if t1d.numel() != x2d.shape[0]:
        raise ValueError(f"target {tuple(target.shape)} does not match logits {tuple(logits.shape)} "
                         f"(expected {tuple(logits.shape[:-1])})")
    d = OP.select(x2d, rows=x2d.shape[0], vocab=vocab)
    if d.impl == "torch":
        return cross_entropy_ref(logits, target, ignore_index, reduction, label_smoothing=label_smoothing,
                                 lse_square_scale=lse_square_scale, softcap=softcap,
                                 num_items_in_batch=num_items_in_batch)
    inplace = bool(inplace_backward) and x2d.stride(-1) == 1 and not logits.is_leaf
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    loss = _apply(CrossEntropyFunction, x2d, t1d.contiguous(), int(ignore_index), reduction, float(label_smoothing),
                                      float(lse_square_scale), None if softcap is None else float(softcap),
                                      num_items_in_batch, inplace, d.config, torch.is_grad_enabled())
    return loss.reshape(target.shape) if reduction == "none" else loss


# -- registration -------------------------------------------------------------------------------

from ..dispatch import Impl, Op, register  # noqa: E402
from ._common import triton_available  # noqa: E402


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, vocab = dims["rows"], dims["vocab"]
    logits = (torch.randn(rows, vocab, generator=g) * 2.0).to(device, dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < 0.1] = -100   # some padding, as in real batches
    return {"logits": logits, "target": target.to(device), "dy": torch.tensor(1.0, device=device)}


def _run_torch(case, config):
    loss = cross_entropy_ref(case["logits"], case["target"])
    return [loss, *torch.autograd.grad(loss, (case["logits"],), case["dy"])]


def _run_triton(case, config):
    logits = case["logits"]
    loss = CrossEntropyFunction.apply(logits, case["target"], -100, "mean", 0.0, 0.0, None, None, False, config)
    return [loss, *torch.autograd.grad(loss, (logits,), case["dy"])]


def _configs(arch, dims, dtype):
    """BLOCK_V x num_warps, 4..64 fp32 elements per thread, BLOCK_V at most the padded vocab."""
    vmax = next_pow2(dims["vocab"])
    if arch.name == "cpu":   # the interpreter ignores warps; larger blocks mean fewer Python loop trips
        return [{"BLOCK_V": min(b, vmax), "num_warps": 4} for b in (64, 256, 1024)]
    out = []
    for block in (1024, 2048, 4096, 8192, 16384, 32768):
        for warps in (4, 8, 16, 32):
            per_thread = block // (warps * arch.warp_size)
            if 4 <= per_thread <= 64 and block <= max(vmax, 1024):
                out.append({"BLOCK_V": block, "num_warps": warps})
    return out


def _heuristic(arch, dims, dtype):
    # Liger-Kernel's launch (BLOCK = min(32768, next_pow2(V)), 32 warps on CUDA, 16 wave64 on HIP):
    # the one used at these vocab sizes upstream; to be measured per arch by the sweep.
    vmax = next_pow2(dims["vocab"])
    if arch.name == "cpu":
        return {"BLOCK_V": min(1024, vmax), "num_warps": 4}
    block = min(32768, vmax)
    warps = 16 if arch.warp_size == 64 else 32
    while warps > 4 and block // (warps * arch.warp_size) < 4:
        warps //= 2
    return {"BLOCK_V": block, "num_warps": min(warps, arch.max_num_warps)}


def _plan(preset, arch, quick):
    if arch.name == "cpu":
        vocab = preset.vocab if (preset is not None and preset.tiny) else 199
        return [{"rows": 16, "vocab": vocab}] if quick else [{"rows": r, "vocab": vocab} for r in (16, 64)]
    if preset is not None:
        tokens = preset.quick_tokens if quick else preset.tokens
        return [{"rows": t, "vocab": preset.vocab} for t in tokens]
    vocabs = (151936,) if quick else (32000, 65536, 128256, 151936)
    rows = (8192,) if quick else (4096, 8192, 16384)
    return [{"rows": r, "vocab": v} for v in vocabs for r in rows]


OP = register(Op(
    name="cross_entropy", static=("vocab",), dynamic=("rows",),
    impls=[Impl("triton", run=_run_triton, available=triton_available, configs=_configs, heuristic=_heuristic),
           Impl("torch", run=_run_torch)],
    make_case=_make_case, plan=_plan,
    # fp32 accumulation: the loss and gradient differ from the fp32 reference by rounding only
    reduce_len=lambda d: 1,
))
