"""Whether moe_experts' routed GEMM kernels compile to the same sm90 PTX as at an earlier commit, with the
constexprs that commit's configs launch them with (no GPU: Triton's offline compiler).

    python benchmarks/moe_ptx_same.py [--rev dc88796]

Session 14 added the up_desc / down_desc knobs, session 15 OUT_SORTED (up_bwd_split), as constexpr branches, and re-keyed the shipped rows
(measured before) instead of re-sweeping them; this checks that with every knob off the kernels are
the ones those rows timed (knobs off).  Debug line info is dropped before comparing.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)   # read when kernels are decorated: before their import

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from liger_rt.kernels import moe_experts as NEW  # noqa: E402

INTS = {"n_tiles_m", "H", "I", "TOP_K", "N", "KD", "stride_we", "stride_wk", "stride_wn"}
ALIGNED = {"H", "I", "N", "KD", "stride_we", "stride_wk", "stride_wn"}
POINTERS = {"perm_ptr": "*i32", "tile_ptr": "*i32", "bounds_ptr": "*i32", "dwp_ptr": "*fp32"}
CASES = [("_moe_up_fwd_kernel", "up", dict(STORE_GU=True, EVEN_K=True), dict(W_DESC=False)),
         ("_moe_down_kernel", "down", dict(HAS_SCALE=True, EVEN_K=True), dict(DESC=False, W_T=True, OUT_SORTED=False)),
         ("_moe_down_kernel", "down", dict(HAS_SCALE=False, EVEN_K=False), dict(DESC=False, W_T=False, OUT_SORTED=False)),
         ("_moe_up_bwd_kernel", "up_bwd", dict(NEED_DW=True, STORE_HW=True, EVEN_K=True), dict(W_DESC=False))]


def old_module(rev: str):
    """moe_experts.py at `rev`, importable beside today's (relative imports made absolute, no registration)."""
    src = subprocess.run(["git", "show", f"{rev}:liger_rt/kernels/moe_experts.py"], capture_output=True, text=True,
                         check=True).stdout
    src = (src.replace("from .. import", "from liger_rt import").replace("from ..", "from liger_rt.")
           .replace("from ._common", "from liger_rt.kernels._common").replace("OP = register(", "OP = (lambda op: op)("))
    path = os.path.join(tempfile.mkdtemp(), "moe_experts_old.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("moe_experts_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def ptx(fn, consts: dict, warps: int, stages: int) -> str:
    sig = {a: "constexpr" if a in consts else "i32" if a in INTS else POINTERS.get(a, "*bf16") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, t in sig.items()
             if t.startswith("*") or k in ALIGNED}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 128), options={"num_warps": warps, "num_stages": stages})
    text = re.sub(r"^\s*\.(loc|file)\b.*$", "", k.asm["ptx"], flags=re.M)
    return re.sub(r"\.section\s+\.debug.*", "", text, flags=re.S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="dc88796")
    rev = ap.parse_args().rev
    old, same = old_module(rev), True
    for cfg in (NEW._HOPPER[0], NEW._HOPPER[5], NEW._HOPPER[9]):
        for name, family, consts, off in CASES:
            c = getattr(cfg, family)
            common = dict(DOT_FP32=False, PRECISION="tf32", BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K,
                          GROUP_M=c.GROUP_M, **consts)
            eq = ptx(getattr(old, name), common, c.num_warps, c.num_stages) == \
                ptx(getattr(NEW, name), {**common, **off}, c.num_warps, c.num_stages)
            same &= eq
            print(f"{name:20s} {str(c):60s} {consts}: {'same PTX' if eq else 'DIFFERENT'}")
    print(f"every kernel the same as at {rev}" if same else f"some kernels differ from {rev}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
