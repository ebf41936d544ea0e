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

    def build(fn, sig, consts, num_warps, n):
        # what a launch specializes: 16-aligned pointers, strides and N (when N % 16 == 0); M is
        # do_not_specialize
        sig = {**sig, **{k: "constexpr" for k in consts}}
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

    t, f32 = "*bf16", "*fp32"
    rows = []
    for op, mod in (("rms_norm", rn), ("layer_norm", ln)):
        for n in hidden_sizes:
            e = triton.next_power_of_2(n)
            for cfg in mod.OP.candidates_for(mod.OP.impl("triton"), arch, {"rows": 16384, "hidden": n}, torch.bfloat16):
                bwd = {"BLOCK_N": e, "PREFETCH": bool(cfg["bwd_prefetch"]), "RNE_BF16": False}
                if op == "rms_norm":
                    fr = build(rn._rms_norm_fwd_kernel, {"X": t, "W": t, "Y": t, "RSTD": f32, "stride_x": "i32",
                               "stride_y": "i32", "M": "i32", "N": "i32", "eps": "fp32", "offset": "fp32"},
                               {"BLOCK_N": e, "ROWS": cfg["ROWS"], "RNE_BF16": False}, cfg["num_warps"], n)
                    br = build(rn._rms_norm_bwd_kernel, {"DY": t, "X": t, "W": t, "RSTD": f32, "DX": t, "DW_PART": f32,
                               "stride_dy": "i32", "stride_x": "i32", "stride_dx": "i32", "M": "i32", "N": "i32",
                               "offset": "fp32"}, bwd, cfg["bwd_num_warps"], n)
                else:
                    fr = build(ln._layer_norm_fwd_kernel, {"X": t, "W": t, "B": t, "Y": t, "MEAN": f32, "RSTD": f32,
                               "stride_x": "i32", "stride_y": "i32", "M": "i32", "N": "i32", "eps": "fp32"},
                               {"BLOCK_N": e, "ROWS": cfg["ROWS"], "HAS_BIAS": True, "RNE_BF16": False}, cfg["num_warps"], n)
                    br = build(ln._layer_norm_bwd_kernel, {"DY": t, "X": t, "W": t, "MEAN": f32, "RSTD": f32, "DX": t,
                               "DW_PART": f32, "DB_PART": f32, "stride_dy": "i32", "stride_x": "i32", "stride_dx": "i32",
                               "M": "i32", "N": "i32"}, {**bwd, "HAS_BIAS": True},
                               cfg["bwd_num_warps"], n)
                rows.append({"op": op, "N": n, "config": str(cfg), **{f"fwd_{k}": v for k, v in fr.items()},
                             **{f"bwd_{k}": v for k, v in br.items()}})
    for n in swiglu_cols:
        for cfg in sw.OP.candidates_for(sw.OP.impl("triton"), arch, {"rows": 16384, "cols": n}, torch.bfloat16):
            c = {"BLOCK_N": cfg["BLOCK_N"], "ROWS": cfg["ROWS"], "RNE_BF16": False}
            fr = build(sw._swiglu_fwd_kernel, {"G": t, "U": t, "Y": t, "stride_g": "i32", "stride_u": "i32",
                       "stride_y": "i32", "M": "i32", "N": "i32"}, c, cfg["num_warps"], n)
            br = build(sw._swiglu_bwd_kernel, {"DY": t, "G": t, "U": t, "DG": t, "DU": t, "stride_dy": "i32",
                       "stride_g": "i32", "stride_u": "i32", "stride_dg": "i32", "stride_du": "i32", "M": "i32",
                       "N": "i32"}, c, cfg["bwd_num_warps"], n)
            rows.append({"op": "swiglu", "N": n, "config": str(cfg), **{f"fwd_{k}": v for k, v in fr.items()},
                         **{f"bwd_{k}": v for k, v in br.items()}})
    return rows


def main() -> None:
    from liger_rt.tools.bench.harness import format_table
    print(format_table(regs(), ["op", "N", "fwd_regs", "fwd_local", "bwd_regs", "bwd_local", "bwd_smem",
                                "bwd_cp_async", "config"]))


if __name__ == "__main__":
    main()
