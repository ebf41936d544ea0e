"""Registers, spills and shared memory of every Hopper norm candidate, compiled offline for sm_90 (no GPU).

    python benchmarks/profile_regs.py

A one-off profiling script (it names the kernels' private Triton functions): compiles every
candidate config of rms_norm, layer_norm and swiglu with Triton's bundled ptxas and prints
registers, local (spill) bytes, shared memory and whether cp.async pipelining happened.
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)   # read when the kernels are decorated: before their import

import torch  # noqa: E402


def regs(hidden_sizes=(1152, 2048, 4096, 8192), swiglu_cols=(8192, 12288)) -> list[dict]:
    """Compile every hopper candidate with Triton's bundled ptxas and report registers, spills
    (local bytes), shared memory and whether cp.async pipelining happened.  Two 8-warp programs
    per SM need <= 128 registers, three <= 85."""
    import re
    import subprocess
    import tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from liger_rt import backend
    from liger_rt.kernels import layer_norm as ln
    from liger_rt.kernels import rms_norm as rn
    from liger_rt.kernels import swiglu as sw
    target, arch = GPUTarget("cuda", 90, 32), backend.profile("hopper")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    aligned = [["tt.divisibility", 16]]

    def build(fn, consts, num_warps, n):
        # the kernels' arguments by name: bf16 tensors but for the fp32 statistics and partial sums
        sig = {a: "constexpr" if a in consts else "i32" if a in ("M", "N") or a.startswith("stride")
               else "fp32" if a in ("eps", "offset") else "*fp32" if a in ("MEAN", "RSTD", "DW_PART", "DB_PART")
               else "*bf16" for a in fn.arg_names}
        # what a launch specializes: 16-aligned pointers, strides and N (when N % 16 == 0); M is
        # do_not_specialize
        attrs = {(fn.arg_names.index(k),): aligned for k, t in sig.items()
                 if t.startswith("*") or k.startswith("stride") or (k == "N" and n % 16 == 0)}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target,
                           options={"num_warps": num_warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+).*LOCAL:(\d+)", usage)
        return {"regs": int(m.group(1)) if m else None, "local": int(m.group(2)) if m else None,
                "smem": k.metadata.shared, "cp_async": "cp.async" in k.asm["ptx"]}

    rows = []
    for op, mod, sizes in (("rms_norm", rn, hidden_sizes), ("layer_norm", ln, hidden_sizes),
                           ("swiglu", sw, swiglu_cols)):
        for n in sizes:
            dims = {"rows": 16384, "cols" if op == "swiglu" else "hidden": n}
            for cfg in mod.OP.candidates_for(mod.OP.impl("triton"), arch, dims, torch.bfloat16):
                if op == "swiglu":
                    fwd = bwd = {"BLOCK_N": cfg["BLOCK_N"], "ROWS": cfg["ROWS"], "RNE_BF16": False}
                else:
                    e, bias = triton.next_power_of_2(n), {"HAS_BIAS": True} if op == "layer_norm" else {}
                    fwd = {"BLOCK_N": e, "ROWS": cfg["ROWS"], "RNE_BF16": False, **bias}
                    bwd = {"BLOCK_N": e, "PREFETCH": bool(cfg["bwd_prefetch"]), "RNE_BF16": False, **bias}
                fr = build(getattr(mod, f"_{op}_fwd_kernel"), fwd, cfg["num_warps"], n)
                br = build(getattr(mod, f"_{op}_bwd_kernel"), bwd, cfg["bwd_num_warps"], n)
                rows.append({"op": op, "N": n, "config": str(cfg), **{f"fwd_{k}": v for k, v in fr.items()},
                             **{f"bwd_{k}": v for k, v in br.items()}})
    return rows


def main() -> None:
    from liger_rt.tools.bench.harness import format_table
    print(format_table(regs(), ["op", "N", "fwd_regs", "fwd_local", "bwd_regs", "bwd_local", "bwd_smem",
                                "bwd_cp_async", "config"]))


if __name__ == "__main__":
    main()
