"""Independent references for the loss tests: the cross-entropy formula written out in fp64.

    loss_row = (1 - eps) * (lse - z_t) + eps * (lse - mean_j z_j) + s * lse**2,   z = c * tanh(x / c)

with lse = logsumexp(z), 0 at ignored rows; "mean" divides by the non-ignored count (1 when it
is 0) or by num_items_in_batch.  Gradients come from autograd on this fp64 formula.
"""
import torch


def ce_fp64(logits, target, ignore_index=-100, reduction="mean", *, label_smoothing=0.0, lse_square_scale=0.0,
            softcap=None, num_items_in_batch=None):
    z = logits.double().reshape(-1, logits.shape[-1])
    t = target.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = t != ignore_index
    lse = torch.logsumexp(z, -1)
    z_t = z.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    eps = label_smoothing
    loss = (1 - eps) * (lse - z_t) + eps * (lse - z.mean(-1)) + lse_square_scale * lse ** 2
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape)
    if num_items_in_batch is not None:
        return loss.sum() / max(float(num_items_in_batch), 1.0)
    return loss.sum() if reduction == "sum" else loss.sum() / max(int(valid.sum()), 1)


def flce_fp64(x, weight, target, bias=None, ignore_index=-100, reduction="mean", **kw):
    """The fused loss as plain fp64 math: logits = x @ W.T (+ b), then ce_fp64."""
    logits = x.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    return ce_fp64(logits, target, ignore_index, reduction, **kw)


def fwd_bwd(fn, inputs, *args, dy_seed=1, **kw):
    """(loss, grads of every input) of fn(*inputs, *args, **kw) under a random upstream gradient."""
    ins = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    loss = fn(*ins, *args, **kw)
    g = torch.Generator().manual_seed(dy_seed)
    dy = (torch.rand(loss.shape, generator=g) + 0.5).to(loss.dtype)
    live = [t for t in ins if t is not None]
    return loss, torch.autograd.grad(loss, live, dy)
