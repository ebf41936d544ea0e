"""moe_experts on the GPU: bf16 at LFM2-8B-A1B sizes (E32 K4 H2048 I1792) for all three
implementations against the fp32 reference, forward and every gradient; every candidate config;
edge routings; fp32/fp16; dispatch, pinned configs and the ExpertsInterface on CUDA.

    LIGER_RT_TEST_GPU=1 python -m pytest -m gpu tests/gpu/test_moe_experts_gpu.py -q
"""
import pytest
import torch

from liger_rt import backend, dispatch
from liger_rt.kernels import moe_experts as M
from liger_rt.kernels._common import assert_close

pytestmark = pytest.mark.gpu
DEV = "cuda"
NAMES = ("y", "dx", "dgate_up", "ddown", "dweights")
E8B = dict(experts=32, top_k=4, hidden=2048, intermediate=1792)
# relative RMSE bounds against the fp32 reference: bf16 keeps h, gate|up, dgu and the slot rows
# in bf16 (a handful of 2^-9 roundings), fp16 has 3 more mantissa bits, fp32 uses ieee dots
REL_RMSE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _rel_rmse(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _fp32_ref(case):
    c32 = {k: v.detach().float().requires_grad_() if v.is_floating_point() else v for k, v in case.items()}
    return M._run_torch(c32, {})


def _check(out, ref, dtype, dims, what="", reduce_len=None):
    n = reduce_len or M._reduce_len(dims)
    for name, o, r in zip(NAMES, out, ref):
        assert o.dtype == dtype and o.shape == r.shape, (what, name, o.dtype, o.shape)
        assert_close(o, r, dtype, n, name=f"{what} {name}")
        rel = _rel_rmse(o, r)
        assert rel < REL_RMSE[dtype], f"{what} {name}: relative RMSE {rel:.3g} >= {REL_RMSE[dtype]}"


RUN = {"triton": lambda case, dims: M._run_triton(case, M._heuristic(backend.detect(), dims, case["x"].dtype)),
       "grouped_mm": lambda case, dims: M._run_grouped_mm(case, {}),
       "torch": lambda case, dims: M._run_torch(case, {})}


@pytest.mark.parametrize("tag", ["uniform", "skewed"])
@pytest.mark.parametrize("impl", ["triton", "grouped_mm", "torch"])
def test_bf16_8b_all_impls(impl, tag):
    dims = dict(E8B, tokens=2048)
    if impl == "grouped_mm" and not M._grouped_mm_available(dispatch.current_target("cuda")):
        pytest.skip("no grouped MM on this GPU/torch")
    case = M._make_case(dims, torch.bfloat16, DEV, tag=tag)
    _check(RUN[impl](case, dims), _fp32_ref(case), torch.bfloat16, dims, f"{impl} {tag}")


def test_bf16_every_candidate_config():
    arch = backend.detect()
    dims = dict(E8B, tokens=1024)
    case = M._make_case(dims, torch.bfloat16, DEV, tag="skewed")
    ref = _fp32_ref(case)
    cands = M.OP.candidates(M.OP.impl("triton"), arch, dims, torch.bfloat16)
    assert cands
    for cfg in cands:
        _check(M._run_triton(case, cfg), ref, torch.bfloat16, dims, f"config {cfg}")


def _edge_idx(name, T, E, K):
    g = torch.Generator(device=DEV).manual_seed(1)
    if name == "empty_experts":
        live = torch.tensor([1, 5, 6], device=DEV)
        return live[torch.rand(T, 3, generator=g, device=DEV).topk(K, dim=-1).indices]
    if name == "one_expert":
        return torch.full((T, K), 3, device=DEV)
    return torch.rand(T, E, generator=g, device=DEV).topk(K, dim=-1).indices


@pytest.mark.parametrize("name,T,K,H,I", [("empty_experts", 333, 2, 256, 200), ("one_expert", 1000, 2, 264, 136),
                                          ("k1", 777, 1, 512, 384), ("t1", 1, 4, 2048, 1792)])
def test_bf16_edge_routings(name, T, K, H, I):
    dims = dict(tokens=T, experts=8, top_k=K, hidden=H, intermediate=I)
    case = M._make_case(dims, torch.bfloat16, DEV)
    case["idx"] = _edge_idx(name, T, 8, K)
    out = RUN["triton"](case, dims)
    # one_expert puts both slots of every token on one expert: its dW sums 2*T rows
    _check(out, _fp32_ref(case), torch.bfloat16, dims, name, reduce_len=max(M._reduce_len(dims), T * K))
    if name == "empty_experts":
        empty = [0, 2, 3, 4, 7]
        assert out[2][empty].abs().max() == 0 and out[3][empty].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_fp16(dtype):
    dims = dict(tokens=512, experts=8, top_k=2, hidden=512, intermediate=384)
    case = M._make_case(dims, dtype, DEV, tag="skewed")
    _check(RUN["triton"](case, dims), _fp32_ref(case), dtype, dims, str(dtype))


def test_t16384_against_grouped_mm():
    dims = dict(E8B, tokens=16384)
    if not M._grouped_mm_available(dispatch.current_target("cuda")):
        pytest.skip("no grouped MM on this GPU/torch")
    case = M._make_case(dims, torch.bfloat16, DEV)
    ours, theirs = RUN["triton"](case, dims), RUN["grouped_mm"](case, dims)
    for name, a, b in zip(NAMES, ours, theirs):
        assert _rel_rmse(a, b) < 1.5e-2, name


def test_dispatch_and_pinned_on_cuda(monkeypatch):
    from liger_rt import ops
    dims = dict(E8B, tokens=2048)
    case = M._make_case(dims, torch.bfloat16, DEV)
    d = M.OP.select(case["x"], **dims)
    assert d.arch == backend.detect().name and d.impl in ("triton", "grouped_mm")
    y = ops.moe_experts(case["x"], case["gate_up"], case["down"], case["idx"], case["w"])
    ref = _fp32_ref(case)[0]
    assert _rel_rmse(y, ref) < REL_RMSE[torch.bfloat16]
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "0")
    dispatch.reset()
    d = M.OP.select(case["x"], **dict(dims, tokens=8192))     # 1024 rows per expert
    assert d.origin == "pinned"
    if d.impl == "triton":
        assert dict(d.config) == M._pinned(backend.detect(), dims, torch.bfloat16)
        _check(M._run_triton(case, d.config), _fp32_ref(case), torch.bfloat16, dims, "pinned")


def test_experts_interface_lfm2_bf16():
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeExperts

    from liger_rt.layers.moe_experts_interface import register_experts_interface
    register_experts_interface()
    cfg = Lfm2MoeConfig(num_experts=32, num_experts_per_tok=4, hidden_size=2048, moe_intermediate_size=1792)
    with torch.device(DEV):
        mod = Lfm2MoeExperts(cfg).to(torch.bfloat16)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 0.02)
        mod.down_proj.normal_(0, 0.02)
    T = 1024
    x = torch.randn(T, 2048, device=DEV, dtype=torch.bfloat16)
    w, idx = torch.topk(torch.randn(T, 32, device=DEV).sigmoid(), 4, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    with torch.no_grad():
        cfg._experts_implementation = "liger_rt"
        ours = mod(x, idx, w)
        cfg._experts_implementation = "eager"
        eager = mod(x, idx, w)                                                # bf16 compute
        ref = M.moe_experts_ref(x, mod.gate_up_proj, mod.down_proj, idx, w)   # fp32 compute
    assert _rel_rmse(ours, ref) < REL_RMSE[torch.bfloat16]
    assert _rel_rmse(ours, ref) < 2 * max(_rel_rmse(eager, ref), 2e-3)
