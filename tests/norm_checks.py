"""Checks shared by the RMSNorm and LayerNorm test files (same config layout)."""
import torch

from liger_rt import backend

ARCHES = ("hopper", "mi325x", "mi300x", "blackwell", "ampere")


def assert_candidate_spaces_modest_and_arch_aware(mod) -> None:
    """At most 12 candidates per shape and arch, each (and the heuristic) within warps and smem."""
    for arch_name in ARCHES:
        arch = backend.profile(arch_name)
        for hidden in (1, 8, 128, 1152, 2048, 4096, 8192, 32768):   # every candidate constructs
            dims = {"rows": 16384, "hidden": hidden}
            cands = mod.OP.candidates_for(mod.OP.impl("triton"), arch, dims, torch.bfloat16)
            assert 1 <= len(cands) <= 12
            for c in cands + [mod._heuristic(arch, dims, torch.bfloat16)]:
                assert c["num_warps"] <= arch.max_num_warps and c["bwd_num_warps"] <= arch.max_num_warps
                assert mod.OP.smem is None or mod.OP.smem(c, dims, torch.bfloat16) <= arch.smem_bytes
