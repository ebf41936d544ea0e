"""short_conv (LFM2 gated causal depthwise conv) through the Triton interpreter: tiny shapes."""
import pytest
import torch

from liger_rt import backend, dispatch
from liger_rt.autograd import call_impl
from liger_rt.kernels import short_conv as sc
from liger_rt.numerics import assert_close
from routing import record_impls

# A config with several tiles per row, several backward chunks per row and several steps per
# chunk (on the interpreter's 2 "SMs"), so tiling, halos and the dw partial reduction are exercised.
MULTI = sc.ShortConvConfig(BLOCK_T=8, BLOCK_H=32, num_warps=1,
                           BWD_BLOCK_T=4, BWD_BLOCK_H=32, BWD_PROGRAMS_PER_SM=4, bwd_num_warps=1)
BIG = sc.ShortConvConfig(BLOCK_T=32, BLOCK_H=128, num_warps=4,
                         BWD_BLOCK_T=32, BWD_BLOCK_H=128, BWD_PROGRAMS_PER_SM=1, bwd_num_warps=4)


def _inputs(B, T, H, K, bias, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    bcx = torch.randn(B, T, 3 * H, generator=g).to(dtype)
    w = (torch.randn(H, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(H, generator=g).to(dtype) if bias else None
    dy = torch.randn(B, T, H, generator=g).to(dtype)
    return bcx, w, b, dy


def _fwd_bwd(fn, bcx, w, b, dy, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (bcx, w) + ((b,) if b is not None else ())]
    y = fn(leaves[0], leaves[1], leaves[2] if b is not None else None, **kw)
    grads = torch.autograd.grad(y, leaves, dy)
    return [y, *grads]


def _conv64(bcx, w, b=None, seq_idx=None):
    """Independent fp64 formula, HF's: y = C * (F.conv1d(B*x, groups=H, padding=K-1)[..., :T] + bias),
    one packed sequence at a time (seq_idx)."""
    H, K = w.shape
    bg, c, x = bcx.double().transpose(1, 2).chunk(3, dim=1)
    bx = bg * x
    ids = seq_idx if seq_idx is not None else torch.zeros(bcx.shape[:2], dtype=torch.long)
    rows = []
    for r in range(bcx.shape[0]):
        lengths = torch.unique_consecutive(ids[r], return_counts=True)[1].tolist()
        pieces = [torch.nn.functional.conv1d(p, w.double()[:, None], None if b is None else b.double(),
                                             padding=K - 1, groups=H)[..., :p.shape[-1]]
                  for p in bx[r:r + 1].split(lengths, dim=-1)]
        rows.append(torch.cat(pieces, dim=-1))
    return (c * torch.cat(rows)).transpose(1, 2)


def _ref(bcx, w, b, dy, seq_idx=None):
    """The fp64 formula's outputs and gradients on the same (possibly rounded) values."""
    f = lambda t: t.double() if t is not None else None  # noqa: E731
    return _fwd_bwd(lambda x, ww, bb: _conv64(x, ww, bb, seq_idx), f(bcx), f(w), f(b), f(dy))


def _triton(config):
    return lambda x, w, b, seq_idx=None: call_impl(sc.OP, "triton", config, x, w, b, seq_idx)


def _check(outs, refs, dtype, B, T, what=""):
    H = outs[0].shape[-1]
    assert_close(outs[0], refs[0], dtype, name=f"{what} y")
    for i, part in enumerate("BCx"):  # each third of d(bcx) on its own: a swapped gate must fail
        assert_close(outs[1][..., i * H:(i + 1) * H], refs[1][..., i * H:(i + 1) * H], dtype, name=f"{what} d{part}")
    assert_close(outs[2], refs[2], dtype, reduce_len=B * T, name=f"{what} dweight")
    if len(outs) > 3:
        assert_close(outs[3], refs[3], dtype, reduce_len=B * T, name=f"{what} dbias")


@pytest.mark.parametrize("K,bias", [(2, True), (3, False), (3, True), (4, True), (4, False)])
def test_matches_reference_odd_hidden(K, bias):
    B, T, H = 2, 13, 67        # 67: not a power of two, 3 channel tiles of 32
    bcx, w, b, dy = _inputs(B, T, H, K, bias, seed=K)
    _check(_fwd_bwd(_triton(MULTI), bcx, w, b, dy), _ref(bcx, w, b, dy), torch.float32, B, T, f"K{K}")


def test_backward_chunking_covers_every_token():
    chunk, n = sc.bwd_chunking(2, 13, 67, MULTI, 2)
    assert n * chunk >= 13 and (n - 1) * chunk < 13 and chunk % MULTI.BWD_BLOCK_T == 0 and n > 1 \
        and chunk // MULTI.BWD_BLOCK_T > 1
    assert sc.bwd_chunking(1, 65536, 2048, sc._heuristic(backend.profile("hopper"), {}, None), 132)[1] > 1


@pytest.mark.parametrize("K", [1, 3])
def test_seq_len_one_and_short_rows(K):
    for T in (1, 2):      # fewer tokens than taps
        B, H = 3, 40
        bcx, w, b, dy = _inputs(B, T, H, K, True, seed=T)
        _check(_fwd_bwd(_triton(MULTI), bcx, w, b, dy), _ref(bcx, w, b, dy), torch.float32, B, T, f"T{T}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_through_dispatch(dtype):
    B, T, H, K = 2, 9, 24, 3
    bcx, w, b, dy = _inputs(B, T, H, K, True, dtype)
    outs = _fwd_bwd(sc.short_conv, bcx, w, b, dy)
    assert outs[0].dtype == dtype and outs[1].dtype == dtype and outs[2].dtype == dtype
    _check(outs, _ref(bcx, w, b, dy), dtype, B, T, str(dtype))


def _packed():
    # row 0: sequences of 5, 7 and 4 tokens; row 1: 1, 10 and 5 (a one-token sequence first)
    lengths = [[5, 7, 4], [1, 10, 5]]
    pos = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    return lengths, pos


@pytest.mark.parametrize("bias", [False, True])
def test_packed_sequences_do_not_leak(bias):
    lengths, pos = _packed()
    seq_idx = sc.seq_idx_from_position_ids(pos)
    B, T, H, K = 2, pos.shape[1], 20, 4
    bcx, w, b, dy = _inputs(B, T, H, K, bias, seed=3)
    outs = _fwd_bwd(_triton(MULTI), bcx, w, b, dy, seq_idx=seq_idx)
    _check(outs, _ref(bcx, w, b, dy, seq_idx), torch.float32, B, T, "packed vs ref")
    # the same as running every sequence alone (one batch row each), grads summed over pieces
    y = torch.zeros(B, T, H)
    dbcx = torch.zeros(B, T, 3 * H)
    dw = torch.zeros(H, K)
    db = torch.zeros(H)
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            sl = slice(start, start + n)
            piece = _ref(bcx[r:r + 1, sl], w, b, dy[r:r + 1, sl])
            y[r, sl], dbcx[r, sl] = piece[0][0], piece[1][0]
            dw += piece[2]
            if bias:
                db += piece[3]
            start += n
    _check(outs, [y, dbcx, dw] + ([db] if bias else []), torch.float32, B, T, "packed vs alone")
    # and it differs from the unpacked conv, so the test can see a leak
    assert (outs[0] - _ref(bcx, w, b, dy)[0]).abs().max() > 1e-2


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_packed_through_dispatch(monkeypatch, impl):
    _, pos = _packed()
    seq_idx = sc.seq_idx_from_position_ids(pos).long()
    bcx, w, b, dy = _inputs(2, pos.shape[1], 8, 3, True, seed=4)
    monkeypatch.setenv("LIGER_RT_IMPL_SHORT_CONV", impl)
    dispatch.reset()
    ran = record_impls(monkeypatch, sc.OP)
    outs = _fwd_bwd(lambda *a: sc.short_conv(*a, seq_idx=seq_idx), bcx, w, b, dy)
    assert ran == [impl]
    _check(outs, _ref(bcx, w, b, dy, seq_idx), torch.float32, 2, 16, impl)


def test_reference_matches_formula():
    """The torch implementation (also the sweep's validator) against the fp64 formula."""
    _, pos = _packed()
    seq_idx = sc.seq_idx_from_position_ids(pos)
    for K, bias, seq in ((4, True, seq_idx), (3, False, None), (5, True, seq_idx)):
        bcx, w, b, dy = _inputs(2, pos.shape[1], 6, K, bias, seed=K)
        _check(_fwd_bwd(lambda *a: sc.short_conv_ref(*a, seq), bcx, w, b, dy), _ref(bcx, w, b, dy, seq),
               torch.float32, 2, 16, f"K{K}")
    # one row of positions serves every batch row; ids restart where positions do not follow
    assert sc.seq_idx_from_position_ids(torch.tensor([0, 1, 0, 5, 6]), 2).tolist() == [[0, 0, 1, 2, 2]] * 2


def test_non_contiguous_inputs():
    B, T, H, K = 2, 11, 20, 3
    g = torch.Generator().manual_seed(5)
    big = torch.randn(B, T + 3, 3 * H + 7, generator=g)
    bcx = big[:, 2:2 + T, 3:3 + 3 * H]                      # strided view, unit last stride: no copy
    assert not bcx.is_contiguous() and bcx.stride(-1) == 1
    bcx_t = torch.randn(B, 3 * H, T, generator=g).transpose(1, 2)   # HF's layout: copied
    w = torch.randn(H, K, generator=g)
    dy = torch.randn(B, T + 1, H, generator=g)[:, 1:]       # non-contiguous grad_output
    for x in (bcx, bcx_t):
        _check(_fwd_bwd(_triton(MULTI), x, w, None, dy), _ref(x, w, None, dy), torch.float32, B, T)


def test_weight_with_conv_channel_dim_and_errors():
    bcx, w, b, dy = _inputs(1, 6, 8, 3, True)
    y = sc.short_conv(bcx, w.unsqueeze(1), b)             # HF's (hidden, 1, kernel)
    assert_close(y, _conv64(bcx, w, b), torch.float32)
    with pytest.raises(TypeError, match="accepted: torch.float32"):
        sc.short_conv(bcx.long(), w.long())
    with pytest.raises(ValueError, match="3\\*hidden"):
        sc.short_conv(bcx[..., :-1], w)
    with pytest.raises(ValueError, match="seq_idx"):
        sc.short_conv(bcx, w, seq_idx=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="kernel widths"):
        call_impl(sc.OP, "triton", BIG, bcx, torch.randn(8, 5), None, None)


def test_wide_kernel_falls_back_to_torch(monkeypatch):
    bcx, w, _, _ = _inputs(1, 6, 8, 5, False)
    d = dispatch.decision(sc.OP, bcx, batch=1, seq=6, hidden=8, kernel=5)
    assert d.impl == "torch"
    ran = record_impls(monkeypatch, sc.OP)
    assert_close(sc.short_conv(bcx, w), _conv64(bcx, w), torch.float32)
    assert ran == ["torch"]


def test_amd_heuristic_is_wave64():
    hop, amd = backend.profile("hopper"), backend.profile("mi325x")
    dims = {"batch": 1, "seq": 4096, "hidden": 2048, "kernel": 3}
    h, a = sc._heuristic(hop, dims, torch.bfloat16), sc._heuristic(amd, dims, torch.bfloat16)
    # same tile, same threads per program: half the (64-lane) warps
    assert (h.BLOCK_T, h.BLOCK_H) == (a.BLOCK_T, a.BLOCK_H)
    assert a.num_warps * 64 == h.num_warps * 32 and a.bwd_num_warps * 64 == h.bwd_num_warps * 32


def test_plans():
    from liger_rt.tools.presets import get_preset
    cpu, hop = backend.profile("cpu"), backend.profile("hopper")
    tiny = sc._plan(None, cpu, False)
    assert tiny and all(d["batch"] * d["seq"] * d["hidden"] <= 4096 for d in tiny)
    full = sc._plan(get_preset("lfm2-1.2b"), hop, False)
    combos = {(d["batch"], d["seq"]) for d in full}
    assert {(1, 4096), (8, 4096), (1, 65536)} <= combos and all(d["hidden"] == 2048 and d["kernel"] == 3
                                                                  for d in full)
    assert sc._plan(None, hop, True) and sc._plan(get_preset("qwen3-1.7b"), hop, False) == []
    assert sc._plan(get_preset("lfm2-tiny"), cpu, True)[0]["hidden"] == 64


@pytest.mark.parametrize("bias", [False, True])
def test_matches_hf_lfm2_short_conv(bias):
    from transformers.models.lfm2.configuration_lfm2 import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
    torch.manual_seed(7)
    cfg = Lfm2Config(hidden_size=24, num_hidden_layers=2, layer_types=["conv", "full_attention"],
                     conv_bias=bias, conv_L_cache=3)
    hf = Lfm2ShortConv(cfg, 0)
    for p in hf.parameters():   # random everywhere (biases included), never the zero init
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 9, 24)
    dy = torch.randn(2, 9, 24)

    def ours(h):
        bcx = hf.in_proj(h)
        return hf.out_proj(call_impl(sc.OP, "triton", MULTI, bcx, hf.conv.weight.squeeze(1), hf.conv.bias, None))

    results = []
    for fn in (hf, ours):
        xx = x.clone().requires_grad_()
        y = fn(xx)
        params = [xx, hf.in_proj.weight, hf.conv.weight, hf.out_proj.weight] + ([hf.conv.bias] if bias else [])
        results.append([y, *torch.autograd.grad(y, params, dy)])
    names = ["y", "dx", "d in_proj", "d conv.weight", "d out_proj", "d conv.bias"]
    for name, o, r in zip(names, results[1], results[0]):
        assert_close(o, r, torch.float32, reduce_len=18, name=name)


def test_compiled_path_matches_eager():
    """torch.compile sees the kernels as custom ops (fake shapes); fullgraph once the decision is memoised."""
    torch._dynamo.reset()
    bcx, w, b, dy = _inputs(2, 9, 8, 3, True, seed=8)
    _, pos = _packed()
    seq_idx = sc.seq_idx_from_position_ids(pos[:, :9])

    def f(x, ww, bb):
        return sc.short_conv(x, ww, bb, seq_idx=seq_idx) * 2.0

    eager = _fwd_bwd(f, bcx, w, b, dy)
    compiled = _fwd_bwd(torch.compile(f, backend="aot_eager", fullgraph=True), bcx, w, b, dy)
    for o, r in zip(compiled, eager):
        assert torch.equal(o, r)
