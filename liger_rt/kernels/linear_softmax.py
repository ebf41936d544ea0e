"""The linear-softmax family: cross_entropy.py, fused_linear_cross_entropy.py and fused_linear_logprobs.py.

What they share, once:
- the online softmax over one row of logits (one pass: running max m, d = sum exp(z - m), and on request the row
  sum for label smoothing or the shifted sum behind the entropy), the logits' column blocks, zeroed ignored rows;
- the cross-entropy losses' argument checks, loss reduction and gradient scale, and the launch space of the
  cross-entropy kernel (which the fused linear cross-entropy runs on each chunk of logits);
- the token-chunk planning of the fused lm_head ops (chunk floor, spans, the GEMM gradients of a chunk, sweep dims).

    m, d, _, _ = online_softmax(p_row, p_row, vocab, 1.0, 1.0, BLOCK_V)    # in a kernel: one row's max and sum
    lse = m + tl.log(d)
"""
from __future__ import annotations

import torch

from .._triton import tl, triton
from ._common import next_pow2

MiB = 1 << 20
REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)   # class ids the kernels load


# -- Triton: one row of logits ----------------------------------------------------------------------------

@triton.jit
def tanh(x):
    # tl.tanh is not in every Triton release (3.6 and 3.9 must both work); exp-based tanh is exact
    # to fp32 rounding in absolute terms and saturates to +-1 where exp overflows.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def load_logits(P, B, o, m_v, inv_t, HAS_BIAS: tl.constexpr = False, TEMPERED: tl.constexpr = False):
    """fp32 logits of one row at columns `o` (mask m_v, 0 outside): x (+ b where HAS_BIAS) (* inv_t where TEMPERED)."""
    z = tl.load(P + o, mask=m_v, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + o, mask=m_v, other=0.0).to(tl.float32)
    if TEMPERED:
        z = z * inv_t
    return z


@triton.jit
def online_softmax(P, B, n, inv_t, softcap, BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr = False,
                   TEMPERED: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False, ROW_SUM: tl.constexpr = False,
                   ENTROPY: tl.constexpr = False):
    """One pass over a row of n logits z (load_logits, then softcap * tanh(z / softcap) where HAS_SOFTCAP), BLOCK_V
    columns a step: (m, d, s, row_sum) with m = max z, d = sum exp(z - m); s = sum exp(z - m) * (z - m) (ENTROPY:
    shifted, so the entropy log(d) - s / d keeps fp32 precision at large logits), row_sum = sum z (ROW_SUM); 0 where
    not asked for.  lse = m + log(d)."""
    o_v = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = 0.0
    s = 0.0
    row_sum = 0.0
    for start in range(0, n, BLOCK_V):
        o = start + o_v
        m_v = o < n
        z = load_logits(P, B, o, m_v, inv_t, HAS_BIAS, TEMPERED)
        if HAS_SOFTCAP:
            z = softcap * tanh(z / softcap)
        if ROW_SUM:
            row_sum += tl.sum(tl.where(m_v, z, 0.0), axis=0)
        z = tl.where(m_v, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        a = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        if ENTROPY:
            # rebase s from m to m_new: sum e'(z - m_new) = a * (s + d * (m - m_new)); d == 0 at first
            s = a * (s + d * tl.where(d > 0.0, m - m_new, 0.0)) + tl.sum(e * tl.where(m_v, z - m_new, 0.0), axis=0)
        d = d * a + tl.sum(e, axis=0)
        m = m_new
    return m, d, s, row_sum


@triton.jit
def zero_row(P, n, BLOCK_V: tl.constexpr):
    """Zeros over one row of n values at P, in P's dtype (an ignored row's gradient)."""
    o_v = tl.arange(0, BLOCK_V)
    for start in range(0, n, BLOCK_V):
        o = start + o_v
        tl.store(P + o, tl.zeros([BLOCK_V], dtype=tl.float32).to(P.dtype.element_ty), mask=o < n)


# -- the cross-entropy losses: checks, reduction, the kernel's launch space ---------------------------------

def check_args(op: str, reduction, label_smoothing, softcap, num_items_in_batch) -> None:
    """The cross-entropy options of `op` (cross_entropy's module docstring): one error line naming the valid values."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction={reduction!r} is not supported; valid: {', '.join(REDUCTIONS)}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"{op}: softcap={softcap} must be a positive number (or None to disable)")
    if num_items_in_batch is not None and reduction == "none":
        raise ValueError(f"{op}: num_items_in_batch divides a summed loss; use reduction='sum' or 'mean' with it")


def check_target(op: str, target: torch.Tensor, rows: int, what: str, device: torch.device) -> None:
    """Integer class ids on `device`, one per row of `what` (logits or x): a one-line error naming `op` otherwise."""
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"{op}: target must hold integer class ids (int64 or int32), got {target.dtype}; "
                        f"class probabilities are not supported")
    if target.device != device:
        raise ValueError(f"{op}: target is on {target.device}, {what} on {device}: move the target there")
    if target.numel() != rows:
        raise ValueError(f"{op}: target {tuple(target.shape)} does not match {what} (expected {rows} ids, "
                         f"e.g. {what}'s leading dims); shift labels before the call")


def out_of_range(target: torch.Tensor, ignore_index: int, vocab: int) -> torch.Tensor:
    """The rows whose target is neither ignore_index nor a class in [0, vocab) (the torch implementations give
    them the kernels' NaN; bool, target's shape)."""
    return (target != ignore_index) & ((target < 0) | (target >= vocab))


def denominator(valid: torch.Tensor, num_items_in_batch, device) -> torch.Tensor:
    """fp32 0-d divisor on `device`, without a host sync: the non-ignored count or
    num_items_in_batch; 0 becomes 1 so that an all-ignored batch gives 0, not NaN."""
    if num_items_in_batch is None:
        n = valid.sum().to(torch.float32)
    elif isinstance(num_items_in_batch, torch.Tensor):
        n = num_items_in_batch.to(device=device, dtype=torch.float32, non_blocking=True)
    else:
        n = torch.full((), float(num_items_in_batch), device=device)
    return torch.where(n == 0, torch.ones_like(n), n)


def grad_scale(target: torch.Tensor, ignore_index: int, reduction: str, num_items) -> torch.Tensor:
    """fp32 (1,) gradient scale of the summed per-row losses: 1/n for mean or with num_items."""
    if reduction == "none" or (reduction == "sum" and num_items is None):
        return torch.ones(1, device=target.device, dtype=torch.float32)
    return (1.0 / denominator(target != ignore_index, num_items, target.device)).reshape(1)


def reduce_rows(loss_rows: torch.Tensor, scale: torch.Tensor, reduction: str, shape) -> torch.Tensor:
    return loss_rows.view(shape) if reduction == "none" else loss_rows.sum() * scale[0]


def increment_version(t: torch.Tensor) -> None:
    """Tell autograd that a kernel wrote `t` in place: a node that saved it then raises."""
    fn = getattr(torch.autograd.graph, "increment_version", None)
    if fn is not None:
        fn(t)


def ce_launch(arch, vocab: int) -> dict:
    """The cross-entropy kernel's heuristic launch {BLOCK_V, num_warps}: Liger-Kernel's (BLOCK = min(32768,
    next_pow2(V)), 32 warps on CUDA, 16 wave64 on HIP), the one used at these vocab sizes upstream; the sweep
    measures per arch."""
    vmax = next_pow2(vocab)
    if arch.name == "cpu":
        return {"BLOCK_V": min(1024, vmax), "num_warps": 4}
    block = min(32768, vmax)
    warps = 16 if arch.warp_size == 64 else 32
    while warps > 4 and block // (warps * arch.warp_size) < 4:
        warps //= 2
    return {"BLOCK_V": block, "num_warps": min(warps, arch.max_num_warps)}


def ce_launches(arch, vocab: int) -> list[dict]:
    """The cross-entropy kernel's launch space: BLOCK_V x num_warps, 4..64 fp32 elements per thread, BLOCK_V at most
    the padded vocab."""
    vmax = next_pow2(vocab)
    if arch.name == "cpu":   # the interpreter ignores warps; larger blocks mean fewer Python loop trips
        return [{"BLOCK_V": min(block, vmax), "num_warps": 4} for block in (64, 256, 1024)]
    return [{"BLOCK_V": block, "num_warps": warps} for block in (1024, 2048, 4096, 8192, 16384, 32768)
            for warps in (4, 8, 16, 32) if 4 <= block // (warps * arch.warp_size) <= 64 and block <= max(vmax, 1024)]


# -- the fused lm_head ops: token chunks ----------------------------------------------------------------------

# Below 256 token rows a chunk's GEMMs fill a GPU poorly: the dX GEMM (M=chunk, N=hidden, K=vocab) has too few output
# tiles for 132 SMs / 304 CUs (2 x 20 tiles of 128x128 at H2560), and dW (+)= dz.T @ x, a K=chunk GEMM, reads and
# writes all of dW once per chunk (2 x 0.78 GB at V151936 H2560 bf16).  The floor holds even when a huge vocab
# exceeds a memory budget (Liger-Kernel's default goes down to 256 at V151936).  On cpu (the interpreter), tiny.
FLOOR = {"gpu": 256, "cpu": 4}


def device_kind(arch) -> str:
    """"cpu" (the interpreter) or "gpu": the key of FLOOR and of the ops' chunk tables."""
    return "cpu" if arch.name == "cpu" else "gpu"


def chunk_spans(chunk: int, tokens: int) -> list[tuple[int, int]]:
    """[start, end) token rows of each chunk; chunk 0 (or >= tokens): one chunk of all tokens."""
    chunk = chunk if 0 < chunk < tokens else max(tokens, 1)
    return [(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]


def chunk_grads(dz: torch.Tensor, xc: torch.Tensor, weight: torch.Tensor, span: tuple[int, int], gx, gw, gb,
                first: bool) -> None:
    """The GEMM gradients of one chunk of logits' gradient dz (rows, vocab) for rows `span` of x (xc): dX[span] =
    dz @ W, dW (+)= dz.T @ xc (the first chunk writes dW with beta 0: no zero-fill, no read), db += sum(dz) in fp32;
    each where its buffer is not None."""
    if gx is not None:
        torch.matmul(dz, weight, out=gx[span[0]:span[1]])
    if gw is not None:
        if first:
            torch.matmul(dz.t(), xc, out=gw)
        else:
            gw.addmm_(dz.t(), xc)
    if gb is not None:
        gb += dz.sum(0, dtype=torch.float32)


def linear_plan(preset, arch, quick: bool, gpu_shapes: list) -> list[dict]:
    """Sweep dims of a fused lm_head op: tiny shapes on cpu (the interpreter), a preset's hidden
    and vocab at its token counts, else `gpu_shapes` ((tokens, hidden, vocab) each)."""
    if arch.name == "cpu":
        hidden, vocab = (preset.hidden, preset.vocab) if preset is not None and preset.tiny else (32, 199)
        shapes = [(t, hidden, vocab) for t in ((16,) if quick else (16, 64))]
    elif preset is not None:
        shapes = [(t, preset.hidden, preset.vocab) for t in (preset.quick_tokens if quick else preset.tokens)]
    else:
        shapes = gpu_shapes
    return [{"tokens": t, "hidden": h, "vocab": v} for t, h, v in shapes]
