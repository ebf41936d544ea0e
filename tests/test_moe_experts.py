"""moe_experts on CPU: the fused Triton path through the interpreter against an fp64 dense
reference written here (forward and every gradient), edge routings, the candidate spaces (each
candidate's numerics: tests/test_op_contract.py), crossovers and dispatch (which implementation ran),
pinned configs, the ExpertsInterface registration against the Hugging Face module, torch.compile."""
import dataclasses
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from liger_rt import backend, dispatch, ops
from liger_rt.autograd import call_impl, run_case
from liger_rt.config import ConfigError
from liger_rt.freshness import source_hash
from liger_rt.kernels import moe_experts as M
from liger_rt.kernels.moe_experts import configs as C
from liger_rt.kernels.moe_experts import kernels as K
from liger_rt.numerics import assert_close
from liger_rt.op import Case
from liger_rt.tuning_db import open_store
from liger_rt.tuning_db.crossover import crossover_pick, derive_crossover
from liger_rt.tuning_db.store import Store, load_jsonl
from routing import record_impls

NAMES = ("y", "dx", "dgate_up", "ddown", "dweights")


def _dims(T, E, K, H, I):
    return dict(tokens=T, experts=E, top_k=K, hidden=H, intermediate=I)


def _case(dims, dtype=torch.float32, tag="uniform", idx=None, **swap):
    """A tuning case (x, gate_up, down, idx, w, save=True) with `idx` or other args replaced."""
    case = M._make_case(dims, dtype, "cpu", tag=tag)
    args = dict(zip(("x", "gate_up", "down", "idx", "w", "save"), case.args), **swap)
    if idx is not None:
        args["idx"] = idx
    return Case(args=tuple(args.values()), grads=case.grads)


def _run(impl, case, config=None):
    return run_case(M.OP, M.OP.impl(impl), case, config if config is not None else {})


def _dense_fp64(case):
    """Independent reference: every token through every expert in fp64, mixed by a dense (T, E)
    routing matrix R[t, e] = sum_j w[t, j] [idx[t, j] == e]; gradients by autograd."""
    x, gu, dn, idx, w, _ = case.args
    x, gu, dn, w = (t.detach().double().requires_grad_() for t in (x, gu, dn, w))
    gate, up = torch.einsum("th,eih->eti", x, gu).chunk(2, dim=-1)
    y_e = torch.einsum("eti,ehi->eth", F.silu(gate) * up, dn)
    R = torch.zeros(x.shape[0], gu.shape[0], dtype=torch.float64).scatter_add(1, idx.long(), w)
    y = torch.einsum("te,eth->th", R, y_e)
    return [y.detach(), *torch.autograd.grad(y, (x, gu, dn, w), case.grads[0].double())]


def _check_all(out, ref, dtype, dims):
    n = max(M._reduce_len(dims), dims["tokens"] * dims["top_k"])  # edge routings put 2 slots of a token on one expert
    for name, o, r in zip(NAMES, out, ref):
        assert o.dtype == dtype or name == "dweights", (name, o.dtype)
        assert_close(o, r, dtype, n, name=name)


# -- correctness of the fused path --------------------------------------------------------------
def test_tma_weight_gradients_fall_back_where_rows_are_not_16_byte_aligned():
    """wgrad_sorted=2 on rows of 37 fp32 (148 bytes: no tensor descriptor can stride them) runs the
    sorted copies through the pointer kernel, and is still right against the fp64 reference."""
    dims = _dims(29, 4, 2, 37, 20)
    assert not K._descriptors_ok(torch.empty(8, 37)) and K._descriptors_ok(torch.empty(8, 40))
    case = _case(dims, tag="skewed")
    _check_all(_run("triton", case, C.CPU[0].replace(wgrad_sorted=2)), _dense_fp64(case), torch.float32, dims)


@pytest.mark.parametrize("up_desc,down_desc", [(1, 1), (1, 0), (0, 1)])
def test_gemms_through_tensor_descriptors(up_desc, down_desc, monkeypatch):
    """up_desc / down_desc: the up GEMMs' weights and the down/dX GEMMs' operands through tensor descriptors
    (the interpreter emulates them). I = 40 is not a multiple of the 32-column up tile (its gate rows run
    into the up rows), H = 48 not of BLOCK_K: against the fp64 reference; each asked-for launch takes them."""
    dims = _dims(37, 5, 2, 48, 40)
    taken = []
    real = K._tma
    monkeypatch.setattr(K, "_tma", lambda on, *ts: taken.append(bool(on)) or real(on, *ts))
    for tag in ("uniform", "skewed"):
        case = _case(dims, tag=tag)
        cfg = C.CPU[0].replace(wgrad_sorted=2, up_desc=up_desc, down_desc=down_desc)
        _check_all(_run("triton", case, cfg), _dense_fp64(case), torch.float32, dims)
    # per forward + backward: up, down, up_bwd, dW_down, dX, dW_gate_up (the weight gradients asked by wgrad_sorted=2)
    assert taken == [bool(up_desc), bool(down_desc), bool(up_desc), True, bool(down_desc), True] * 2
    x, gu, dn = _case(dims).args[:3]
    assert K._descriptors_ok(gu.view(-1, 48), dn.view(-1, 40), torch.empty(74, 80))


def test_gemm_descriptors_fall_back_where_rows_are_not_16_byte_aligned():
    dims = _dims(29, 4, 2, 37, 20)       # rows of 37 fp32: no descriptor can stride them
    case = _case(dims, tag="skewed")
    cfg = C.CPU[0].replace(up_desc=1, down_desc=1)
    _check_all(_run("triton", case, cfg), _dense_fp64(case), torch.float32, dims)


@pytest.mark.parametrize("wgrad_sorted,down_desc,I", [(2, 1, 40), (0, 0, 40), (2, 0, 600)])
def test_split_up_backward(wgrad_sorted, down_desc, I):
    """up_bwd_split: dy @ down[e] as a plain GEMM into sorted rows, then the SwiGLU backward on its own (the
    hw buffer doubles as the GEMM's output). I = 40 fills part of the elementwise pass's one 64-column block;
    I = 600 takes two 512-column blocks, the second partly masked (dw summed across them); H = 48 is not a
    multiple of BLOCK_K; every gradient against fp64, then (I = 40: which buffers exist does not depend on I)
    each one alone (the other buffers' paths)."""
    dims = _dims(37, 5, 2, 48, I)
    cfg = C.CPU[0].replace(wgrad_sorted=wgrad_sorted, down_desc=down_desc, up_bwd_split=1)
    for tag in ("uniform", "skewed"):
        case = _case(dims, tag=tag)
        _check_all(_run("triton", case, cfg), _dense_fp64(case), torch.float32, dims)
    if I > 64:       # the interpreter's slowest case (~36 s with the loop below)
        return
    x, gu, dn, idx, w, _ = case.args
    ref = dict(zip(NAMES, _dense_fp64(case)))
    for name, i in (("dweights", 3), ("ddown", 2), ("dgate_up", 1), ("dx", 0)):
        args = [a.detach().requires_grad_(j == i) for j, a in enumerate((x, gu, dn, w))]
        y = call_impl(M.OP, "triton", cfg, *args[:3], idx, args[3], True)
        y = y[0] if isinstance(y, tuple) else y
        (grad,) = torch.autograd.grad(y, args[i], case.grads[0])
        assert_close(grad, ref[name], torch.float32, M._reduce_len(dims), name=name)


@pytest.mark.parametrize("split", [0, 1])
def test_backward_frees_its_buffers_early(split, monkeypatch):
    """The backward's own buffers at their peak: dgate|dup, the two weight gradients, dx and the sorted x copy;
    w*h, the sorted dy copy and dX's slot rows are gone by then (the first MoE layer's backward runs beside
    nearly every activation of a step, so these add to its peak). Launches stubbed: allocations only."""
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from triton.runtime.interpreter import InterpretedFunction

    class Live(TorchDispatchMode):      # bytes of the storages ops create, while a tensor of theirs lives
        def __init__(self):
            super().__init__()
            self.refs, self.now, self.peak = {}, 0, 0

        def _drop(self, ptr, ref):
            entry = self.refs.get(ptr)
            if entry is not None:
                entry[1].discard(ref)
                if not entry[1]:
                    self.now -= entry[0]
                    del self.refs[ptr]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in self.refs:
                        self.refs[ptr] = [t.untyped_storage().nbytes(), set()]
                        self.now += self.refs[ptr][0]
                        self.peak = max(self.peak, self.now)
                    self.refs[ptr][1].add(weakref.ref(t, lambda r, p=ptr: self._drop(p, r)))
            return out

    T, E, K, H, I = 512, 8, 4, 64, 48
    (x, gu, dn, idx, w, _), (dy,) = (c := _case(_dims(T, E, K, H, I))).args, c.grads
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: None)
    cfg = C.CPU[0].replace(wgrad_sorted=2, up_bwd_split=split)
    y = call_impl(M.OP, "triton", cfg, x, gu, dn, idx, w, True)
    with Live() as live:
        torch.autograd.grad(y[0] if isinstance(y, tuple) else y, (x, gu, dn, w), dy)
    S = T * K
    dgu, hw, sorted_rows, ddown, dgate_up, dx = S * 2 * I, S * I, S * H, E * H * I, E * 2 * I * H, T * H
    phases = [dgu + hw + sorted_rows + ddown,                 # dW_down: w*h and the sorted dy copy
              dgu + ddown + sorted_rows + dx,                 # dX: its slot rows, then their sum
              dgu + ddown + dx + sorted_rows + dgate_up]      # dW_gate_up: the sorted x copy
    at_once = dgu + hw + 3 * sorted_rows + ddown + dgate_up + dx
    assert 4 * max(phases) <= live.peak <= 4 * max(phases) + 24 * S < 4 * at_once, (live.peak, phases, at_once)


@pytest.mark.parametrize("tag", ["uniform", "skewed"])
@pytest.mark.parametrize("wgrad_sorted", [2, 1, 0])
def test_fwd_bwd_fp32_odd_shapes(tag, wgrad_sorted):
    dims = _dims(37, 5, 2, 48, 40)    # nothing a power of two, H and I not multiples of BLOCK_K
    case = _case(dims, tag=tag)
    ref = _dense_fp64(case)
    _check_all(_run("triton", case, C.CPU[0].replace(wgrad_sorted=wgrad_sorted)), ref, torch.float32, dims)
    _check_all(_run("torch", case), ref, torch.float32, dims)     # the op's own reference, checked too


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fwd_bwd_half_precision(dtype):
    # fp16 runs tl.dot in fp16 through the interpreter; bf16 upcasts the loaded tiles (DOT_FP32)
    # since the interpreter's bf16 arithmetic is wrong. GPU bf16 dots are covered by tests/gpu.
    # The interpreter also truncates fp32 -> bf16 stores (the GPU rounds to nearest even), so the
    # bf16 intermediates (h, gate|up, dgu) carry twice the GPU's rounding error here.
    dims = _dims(24, 4, 2, 32, 32)
    case = _case(dims, dtype)
    if dtype == torch.float16:   # fp32 routing weights with fp16 experts (the kernels load w as fp32)
        case = _case(dims, dtype, w=case.args[4].detach().float().requires_grad_())
    out, ref = _run("triton", case, C.CPU[1]), _dense_fp64(case)
    assert out[4].dtype == case.args[4].dtype
    _check_all(out, ref, dtype, dims)
    for name, o, r in zip(NAMES, out, ref):
        rel = float((o.detach().double() - r).norm() / r.norm())
        assert rel < (4e-3 if dtype == torch.float16 else 1.5e-2), (name, rel)


def _edge_idx(name, T, E, K, g):
    if name == "empty_experts":      # only experts 1 and 3 of 6 receive tokens
        return torch.stack([torch.full((T,), 1), torch.full((T,), 3)], 1)[:, :K]
    if name == "one_expert":         # every slot on expert 2, two slots of a token on the same expert
        return torch.full((T, K), 2)
    return torch.rand(T, E, generator=g).topk(K, dim=-1).indices


@pytest.mark.parametrize("name,T,K", [("empty_experts", 20, 2), ("one_expert", 40, 2), ("k1", 19, 1),
                                      ("t1", 1, 2)])
def test_edge_routings(name, T, K):
    E = 6
    dims = _dims(T, E, K, 32, 16)
    case = _case(dims, idx=_edge_idx(name, T, E, K, torch.Generator().manual_seed(1)))
    out = _run("triton", case, C.CPU[0])
    _check_all(out, _dense_fp64(case), torch.float32, dims)
    if name == "empty_experts":      # experts without rows get exactly zero weight gradients
        empty = [0, 2, 4, 5]
        assert out[2][empty].abs().max() == 0 and out[3][empty].abs().max() == 0


@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_schedule(block_m):
    # counts 0, 37, 0, 1, 64, 0, 15 (empty experts first, last and between; a full multiple of 16/64)
    counts = torch.tensor([0, 37, 0, 1, 64, 0, 15])
    idx = torch.repeat_interleave(torch.arange(7), counts)[torch.randperm(int(counts.sum()))].view(-1, 1)
    route = K._Routing.sort(idx, 7)
    meta, n = route.tiles(block_m)
    want_e, want_r = [], []
    start = 0
    for e, c in enumerate(counts.tolist()):
        for r in range(start, start + c, block_m):
            want_e.append(e)
            want_r.append(r)
        start += c
    assert n == meta.shape[1] >= len(want_e)
    assert meta[0, :len(want_e)].tolist() == want_e and meta[1, :len(want_r)].tolist() == want_r
    assert (meta[0, len(want_e):] == -1).all()
    assert route.bounds.tolist() == [0, *torch.cumsum(counts, 0).tolist()]
    assert (idx.flatten()[route.perm.long()].diff() >= 0).all()
    assert route.tiles(block_m)[0] is meta          # built once per BLOCK_M


def test_non_contiguous_inputs():
    dims = _dims(21, 4, 2, 32, 24)
    wide = torch.rand(21, 6, generator=torch.Generator().manual_seed(3)) + 0.1
    xw = torch.randn(21, 40, generator=torch.Generator().manual_seed(4))
    case = _case(dims, w=wide[:, 1:5:2].detach().requires_grad_(),     # (T, 2) leaf with strides (6, 2)
                 x=xw[:, 3:35].detach().requires_grad_())               # rows of stride 40
    assert not case.args[4].is_contiguous() and not case.args[0].is_contiguous()
    _check_all(_run("triton", case, C.CPU[0]), _dense_fp64(case), torch.float32, dims)


def test_functional_dispatch_and_leading_dims(monkeypatch):
    dims = _dims(12, 4, 2, 32, 16)
    case = _case(dims)
    x, gu, dn, idx, w, _ = (a.detach() if isinstance(a, torch.Tensor) else a for a in case.args)
    d = dispatch.decision(M.OP, x, **dims)
    assert d.impl == "triton" and d.origin == "heuristic"    # interpreter on: the fused path on cpu
    ran = record_impls(monkeypatch, M.OP)
    y = ops.moe_experts(x.view(3, 4, 32), gu, dn, idx.view(3, 4, 2), w.view(3, 4, 2))
    assert y.shape == (3, 4, 32) and ran == ["triton"]
    assert_close(y.view(12, 32), _dense_fp64(case)[0], torch.float32, M._reduce_len(dims))


def test_no_grad_forward_skips_saving(monkeypatch):
    dims = _dims(16, 4, 2, 32, 16)
    case = _case(dims)
    saved, real = [], M.OP.impl("triton").forward

    def forward(*a):
        outs, kept = real(*a)
        saved.append(kept)
        return outs, kept
    monkeypatch.setattr(M.OP.impl("triton"), "forward", forward)
    with torch.no_grad():
        y = ops.moe_experts(*case.args[:5])
    assert saved[0][0].numel() == 0                            # no gate|up pre-activations kept
    assert_close(y, _dense_fp64(case)[0], torch.float32, M._reduce_len(dims))
    y = call_impl(M.OP, "triton", C.CPU[0], *case.args[:5], False)    # save=False with a graph: refused
    with pytest.raises(RuntimeError, match="save=False"):
        y.sum().backward()


def test_input_errors():
    x = torch.randn(4, 8)
    gu, dn = torch.randn(2, 6, 8), torch.randn(2, 8, 3)
    idx, w = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    with pytest.raises(ValueError, match="experts layout"):
        M.moe_experts(x, gu, torch.randn(2, 3, 8), idx, w)
    with pytest.raises(ValueError, match=r"must both be \(tokens, k\)"):
        M.moe_experts(x.view(2, 2, 8), gu, dn, idx, w)
    with pytest.raises(TypeError, match="integer"):
        M.moe_experts(x, gu, dn, idx.float(), w)
    with pytest.raises(TypeError, match="share a dtype"):
        M.moe_experts(x.half(), gu, dn, idx, w)
    with pytest.raises(TypeError, match="accepted: torch.float32"):
        M.moe_experts(x.long(), gu.long(), dn.long(), idx, w)
    with pytest.raises(RuntimeError, match="outside"):
        call_impl(M.OP, "triton", C.CPU[0], x, gu, dn, torch.full((4, 1), 2), w, False)


# -- grouped MM ---------------------------------------------------------------------------------
def test_grouped_mm_math_on_cpu_and_availability():
    # dispatch never picks grouped_mm on CPU, but this torch has a CPU grouped MM: check the layout
    # (transposed weight views, int32 end offsets, gate first) against the reference here
    if M._grouped_mm_fn() is None:
        pytest.skip("this torch has no grouped MM")
    dims = _dims(30, 5, 2, 32, 24)
    idx = _edge_idx("empty_experts", 30, 5, 2, None)      # empty experts inside the offsets
    for case in (_case(dims), _case(dims, idx=idx)):
        _check_all(_run("grouped_mm", case), _dense_fp64(case), torch.float32, dims)
    cpu = dispatch.current_target("cpu")
    assert not M._grouped_mm_available(cpu)
    assert M._supports_grouped_mm(dims, torch.float32) is not None
    assert M._supports_grouped_mm(_dims(8, 4, 2, 2048, 1792), torch.bfloat16) is None
    assert "grouped_mm" not in M.OP.available_impls(cpu, dims, torch.bfloat16)


def test_grouped_mm_probe_failure_is_said_once_and_asked_again(monkeypatch):
    """A failed probe (here: no CUDA device) is warned once with its reason, and not kept: the next decision
    probes again, so one bad moment cannot take grouped_mm away for the rest of the process."""
    calls = []
    monkeypatch.setattr(M, "_grouped_mm_fn", lambda: calls.append(1) or torch.matmul)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(M, "_PROBED", {})
    monkeypatch.setattr(M, "PROBE_FAILURES", {})
    with pytest.warns(RuntimeWarning, match="grouped_mm probe failed on cuda:7"):
        assert M._grouped_mm_probe(7) is False
    assert M.PROBE_FAILURES[7]
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # the same reason is not warned twice
        assert M._grouped_mm_probe(7) is False
    assert len(calls) == 2 and not M._PROBED


# -- configs --------------------------------------------------------------------------------------
BIG = _dims(4096, 32, 4, 2048, 1792)


def _candidates(arch, dims=BIG, dtype=torch.bfloat16):
    return M.OP.candidates_for(M.OP.impl("triton"), arch, dims, dtype)


def test_candidate_counts_and_hip_safety():
    """hopper: 12 tile sets, 8 weight-gradient operand variants, 8 descriptor ones, 8 split up backward ones;
    every mi325x candidate HIP-safe (each one's numerics: tests/test_op_contract.py)."""
    for arch in ("hopper", "mi325x", "cpu"):
        assert 2 <= len(_candidates(backend.profile(arch))) <= 36, arch
    assert all(_hip_safe(c) for c in _candidates(backend.profile("mi325x")))


def _fits(cfg, arch, dims, dtype):
    """Within the arch's warps, stages and shared memory (what the op's candidates_for keeps)."""
    warps, stages = cfg.limits()
    return warps <= arch.max_num_warps and stages <= arch.max_num_stages and C.smem(cfg, dims, dtype) <= arch.smem_bytes


def _hip_safe(cfg):
    fams = [cfg.up, cfg.up_bwd, cfg.down, cfg.wgrad]
    return (all(f.num_stages <= 2 and f.num_warps <= 8 for f in fams)
            and C.smem(cfg, BIG, torch.bfloat16) <= 64 * 1024)


def test_configs_are_declared_and_round_trip():
    every = [*C.HOPPER, *C.NVIDIA_FP32, *C.HIP, *C.CPU, C.PINNED_HIP, C.PINNED_CUDA, C.MINIMAL]
    for c in every:
        assert M.OP.parse_config(json.loads(json.dumps(c.to_dict()))) == c
    assert C.HOPPER[0].limits() == (8, 4)          # what arch pruning sees: the hungriest family
    row = C.HOPPER[0].to_dict()
    with pytest.raises(ConfigError, match="missing"):
        M.OP.parse_config({})
    with pytest.raises(ConfigError, match="unknown"):                # the old derived top-level keys
        M.OP.parse_config(dict(row, num_warps=8, num_stages=4))
    with pytest.raises(ConfigError, match="BLOCK_M=48"):
        M.OP.parse_config(dict(row, up=dict(row["up"], BLOCK_M=48)))


def test_smem_pruning_and_heuristics():
    hopper = backend.profile("hopper")
    # a hopper candidate does not fit 64 KiB: the smem estimate prunes it on a 64 KiB profile
    big = C.HOPPER[0]
    small = dataclasses.replace(hopper, smem_bytes=64 * 1024)
    assert C.smem(big, BIG, torch.bfloat16) > small.smem_bytes and not _fits(big, small, BIG, torch.bfloat16)
    kept = _candidates(small)
    assert kept and big not in kept and all(C.smem(c, BIG, torch.bfloat16) <= small.smem_bytes for c in kept)
    # fp32 doubles the tiles: only the small NVIDIA configs survive on hopper
    fp32 = _candidates(hopper, dtype=torch.float32)
    assert fp32 and all(C.smem(c, BIG, torch.float32) <= hopper.smem_bytes for c in fp32)
    for arch in ("hopper", "ampere", "blackwell", "mi300x", "mi325x", "mi355x", "cpu"):
        prof = backend.profile(arch)
        for dtype in (torch.bfloat16, torch.float32):
            for T in (256, 16384):
                dims = dict(BIG, tokens=T)
                for fn in (M._heuristic, M._pinned):
                    assert _fits(fn(prof, dims, dtype), prof, dims, dtype), (arch, dtype, fn.__name__)
    assert M._heuristic(hopper, dict(BIG, tokens=256), torch.bfloat16).up.BLOCK_M == 64
    assert M._heuristic(hopper, BIG, torch.bfloat16).up.BLOCK_M == 128
    assert M._heuristic(hopper, BIG, torch.bfloat16).wgrad_sorted == 2          # TMA where it runs (H200)
    assert M._heuristic(hopper, BIG, torch.bfloat16).up_bwd_split == 0          # 512 rows per expert: not measured
    many = M._heuristic(hopper, dict(BIG, tokens=16384), torch.bfloat16)        # 2048 rows per expert
    assert many.up_bwd_split == 1 and many.down_desc == 1
    for other in ("ampere", "blackwell"):                                       # measured on the H200 only
        assert M._heuristic(backend.profile(other), dict(BIG, tokens=16384), torch.bfloat16).up_bwd_split == 0
    assert M._heuristic(hopper, BIG, torch.float16).wgrad_sorted == 1           # not measured on a GPU in fp16
    generic = backend.Arch(name="generic-nvidia", vendor="nvidia", capability="sm75", device_name="x", sm_count=40,
                           warp_size=32, max_num_warps=8, max_num_stages=2, smem_bytes=49152)
    assert _fits(M._pinned(generic, BIG, torch.bfloat16), generic, BIG, torch.bfloat16)


def test_plan_and_cases():
    from liger_rt.tools.presets import get_preset
    cpu, hopper = backend.profile("cpu"), backend.profile("hopper")
    full = M._plan(None, hopper, False)
    assert [d["tokens"] for d in full] == [512, 2048, 4096, 16384]
    assert all((d["experts"], d["top_k"], d["hidden"], d["intermediate"]) == (32, 4, 2048, 1792) for d in full)
    assert [d["tokens"] for d in M._plan(None, hopper, True)] == [512, 4096]
    p24 = M._plan(get_preset("lfm2-24b-a2b"), hopper, False)
    assert p24[0]["experts"] == 64 and p24[0]["intermediate"] == 1536
    assert M._plan(get_preset("qwen3-1.7b"), hopper, False) == []
    tiny = M._plan(None, cpu, False)
    assert tiny and all(4 <= d["experts"] <= 8 and d["hidden"] <= 64 and d["tokens"] <= 64 for d in tiny)
    assert M._plan(get_preset("lfm2-moe-tiny"), cpu, True)[0]["experts"] == 8
    dims = _dims(256, 8, 2, 32, 32)
    uni = M.OP.new_case(dims, torch.float32, "cpu", "uniform").args[3]
    sk = M.OP.new_case(dims, torch.float32, "cpu", "skewed").args[3]
    cu = torch.bincount(uni.flatten(), minlength=8)
    cs = torch.bincount(sk.flatten(), minlength=8)
    assert (cu > 0).all() and (cs == 0).sum() == 2 and cs.max() > 2 * cu.max()
    for idx in (uni, sk):   # distinct experts per token
        assert (idx.sort(-1).values.diff(dim=-1) != 0).all()
    assert M._rows_per_expert(BIG) == 512


# -- crossovers and dispatch -----------------------------------------------------------------------
def test_derive_crossover_with_hysteresis(tmp_path):
    # triton wins at few rows per expert, grouped MM at many; a 3% "win" inside the 5% margin
    # must not flip the choice, a real one moves the boundary to the geometric mean
    pts = [(16.0, {"triton": 1.0, "grouped_mm": 1.6}),
           (64.0, {"triton": 1.0, "grouped_mm": 0.97}),   # within the margin: stays triton
           (256.0, {"triton": 2.0, "grouped_mm": 1.5}),
           (1024.0, {"triton": 6.0, "grouped_mm": 5.0})]
    seg = derive_crossover(pts, margin=0.05)
    assert seg == [[round(math.sqrt(64 * 256), 6), "triton"], [None, "grouped_mm"]]
    assert derive_crossover(pts, margin=0.0)[0] == [round(math.sqrt(16 * 64), 6), "triton"]
    store = open_store(tmp_path / "x.db")
    sk = M.OP.static_key(BIG)
    store.put_crossover(dict(op="moe_experts", variant="fwdbwd", arch="hopper", dtype="bf16", static_key=sk,
                             axis_name="rows_per_expert", segments=seg, margin=0.05, origin="sweep",
                             source_hash=source_hash(M.OP)))
    row = store.crossover_row("moe_experts", "fwdbwd", "hopper", "bf16", sk)
    assert json.loads(row["segments"]) == seg
    assert crossover_pick(seg, 100.0) == "triton" and crossover_pick(seg, 200.0) == "grouped_mm"
    store.close()


def _put_user_crossover(arch, dtype, dims, segments, origin="sweep"):
    store = open_store()        # LIGER_RT_TUNING_DB: the per-test DB of conftest
    store.put_crossover(dict(op="moe_experts", variant="fwdbwd", arch=arch, dtype=dtype,
                             static_key=M.OP.static_key(dims), axis_name="rows_per_expert", segments=segments,
                             margin=0.05, origin=origin, source_hash=source_hash(M.OP)))
    store.close()
    dispatch.reset()


def test_dispatch_switches_across_crossover_cpu(monkeypatch):
    # on CPU grouped_mm cannot run: a crossover between triton and torch
    base = _dims(16, 4, 2, 32, 16)
    _put_user_crossover("cpu", "fp32", base, [[8.0, "triton"], [None, "torch"]])
    x = torch.randn(1, 32)
    lo = dispatch.decision(M.OP, x, **dict(base, tokens=12))      # 6 rows per expert
    hi = dispatch.decision(M.OP, x, **dict(base, tokens=40))      # 20 rows per expert
    assert (lo.impl, lo.origin) == ("triton", "crossover") and "rows_per_expert=6" in lo.reason
    assert (hi.impl, hi.origin) == ("torch", "crossover")
    ran = record_impls(monkeypatch, M.OP)
    with torch.no_grad():
        ops.moe_experts(*_case(dict(base, tokens=40)).args[:5])
        ops.moe_experts(*_case(dict(base, tokens=12)).args[:5])
    assert ran == ["torch", "triton"]


def test_dispatch_switches_to_grouped_mm_on_hopper_plan(monkeypatch, no_shipped_defaults):
    # planning for hopper (no GPU here): grouped_mm is available by the arch rules of this torch
    if M._grouped_mm_fn() is None:
        pytest.skip("this torch has no grouped MM")
    monkeypatch.setattr(backend, "gpu_present", lambda: False)
    _put_user_crossover("hopper", "bf16", BIG, [[100.0, "triton"], [None, "grouped_mm"]])
    lo = dispatch.select("moe_experts", arch="hopper", dtype="bf16", **dict(BIG, tokens=512))
    hi = dispatch.select("moe_experts", arch="hopper", dtype="bf16", **dict(BIG, tokens=4096))
    assert (lo.impl, lo.origin) == ("triton", "crossover") and lo.config.up.BLOCK_M == 64   # 64 rows per expert
    assert (hi.impl, hi.origin, dict(hi.config)) == ("grouped_mm", "crossover", {})
    # fp32 has no crossover row and grouped_mm cannot take it: the heuristic picks triton
    f32 = dispatch.select("moe_experts", arch="hopper", dtype="fp32", **dict(BIG, tokens=4096))
    assert (f32.impl, f32.origin) == ("triton", "heuristic")


def test_hopper_heuristic_impl(monkeypatch, no_shipped_defaults):
    if M._grouped_mm_fn() is None:
        pytest.skip("this torch has no grouped MM")
    monkeypatch.setattr(backend, "gpu_present", lambda: False)
    e64 = dict(BIG, experts=64, intermediate=1536)
    low = dispatch.select("moe_experts", arch="hopper", dtype="bf16", **dict(e64, tokens=512))   # 32 rows
    high = dispatch.select("moe_experts", arch="hopper", dtype="bf16", **dict(BIG, tokens=4096))  # 512 rows
    # the fused path was fastest or tied at every measured H200 point (32..512 rows per expert)
    assert (low.impl, low.origin) == ("triton", "heuristic") and low.config.up.BLOCK_M == 64
    assert (high.impl, high.origin) == ("triton", "heuristic") and high.config.up.BLOCK_M == 128
    assert not hasattr(M, "HOPPER_GROUPED_MM_BELOW")


def test_published_mi325x_crossover(monkeypatch):
    if M._grouped_mm_fn() is None:
        pytest.skip("this torch has no grouped MM")
    monkeypatch.setattr(backend, "gpu_present", lambda: False)
    # the shipped file loads by the export rules, one record per static key
    from importlib import resources
    text = (resources.files("liger_rt.tuning_db") / "defaults" / "mi325x.jsonl").read_text()
    store = Store(None, layer="check")
    counts = load_jsonl(store, text.splitlines())
    e64 = dict(BIG, experts=64, intermediate=1536)
    keys = {r["static_key"] for r in store.all_rows("crossover") if r["op"] == "moe_experts"}
    assert counts["crossover"] >= 2 and {M.OP.static_key(BIG), M.OP.static_key(e64)} <= keys
    for dims, T, want in [(BIG, 512, "triton"), (BIG, 1024, "triton"), (BIG, 4096, "grouped_mm"),
                          (e64, 2048, "triton"), (e64, 4096, "triton"), (e64, 8192, "grouped_mm")]:
        d = dispatch.select("moe_experts", arch="mi325x", dtype="bf16", **dict(dims, tokens=T))
        assert (d.impl, d.origin) == (want, "crossover"), (dims["experts"], T, d.reason)
        assert "published" in d.reason
        if want == "triton":
            assert _hip_safe(d.config)


def test_pinned_configs(monkeypatch):
    dims = _dims(16, 4, 2, 32, 32)
    x = torch.randn(1, 32)
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "0")
    monkeypatch.setenv("LIGER_RT_ARCH", "mi325x")
    dispatch.reset()
    d = dispatch.decision(M.OP, x.bfloat16(), **dims)
    assert (d.impl, d.origin, d.arch) == ("triton", "pinned", "mi325x") and "HIP-safe" in d.reason
    assert _hip_safe(d.config) and d.config == C.PINNED_HIP
    d = dispatch.decision(M.OP, x, **dims)   # fp32 tiles are twice the bytes: the first HIP config within 64 KiB
    assert d.origin == "pinned" and _fits(d.config, backend.profile("mi325x"), dims, torch.float32)
    case = _case(dims)           # the pinned HIP config computes right (through the interpreter)
    _check_all(_run("triton", case, d.config), _dense_fp64(case), torch.float32, dims)
    monkeypatch.setenv("LIGER_RT_ARCH", "hopper")
    dispatch.reset()
    d = dispatch.decision(M.OP, x.bfloat16(), **dims)
    assert (d.origin, d.config) == ("pinned", C.PINNED_CUDA)
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "1")
    dispatch.reset()
    assert dispatch.decision(M.OP, x, **dims).origin == "heuristic"


# -- transformers ExpertsInterface -------------------------------------------------------------------
def test_experts_interface_qwen3_moe(monkeypatch):
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from liger_rt.layers import moe_experts_interface as MI
    assert MI.register_experts_interface() and MI.register_experts_interface()    # idempotent
    assert "liger_rt" in ALL_EXPERTS_FUNCTIONS and MI.is_registered()
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2)
    torch.manual_seed(0)
    mod = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 0.3)
        mod.down_proj.normal_(0, 0.3)
    x = torch.randn(13, 32, requires_grad=True)
    idx = torch.rand(13, 6).topk(2, dim=-1).indices
    w = torch.rand(13, 2).softmax(-1).requires_grad_()
    dy = torch.randn(13, 32)
    outs = {}
    ran = record_impls(monkeypatch, M.OP)
    for impl in ("eager", "liger_rt"):
        cfg._experts_implementation = impl
        y = mod(x, idx, w)
        outs[impl] = [y, *torch.autograd.grad(y, (x, mod.gate_up_proj, mod.down_proj, w), dy)]
    assert ran == ["triton"], "the liger_rt experts forward did not reach the fused path"
    for name, a, b in zip(NAMES, outs["liger_rt"], outs["eager"]):
        assert_close(a, b, torch.float32, 64, name=name)
    # a layout moe_experts does not take falls back to the module's eager forward, once warned
    mod.act_fn = torch.nn.GELU()
    cfg._experts_implementation = "liger_rt"
    with pytest.warns(RuntimeWarning, match="eager forward"):
        y = mod(x, idx, w)
    cfg._experts_implementation = "eager"
    eager = mod(x, idx, w)
    assert_close(y, eager, torch.float32, name="fallback")
    # under a class-level patch (the patcher's experts_forward_for) the fallback unwraps to the
    # eager forward too, never back into the interface
    from liger_rt.layers.moe import experts_forward_for
    monkeypatch.setattr(Qwen3MoeExperts, "forward", experts_forward_for(Qwen3MoeExperts))
    cfg._experts_implementation = "liger_rt"
    assert_close(mod(x, idx, w), eager, torch.float32, name="class-level fallback")
    assert MI.unregister_experts_interface() and not MI.is_registered()
    assert MI.register_experts_interface() and MI.is_registered()


def test_experts_interface_lfm2_moe_model(monkeypatch):
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    from liger_rt.layers.moe_experts_interface import register_experts_interface
    register_experts_interface()
    cfg = Lfm2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                        num_experts_per_tok=2, num_dense_layers=1, layer_types=["full_attention", "conv"],
                        experts_implementation="liger_rt")
    torch.manual_seed(0)
    model = Lfm2MoeForCausalLM(cfg).eval()
    assert model.config._experts_implementation == "liger_rt"
    experts = model.model.layers[1].feed_forward.experts
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    ids = torch.randint(0, 64, (2, 7))
    ran = record_impls(monkeypatch, M.OP)
    with torch.no_grad():
        ours = model(ids).logits
        assert ran == ["triton"]        # one sparse layer (num_dense_layers=1)
        model.set_experts_implementation("eager")
        eager = model(ids).logits
    assert_close(ours, eager, torch.float32, 64, name="logits")


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_path_matches_eager(dynamic):
    """torch.compile (fullgraph: no graph breaks) sees the fused path as two custom ops with fake
    shapes, decided at trace time; with dynamic shapes a second token count reuses or recompiles."""
    torch._dynamo.reset()
    tokens = (18, 40) if dynamic else (18,)
    compiled = torch.compile(lambda x, gu, dn, idx, w: ops.moe_experts(x, gu, dn, idx, w) * 2.0,
                             backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for T in tokens:
        case = _case(_dims(T, 4, 2, 32, 16))
        x, gu, dn, idx, w, _ = case.args
        results = []
        for fn in (lambda *a: ops.moe_experts(*a) * 2.0, compiled):
            y = fn(x, gu, dn, idx, w)
            results.append([y, *torch.autograd.grad(y, (x, gu, dn, w), case.grads[0])])
        for name, o, r in zip(NAMES, results[1], results[0]):
            assert torch.equal(o, r), (T, name)
