"""BoundRun on the GPU: a launch that skips Triton's binding runs the kernel Triton's own run picks.

    LIGER_RT_TEST_GPU=1 python -m pytest -m gpu tests/gpu/test_launch_gpu.py -q

Alternating argument specialisations (16-byte aligned or not, a row stride divisible by 16 or not,
equal to 1) through one bound rms_norm forward: after each call the compiled kernel it used is the
one `run(..., warmup=True)` returns for those arguments, and the output matches an fp32 reference;
then ops.rms_norm / swiglu / rope forward+backward on unaligned views after aligned calls.
"""
import pytest
import torch

import liger_rt.ops
from liger_rt.kernels import rms_norm as rn
from liger_rt.kernels._common import BoundRun, assert_close, interpreter_on

pytestmark = pytest.mark.gpu
DEV = "cuda"

if torch.cuda.is_available() and interpreter_on():
    pytest.skip("TRITON_INTERPRET=1: run GPU tests with LIGER_RT_TEST_GPU=1", allow_module_level=True)


def _rms_ref(x, w, eps=1e-6):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _view(m, n, stride, offset, dtype):
    """(m, n) rows `stride` apart starting `offset` elements into a fresh buffer."""
    buf = torch.randn(offset + m * stride + n, device=DEV, dtype=dtype)
    return buf.as_strided((m, n), (stride, 1), offset)


def test_bound_run_launches_the_kernel_tritons_run_picks():
    m, n = 37, 1024
    run = rn._fwd_launch(rn.OP.config(), m, n)     # the default config: ROWS 1, 4 warps
    assert isinstance(run, BoundRun)
    w = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    layouts = [(n, 0), (n, 1), (n + 8, 0), (n + 16, 0), (n, 0), (n + 8, 3), (n, 1), (n + 16, 0)]
    for dtype in (torch.bfloat16, torch.float32):
        for stride, offset in layouts + layouts[::-1]:
            x = _view(m, n, stride, offset, dtype)
            y = torch.empty(m, n, device=DEV, dtype=torch.promote_types(dtype, w.dtype))
            rstd = torch.empty(m, device=DEV, dtype=torch.float32)
            args = (x, w, y, rstd, stride, n, m, n, 1e-6, 0.0)
            used = run(*args)
            torch.cuda.synchronize()
            assert used is rn._rms_norm_fwd_kernel.run(*args, grid=run.grid, warmup=True, **run.meta)
            assert_close(y, _rms_ref(x, w).to(y.dtype), dtype=torch.bfloat16, reduce_len=n)
    assert len(run._compiled) >= 4       # one compiled kernel per specialisation seen


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rope"])
def test_ops_on_unaligned_views_after_aligned_calls(op, monkeypatch):
    monkeypatch.setenv(f"LIGER_RT_IMPL_{op.upper()}", "triton")
    liger_rt.dispatch.reset()
    torch.manual_seed(0)
    for offset in (0, 1, 0, 3):
        if op == "rms_norm":
            x = _view(64, 512, 512, offset, torch.bfloat16).requires_grad_()
            w = torch.randn(512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            out = liger_rt.ops.rms_norm(x, w)
            ins = (x, w)
            ref_fn = lambda a, b: (a.double() * torch.rsqrt(a.double().pow(2).mean(-1, keepdim=True) + 1e-6)
                                   * b.double())
        elif op == "swiglu":
            x = _view(64, 512, 512, offset, torch.bfloat16).requires_grad_()
            w = torch.randn(64, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            out = liger_rt.ops.swiglu(x, w)
            ins = (x, w)
            ref_fn = lambda a, b: torch.nn.functional.silu(a.double()) * b.double()
        else:
            q = _view(2 * 8 * 64, 128, 128, offset, torch.bfloat16).view(2, 8, 64, 128).requires_grad_()
            k = _view(2 * 4 * 64, 128, 128, offset, torch.bfloat16).view(2, 4, 64, 128).requires_grad_()
            ang = torch.randn(1, 64, 64, device=DEV)
            cos, sin = torch.cat([ang.cos()] * 2, -1).bfloat16(), torch.cat([ang.sin()] * 2, -1).bfloat16()
            out = torch.cat([t.flatten() for t in liger_rt.ops.rope(q, k, cos, sin)])
            ins = (q, k)

            def ref_fn(a, b):
                def rot(t):
                    h = t.shape[-1] // 2
                    return torch.cat((-t[..., h:], t[..., :h]), -1)
                c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
                return torch.cat([(t.double() * c + rot(t.double()) * s).flatten() for t in (a, b)])
        ref_ins = [t.detach().double().requires_grad_() for t in ins]
        ref = ref_fn(*ref_ins)
        assert_close(out.double(), ref, dtype=torch.bfloat16, reduce_len=512)
        g = torch.randn_like(ref)
        grads = torch.autograd.grad(out, ins, g.to(out.dtype))
        ref_grads = torch.autograd.grad(ref, ref_ins, g)
        for a, b in zip(grads, ref_grads):
            assert_close(a.double(), b, dtype=torch.bfloat16, reduce_len=512)
