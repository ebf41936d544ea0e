"""Fused linear + cross-entropy: the lm_head matmul and the loss, chunked over tokens, so the full
(tokens, vocab) logits never exist.

    loss = liger_rt.ops.fused_linear_cross_entropy(hidden, lm_head.weight, labels)

For each chunk of `chunk` token rows:
  1. logits = x[chunk] @ W.T (+ b)             cuBLAS, into one reused (chunk, vocab) buffer, x's dtype
  2. loss rows and dlogits, in place            the cross-entropy Triton kernel (fp32 math)
  3. dX[chunk] = dlogits @ W                    cuBLAS, written into the dX buffer
     dW (+)= dlogits.T @ x[chunk]               cuBLAS addmm with beta=1, accumulated in W's dtype
     db += dlogits.sum(0)                       fp32
Gradients are computed in forward (as Liger-Kernel does), so backward is only a scale by
grad_output (a launch that moves nothing when grad_output == 1, the usual case).

Memory: beyond the inputs, one chunk of logits (chunk * vocab * elt bytes) plus dX and dW, which
autograd would allocate anyway. dW accumulates in the weight dtype rather than fp32: an fp32 dW is
2x the bf16 one (1.56 GB at V151936 H2560), which alone breaks the 1.0 GB budget that shape has;
the price is one bf16 rounding per chunk (each addmm accumulates in fp32 inside cuBLAS and rounds
once), the trade Liger-Kernel makes too. In fp16 the per-chunk dlogits are stored unscaled and the
1/n of "mean" is applied to dX/dW afterwards, because p/n underflows fp16 at large batches.

reduction="none" cannot fold a per-row grad_output into a dW summed in forward: forward then
computes the loss only, and backward recomputes each chunk's logits (one extra GEMM).

The chunk size is a dispatch decision (config "chunk": token rows, 0 = all), together with the
cross-entropy kernel's BLOCK_V and num_warps; see `_configs` / `_heuristic` for the memory budget.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cross_entropy import (
    _apply, _check_args, _grad_scale, _reduce, cross_entropy_fwd, cross_entropy_ref, scale_,
    _configs as _ce_configs, _heuristic as _ce_heuristic,
)


# -- reference ----------------------------------------------------------------------------------

def fused_linear_cross_entropy_ref(x, weight, target, bias=None, ignore_index: int = -100, reduction: str = "mean",
                                   *, label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap=None,
                                   num_items_in_batch=None):
    """The plain PyTorch loss: logits = x @ W.T (+ b) in x's dtype, then cross-entropy in fp32
    (also the `torch` implementation; it materialises the full logits)."""
    logits = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return cross_entropy_ref(logits, target, ignore_index, reduction, label_smoothing=label_smoothing,
                             lse_square_scale=lse_square_scale, softcap=softcap,
                             num_items_in_batch=num_items_in_batch)


# -- launcher -----------------------------------------------------------------------------------

def _chunk_rows(config, tokens: int) -> int:
    chunk = int(config.get("chunk", 0))
    return max(1, tokens) if chunk <= 0 or chunk >= tokens else chunk


def flce_chunks(x, weight, bias, target, config, *, ignore_index, label_smoothing, lse_square_scale, softcap,
                kscale, row_scale=None, loss_rows=None, gx=None, gw=None, gb=None, with_grad=True):
    """Run the chunk loop over 2-D x (tokens, hidden), weight (vocab, hidden): per-row fp32 losses
    into `loss_rows` and, with_grad, dX into gx, dW into gw (overwritten), fp32 db added into gb.

    kscale: fp32 (1,) scale of the stored dlogits; row_scale: fp32 (tokens,) or None.
    """
    tokens = x.shape[0]
    vocab = weight.shape[0]
    if loss_rows is None:
        loss_rows = torch.empty(tokens, device=x.device, dtype=torch.float32)
    if tokens == 0:
        if gw is not None:
            gw.zero_()
        return loss_rows
    chunk = _chunk_rows(config, tokens)
    buf = torch.empty(min(chunk, tokens), vocab, device=x.device, dtype=x.dtype)
    wt = weight.t()
    for i, start in enumerate(range(0, tokens, chunk)):
        end = min(start + chunk, tokens)
        xc = x[start:end]
        logits = buf[: end - start]
        if bias is None:
            torch.matmul(xc, wt, out=logits)
        else:
            torch.addmm(bias, xc, wt, out=logits)
        cross_entropy_fwd(logits, target[start:end], config, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
                          grad=logits if with_grad else None, scale=kscale,
                          row_scale=None if row_scale is None else row_scale[start:end],
                          loss=loss_rows[start:end])
        if not with_grad:
            continue
        if gx is not None:
            torch.matmul(logits, weight, out=gx[start:end])
        if gw is not None:
            if i == 0:
                torch.matmul(logits.t(), xc, out=gw)   # beta = 0: no zero-fill, no read of gw
            else:
                gw.addmm_(logits.t(), xc)
        if gb is not None:
            gb += logits.sum(0, dtype=torch.float32)
    return loss_rows


# -- autograd.Function --------------------------------------------------------------------------

class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Loss and gradients in forward, chunked; backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                num_items_in_batch, config, grad_enabled=True):
        # x (tokens, hidden) contiguous, weight (vocab, hidden) contiguous in x's dtype, target (tokens,),
        # bias (vocab,) or None; grad_enabled: torch.is_grad_enabled() of the caller.
        needs = [bool(n) and grad_enabled for n in ctx.needs_input_grad[:4]]
        need_x, need_w, need_b = needs[0], needs[1], needs[3] and bias is not None
        valid = target != ignore_index
        scale = _grad_scale(valid, reduction, num_items_in_batch, x.device)
        kw = dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                  lse_square_scale=lse_square_scale, softcap=softcap)
        ctx.mode, ctx.grads, ctx.post = "none", None, None
        any_grad = need_x or need_w or need_b
        if any_grad and reduction == "none":
            loss_rows = flce_chunks(x, weight, bias, target, config, kscale=scale, with_grad=False, **kw)
            ctx.mode = "recompute"
            ctx.save_for_backward(x, weight, bias, target)
            ctx.needs = (need_x, need_w, need_b)
            ctx.kw, ctx.config = kw, dict(config)
        elif any_grad:
            # fp16: p / n underflows at large n, so store unscaled dlogits and scale dX/dW afterwards
            defer = x.dtype == torch.float16
            kscale = torch.ones_like(scale) if defer else scale
            gx = torch.empty_like(x) if need_x else None
            gw = torch.empty_like(weight) if need_w else None
            gb = torch.zeros(weight.shape[0], device=x.device, dtype=torch.float32) if need_b else None
            loss_rows = flce_chunks(x, weight, bias, target, config, kscale=kscale, gx=gx, gw=gw, gb=gb, **kw)
            if gb is not None:
                gb = gb.to(bias.dtype)
            ctx.mode = "grads"
            ctx.grads = (gx, gw, gb)
            ctx.post = scale if defer else None
        else:
            loss_rows = flce_chunks(x, weight, bias, target, config, kscale=scale, with_grad=False, **kw)
        return _reduce(loss_rows, scale, reduction, target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.mode == "recompute":
            x, weight, bias, target = ctx.saved_tensors
            need_x, need_w, need_b = ctx.needs
            gx = torch.empty_like(x) if need_x else None
            gw = torch.empty_like(weight) if need_w else None
            gb = torch.zeros(weight.shape[0], device=x.device, dtype=torch.float32) if need_b else None
            ones = torch.ones(1, device=x.device, dtype=torch.float32)
            with torch.autocast(device_type=x.device.type, enabled=False):
                flce_chunks(x, weight, bias, target, ctx.config, kscale=ones,
                            row_scale=grad_output.reshape(-1).to(torch.float32).contiguous(),
                            gx=gx, gw=gw, gb=gb, **ctx.kw)
            if gb is not None:
                gb = gb.to(bias.dtype)
        else:
            if ctx.grads is None:
                raise RuntimeError(
                    "liger_rt fused_linear_cross_entropy computes its gradients in forward and hands them out once: "
                    "backward through the same graph twice (retain_graph=True) is not supported; recompute the loss")
            gx, gw, gb = ctx.grads
            ctx.grads = None   # released now: autograd takes the buffers over without a copy
            s = grad_output.reshape(1).to(torch.float32)
            if ctx.post is not None:
                s = s * ctx.post
            for t in (gx, gw, gb):
                if t is not None:
                    scale_(t, s)
        return gx, gw, None, gb, None, None, None, None, None, None, None, None


# -- functional ---------------------------------------------------------------------------------

def _autocast_dtype(device: torch.device):
    """The autocast dtype active for `device`, or None."""
    try:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
    except (TypeError, AttributeError, RuntimeError):   # an older torch or an exotic device type
        pass
    return None


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               reduction: str = "mean", *, label_smoothing: float = 0.0,
                               lse_square_scale: float = 0.0, softcap: float | None = None,
                               num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy of x @ weight.T (+ bias) against `target`, without materialising the logits.

    x (..., hidden) — leading dims are flattened; weight (vocab, hidden) — e.g. lm_head.weight,
    possibly tied to the input embedding (it is only read; its gradient is returned to autograd,
    which sums it with the embedding's); target (...) int, the same leading dims as x; bias (vocab,).
    weight/bias in another dtype than x are cast to x's dtype (differentiably: the cast costs one
    copy of W); under torch.autocast, x, weight and bias are cast to the autocast dtype first, as
    F.linear would be. Returns a 0-d fp32 loss, or target's shape for reduction="none".
    ignore_index, reduction, label_smoothing, lse_square_scale (z-loss), softcap and
    num_items_in_batch mean what they mean in `liger_rt.ops.cross_entropy`.

    A Hugging Face causal-LM loss (``transformers.loss.loss_utils.ForCausalLMLoss``) maps onto it
    as follows: shifting the labels is the caller's job, every position's hidden state is kept::

        y = F.pad(labels, (0, 1), value=-100)[..., 1:]   # HF's shift (or its `shift_labels` kwarg)
        loss = fused_linear_cross_entropy(hidden_states, model.lm_head.weight, y, ignore_index=-100,
                                          num_items_in_batch=num_items_in_batch)

    num_items_in_batch=None gives HF's "mean" over non-ignored labels; a given num_items_in_batch
    gives HF's ``reduction="sum"`` then ``/ num_items_in_batch``, fused (the division is applied to
    dlogits inside the kernel, so no extra pass over dW; reduction may be "sum" or "mean" then,
    both mean sum / num_items_in_batch). Gemma-2's ``final_logit_softcapping`` is `softcap`.
    Example: h (4, 2048, 2560) bf16, W (151936, 2560) bf16, y (4, 2048) -> 0-d loss.
    """
    _check_args(reduction, label_smoothing, softcap, num_items_in_batch)
    hidden = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != hidden:
        raise ValueError(f"weight must be (vocab, hidden={hidden}); got {tuple(weight.shape)}")
    vocab = weight.shape[0]
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias must be ({vocab},); got {tuple(bias.shape)}")
    x2d = x.reshape(-1, hidden)
    t1d = target.reshape(-1)
    if t1d.numel() != x2d.shape[0]:
        raise ValueError(f"target {tuple(target.shape)} does not match x {tuple(x.shape)} "
                         f"(expected {tuple(x.shape[:-1])}); shift labels before the call")
    amp = _autocast_dtype(x.device)
    if amp is not None and x2d.dtype != amp:   # what F.linear would do under autocast
        x2d = x2d.to(amp)
    d = OP.select(x2d, tokens=x2d.shape[0], hidden=hidden, vocab=vocab)
    if d.impl == "torch":
        return fused_linear_cross_entropy_ref(x2d.reshape(x.shape[:-1] + (hidden,)), weight, target, bias,
                                              ignore_index, reduction, label_smoothing=label_smoothing,
                                              lse_square_scale=lse_square_scale, softcap=softcap,
                                              num_items_in_batch=num_items_in_batch)
    if weight.dtype != x2d.dtype:
        weight = weight.to(x2d.dtype)
    if bias is not None and bias.dtype != x2d.dtype:
        bias = bias.to(x2d.dtype)
    loss = _apply(
        FusedLinearCrossEntropyFunction, x2d.contiguous(), weight.contiguous(), t1d.contiguous(),
        None if bias is None else bias.contiguous(),
        int(ignore_index), reduction, float(label_smoothing), float(lse_square_scale),
        None if softcap is None else float(softcap), num_items_in_batch, d.config, torch.is_grad_enabled())
    return loss.reshape(target.shape) if reduction == "none" else loss


# -- registration -------------------------------------------------------------------------------

from ..dispatch import Impl, Op, register  # noqa: E402
from ._common import triton_available  # noqa: E402

MiB = 1 << 20

# Peak bytes of one chunk of logits (chunk * vocab * element bytes) that a config may use: the
# sweep measures only chunk sizes under it and the heuristic takes the largest, so a tuned DB row
# can never trade the memory saving for speed.
#  - HIP (mi300x/mi325x/mi355x) and unknown GPUs: 128 MiB, upstream's ROCm cap (seed 004: the
#    LFM2 PR raised the ROCm chunk floor for large hidden sizes "capped at 128 MiB" on MI325X).
#  - hopper/blackwell/ampere: 160 MiB, derived from the H200 memory targets rather than timed.
#    peak extra memory counts dW and dX (which autograd hands out): at BT8192 H2560 V151936 bf16
#    they are 0.778 + 0.042 GB, so a 1.0 GB target leaves 0.18 GB of logits (chunk <= 592 rows);
#    at BT8192 H2048 V65536, 0.5 GB leaves 0.198 GB (chunk <= 1510). 160 MiB admits 512 and 1280
#    rows there. Speed per chunk size: to be measured (benchmarks/results/flce_chunks_h200.csv).
#  - cpu (interpreter): tiny, so that CI shapes run several chunks.
_LOGITS_BUDGET = {"hopper": 160 * MiB, "blackwell": 160 * MiB, "ampere": 160 * MiB, "cpu": 4 * 1024}
_HIP_BUDGET = 128 * MiB
# Below 256 token rows the dX GEMM (M=chunk, N=hidden, K=vocab) has too few output tiles to fill
# 132 SMs / 304 CUs (2 x 20 tiles of 128x128 at H2560) and dW is re-read per chunk: the floor holds
# even when a huge vocab exceeds the budget (Liger-Kernel's default goes down to 256 at V151936).
_FLOOR = {"gpu": 256, "cpu": 4}
_GRAIN = {"gpu": 128, "cpu": 4}       # chunk sizes are multiples of this (GEMM tile friendly)
_CHUNKS = {"gpu": (256, 512, 768, 1024, 1280, 1536, 2048, 3072, 4096, 8192, 16384), "cpu": (4, 8, 16)}


def logits_budget(arch) -> int:
    """Bytes one chunk of logits may take on this arch."""
    if arch.is_hip:
        return _HIP_BUDGET
    return _LOGITS_BUDGET.get(arch.name, _HIP_BUDGET)


def _kind(arch) -> str:
    return "cpu" if arch.name == "cpu" else "gpu"


def budget_chunk(arch, vocab: int, dtype: torch.dtype) -> int:
    """The largest multiple of the grain whose logits fit the budget, never below the floor."""
    kind = _kind(arch)
    rows = logits_budget(arch) // (vocab * torch.empty((), dtype=dtype).element_size())
    return max(_FLOOR[kind], rows // _GRAIN[kind] * _GRAIN[kind])


def _chunk_candidates(arch, dims, dtype) -> list[int]:
    kind, tokens = _kind(arch), dims["tokens"]
    cap = budget_chunk(arch, dims["vocab"], dtype)
    chunks = sorted({c for c in (*_CHUNKS[kind], cap) if c <= cap and c < tokens})
    if tokens <= cap:
        chunks.append(0)          # 0: all tokens in one chunk
    return chunks or [_FLOOR[kind]]


def _ce_subset(arch, dims, dtype) -> list[dict]:
    """A few cross-entropy launches: the heuristic one and its neighbours in warps and block."""
    ce_dims = {"rows": dims["tokens"], "vocab": dims["vocab"]}
    base = _ce_heuristic(arch, ce_dims, dtype)
    space = _ce_configs(arch, ce_dims, dtype)
    picks = [base]
    for cfg in space:
        near_block = cfg["BLOCK_V"] in (base["BLOCK_V"], base["BLOCK_V"] // 2)
        near_warps = cfg["num_warps"] in (base["num_warps"], base["num_warps"] // 2)
        if near_block and near_warps and cfg not in picks:
            picks.append(cfg)
    return picks


def _configs(arch, dims, dtype):
    return [{"chunk": c, **ce} for c in _chunk_candidates(arch, dims, dtype) for ce in _ce_subset(arch, dims, dtype)]


def _heuristic(arch, dims, dtype):
    # the largest chunk under the budget (fewest, largest GEMMs; dW read once per chunk), Liger's CE launch
    cap = budget_chunk(arch, dims["vocab"], dtype)
    chunk = 0 if dims["tokens"] <= cap else cap
    return {"chunk": chunk, **_ce_heuristic(arch, {"rows": dims["tokens"], "vocab": dims["vocab"]}, dtype)}


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens, hidden, vocab = dims["tokens"], dims["hidden"], dims["vocab"]
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[torch.rand(tokens, generator=g) < 0.1] = -100
    return {"x": x, "w": w, "target": target.to(device), "dy": torch.tensor(1.0, device=device)}


def _run_torch(case, config):
    # reduction "sum": dW and dX keep magnitudes the validation tolerance can see
    loss = fused_linear_cross_entropy_ref(case["x"], case["w"], case["target"], reduction="sum")
    return [loss, *torch.autograd.grad(loss, (case["x"], case["w"]), case["dy"])]


def _run_triton(case, config):
    loss = FusedLinearCrossEntropyFunction.apply(case["x"], case["w"], case["target"], None, -100, "sum",
                                                 0.0, 0.0, None, None, config)
    return [loss, *torch.autograd.grad(loss, (case["x"], case["w"]), case["dy"])]


def _plan(preset, arch, quick):
    if arch.name == "cpu":
        if preset is not None and preset.tiny:
            hidden, vocab = preset.hidden, preset.vocab
        else:
            hidden, vocab = 32, 199
        return [{"tokens": t, "hidden": hidden, "vocab": vocab} for t in ((16,) if quick else (16, 64))]
    if preset is not None:
        tokens = preset.quick_tokens if quick else preset.tokens
        return [{"tokens": t, "hidden": preset.hidden, "vocab": preset.vocab} for t in tokens]
    shapes = ((2048, 65536), (2560, 151936)) if quick else ((2048, 65536), (2560, 151936), (2048, 128256),
                                                            (4096, 151936))
    tokens = (8192,) if quick else (4096, 8192, 16384)
    return [{"tokens": t, "hidden": h, "vocab": v} for h, v in shapes for t in tokens]


OP = register(Op(
    name="fused_linear_cross_entropy", static=("hidden", "vocab"), dynamic=("tokens",),
    impls=[Impl("triton", run=_run_triton, available=triton_available, configs=_configs, heuristic=_heuristic),
           Impl("torch", run=_run_torch)],
    make_case=_make_case, plan=_plan,
    # dW adds one rounding in the weight dtype per chunk (token rows); dX and the loss reduce in fp32
    reduce_len=lambda d: d["tokens"],
))
