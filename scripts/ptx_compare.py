"""Does a change to the row norms' Triton code change the machine code their shipped rows were measured on?

Compiles rms_norm's forward and the row-norm family backward (rms_norm, layer_norm with and without bias) of two
checkouts for sm_90, at the config of every shipped hopper rms_norm/layer_norm row, with no GPU (Triton's CUDA
backend compiles on any Linux machine), and compares the PTX: debug lines dropped, kernel parameters named by
their Python argument, declarations of parameters the code never reads dropped.  Identical PTX at every config
means the rows' timings hold for the new code (its freshness hash differs because the source moved).

    python scripts/ptx_compare.py OLD_CHECKOUT NEW_CHECKOUT      # e.g. a `git worktree` of the measured commit

Each checkout compiles in its own process, with the Triton installed here (use the version the rows record).
"""
import json, os, re, sys
import subprocess
import tempfile

if len(sys.argv) == 3:      # the comparison: one child process per checkout
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, repo in enumerate(sys.argv[1:]):
            # the configs of the rows OLD_CHECKOUT ships, for both
            subprocess.run([sys.executable, __file__, "--emit", repo, f"{tmp}/{i}", sys.argv[1]], check=True,
                           env={**os.environ, "TRITON_INTERPRET": "0"})
        names = sorted(os.listdir(f"{tmp}/0"))
        assert names == sorted(os.listdir(f"{tmp}/1")), "the two checkouts compiled different kernel sets"
        diff = [n for n in names if open(f"{tmp}/0/{n}").read() != open(f"{tmp}/1/{n}").read()]
    print(f"{len(names) - len(diff)} of {len(names)} kernels compile to the same PTX" + (": differ " + ", ".join(diff)
                                                                                           if diff else ""))
    sys.exit(1 if diff else 0)
if len(sys.argv) != 5 or sys.argv[1] != "--emit":
    sys.exit("usage: python scripts/ptx_compare.py OLD_CHECKOUT NEW_CHECKOUT")
repo, outdir, rows_repo = sys.argv[2:]
sys.path.insert(0, repo)
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from liger_rt.kernels import rms_norm as RN, row_norm as RW
os.makedirs(outdir, exist_ok=True)
TARGET = GPUTarget("cuda", 90, 32)


def compile_ptx(fn, runtime, constexprs, num_warps):
    """runtime: {arg: (type, value)}; constexprs: {arg: value}.  Every argument of fn must be in one of them."""
    names = fn.arg_names
    sig, attrs, consts = {}, {}, {}
    for i, a in enumerate(names):
        if a in constexprs:
            sig[a] = "constexpr"; consts[a] = constexprs[a]
        else:
            t, v = runtime[a]
            sig[a] = t
            if t.startswith("*") or (t in ("i32", "i64") and v % 16 == 0 and a not in fn.do_not_specialize):
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = set(names) - set(sig)
    assert not missing, missing
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET, options={"num_warps": num_warps})
    ptx = k.asm["ptx"]
    # runtime params in order, then the scratch pointers Triton appends
    rt = [a for a in names if a not in constexprs]
    params = [m for line in ptx.splitlines() if line.strip().startswith(".param")
              for m in re.findall(r"(\w+_param_\d+)", line)]
    mapping = {p: (rt[i] if i < len(rt) else f"extra{i - len(rt)}") for i, p in enumerate(params)}
    body = []
    skip = False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and "debug" in s:
            skip = True
        if skip:
            if s == "}":
                skip = False
            continue
        if s.startswith((".loc", ".file", "//", "$L__func_end", "$L__tmp")) or not s:
            continue
        for p, n in mapping.items():
            s = re.sub(rf"\b{p}\b", f"P_{n}", s)
        s = s.replace(fn.__name__, "KERNEL")
        body.append(s)
    # declarations of params that the body never reads (an unused argument) are not code
    used = set(re.findall(r"P_\w+", "\n".join(l for l in body if not l.startswith(".param"))))
    body = [l for l in body if not (l.startswith(".param") and not any(u in l for u in used))]
    return "\n".join(body) + "\n"


def rows(op):
    path = os.path.join(rows_repo, "liger_rt/tuning_db/defaults/hopper.jsonl")
    recs = [json.loads(l) for l in open(path) if l.strip() and not l.startswith("#")]
    return [r for r in recs if r.get("op") == op and r.get("impl") == "triton" and r.get("table") == "tuning"]


def np2(n):
    return 1 << (n - 1).bit_length()


def bwd_runtime(n, with_mean, with_ds):
    rt = {"DY": ("*bf16", 0), "X": ("*bf16", 0), "W": ("*bf16", 0), "RSTD": ("*fp32", 0), "DX": ("*bf16", 0),
          "DW_PART": ("*fp32", 0), "stride_dy": ("i32", n), "stride_x": ("i32", n), "stride_dx": ("i32", n),
          "M": ("i32", 4096), "N": ("i32", n), "offset": ("fp32", 0)}
    if with_mean:
        rt["MEAN"] = ("*fp32", 0)
    if with_ds:
        rt["stride_ds"] = ("i32", 0)
    return rt


for op in ("rms_norm", "layer_norm"):
    for r in rows(op):
        cfg, n = json.loads(r["config"]), json.loads(r["static_key"])["hidden"]
        tag = re.sub(r'[":{}]', "", f"{op}_{r['device']}_h{n}_{r['bucket']}")
        if op == "rms_norm":
            fwd = RN._rms_norm_fwd_kernel
            rt = {"X": ("*bf16", 0), "W": ("*bf16", 0), "Y": ("*bf16", 0), "RSTD": ("*fp32", 0),
                  "stride_x": ("i32", n), "stride_y": ("i32", n), "M": ("i32", 4096), "N": ("i32", n),
                  "eps": ("fp32", 0), "offset": ("fp32", 0)}
            open(f"{outdir}/{tag}_fwd.ptx", "w").write(compile_ptx(
                fwd, rt, {"BLOCK_N": np2(n), "ROWS": cfg["ROWS"], "RNE_BF16": False}, cfg["num_warps"]))
        bwd = RW.row_norm_bwd_kernel
        if op == "rms_norm" and cfg.get("bwd_rows", 1) > 1:
            continue   # the tile backward (rms_norm.py's own kernel) did not change
        centered = op == "layer_norm"
        for has_bias in ((False, True) if centered else (False,)):
            has_ds = "HAS_DS" in bwd.arg_names
            ce = {"BLOCK_N": np2(n), "PREFETCH": bool(cfg["bwd_prefetch"]), "CENTERED": centered,
                  "HAS_BIAS": has_bias, "RNE_BF16": False}
            if has_ds:
                ce.update(HAS_DS=False, DS=None)
            if not centered:
                ce["MEAN"] = None
            if not has_bias:
                ce["DB_PART"] = None
            rt = bwd_runtime(n, centered, has_ds)
            if has_bias:
                rt["DB_PART"] = ("*fp32", 0)
            if centered:
                ce["offset"] = None
                rt.pop("offset")
            open(f"{outdir}/{tag}_bwd_bias{int(has_bias)}.ptx", "w").write(
                compile_ptx(bwd, rt, ce, cfg["bwd_num_warps"]))
