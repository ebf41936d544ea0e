"""liger_rt on several GPUs under torchrun: FSDP2 parity, throughput per rank, rank-consistent tuning.

    NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/multi_gpu.py [--part parity,throughput,consistency] [--flags fused_linear_cross_entropy=1]
    # the same logic on CPU (gloo, kernels through the Triton interpreter, fp32, tiny sizes):
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port PORT benchmarks/multi_gpu.py \\
        --device cpu --preset tiny --out /tmp/mgpu

The sharded sweep (`liger-tune sweep` under torchrun, docs/cli.md) is the runner's `mgsweep` stage.

Every part wraps the model with FSDP2 (`liger_rt.tools.distributed.wrap`: ``fully_shard`` per
decoder layer, then the root) over all ranks (NCCL on GPUs, gloo on CPU); the patched model is
``liger_rt.patch(model, **flags)`` (family defaults unless --flags), applied before wrapping.

- parity: the unpatched and the patched model at the preset (Qwen3-4B sizes; bf16), padded SDPA
  input of the parity tool (two samples of eight tokens, the second right-padded), one AdamW step
  (lr 1e-3): every row of `liger_rt.tools.parity` (logits, log-probs, entropy, losses, gradients
  and update gathered whole, worst tensor named), gated by its table.  -> multigpu_parity_TAG.csv
- throughput: baseline / patched / patched / baseline, each a fresh model (same seed) and a fresh
  AdamW (lr 1e-4), warm-up + measured steps of batch x seq random tokens (different per rank,
  labels = input ids); per rank: median step time, tokens/s (batch*seq / median), peak allocated
  and reserved memory of the measured steps, first/last loss.  -> multigpu_throughput_TAG.csv
- consistency: LIGER_RT_AUTOTUNE=1 over an empty user DB in a fresh temporary directory, two
  training steps of the patched model at batch x seq: rank 0 tunes every case once (counted per
  rank), nobody tunes in step 2, and the digests of every memoised decision (op, dims, dtype, impl,
  config) agree across ranks.  -> multigpu_consistency_TAG.csv
Rank 0 writes the CSVs and appends to multigpu_TAG.log under --out (TAG: the GPU's name, e.g. h100, or cpu).
Exit status 1 when the parity gates or the consistency checks fail.
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

PARTS = ("parity", "throughput", "consistency")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--preset", default="qwen3-4b", help="a preset name, tiny (qwen3-4b-tiny) or PATH.json")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                    help="default bf16 on GPUs, fp32 on CPU (the interpreter cannot do bf16 arithmetic)")
    ap.add_argument("--part", default="all", help=f"comma list of {', '.join(PARTS)} or all")
    ap.add_argument("--flags", default="", help="liger_rt.patch flags, e.g. fused_linear_cross_entropy=1")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="default 2048 (tiny preset: 32)")
    ap.add_argument("--warmup", type=int, default=None, help="default 5 (tiny preset: 1)")
    ap.add_argument("--steps", type=int, default=None, help="default 20 (tiny preset: 2)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW lr of the parity step")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "liger_rt_multigpu"),
                    help="folder for the CSVs and the log [%(default)s]")
    ap.add_argument("--tag", default=None, help="file name tag (default: the GPU's name, e.g. h100; cpu on CPU)")
    args = ap.parse_args(argv)
    parts = PARTS if args.part == "all" else tuple(p.strip() for p in args.part.split(",") if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"--part {args.part!r}: valid parts are {', '.join(PARTS)} or all")
    args.parts = parts
    tiny = args.preset == "tiny" or args.preset.endswith("-tiny")
    if args.preset == "tiny":
        args.preset = "qwen3-4b-tiny"
    for name, big, small in (("seq", 2048, 32), ("warmup", 5, 1), ("steps", 20, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else big)
    return args


def _gpu_tag(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'."""
    import re
    m = re.search(r"\b([A-Z]+\d+[A-Z]?)\b", name)
    return m.group(1).lower() if m else "gpu"


class Run:
    """What every part needs: args, rank, device, dtype, preset, flags; rank 0 logs."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist
        self.args, self.torch, self.dist = args, torch, dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = args.device
        from liger_rt.tools.bench.model import parse_flags
        from liger_rt.tools.presets import get_preset
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.preset = get_preset(args.preset, "qwen3")
        self.flags = parse_flags(args.flags)
        self.out = Path(args.out)
        self.tag = args.tag or (_gpu_tag(torch.cuda.get_device_name()) if self.device == "cuda" else "cpu")
        self.failed: list[str] = []
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            self._log = open(self.out / f"multigpu_{self.tag}.log", "a")

    def log(self, text: str = "") -> None:
        if self.rank == 0:
            print(text, flush=True)
            self._log.write(text + "\n")
            self._log.flush()

    def write_csv(self, name: str, rows: list[dict]) -> None:
        if self.rank != 0 or not rows:
            return
        path = self.out / f"multigpu_{name}_{self.tag}.csv"
        cols = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
        self.log(f"wrote {path}")

    def gather(self, obj) -> list:
        box = [None] * self.world
        self.dist.all_gather_object(box, obj)
        return box

    def build(self, patched: bool):
        import liger_rt
        from liger_rt.tools.bench.model import build
        model = build(self.preset, self.dtype, self.device, 0, {})
        if patched:
            liger_rt.patch(model, **self.flags)
        return model

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


# -- FSDP2 parity ------------------------------------------------------------------------------

def part_parity(r: Run) -> None:
    from liger_rt.tools.distributed import compare_wrapped, wrap
    from liger_rt.tools.parity import LABELS, format_table, make_inputs
    r.log(f"## parity: {r.preset.name}, {r.args.dtype}, FSDP2 over {r.world} ranks, one AdamW step (lr {r.args.lr})")
    base, new = r.build(False), r.build(True)
    new.load_state_dict(base.state_dict())
    inputs = make_inputs(base)
    t0 = time.perf_counter()
    report = compare_wrapped(wrap(base, "fsdp2"), wrap(new, "fsdp2"), inputs, lr=r.args.lr)
    del base, new
    r.free()
    what = ", ".join(f"{k} x{v}" for k, v in ((report.get("patched") or {}).get("patched") or {}).items())
    r.log(f"patched: {what or 'nothing'}; {time.perf_counter() - t0:.1f} s")
    r.log(format_table(report))
    r.log("PASS" if report["ok"] else "FAIL: " + ", ".join(LABELS[n] for n, x in report["rows"].items() if not x["ok"]))
    oks = r.gather(report["ok"])
    if not all(oks):
        r.failed.append(f"parity (ok per rank: {oks})")
    cols = ("max_abs", "mean_abs", "linf_over_baseline_max", "mean_over_baseline_mean", "gate", "tolerance")
    r.write_csv("parity", [
        {"quantity": name, **{k: x[k] for k in cols}, "ok": int(x["ok"]), "worst_tensor": x.get("tensor", ""),
         "preset": r.preset.name, "dtype": report["dtype"], "world": r.world, "flags": r.args.flags}
        for name, x in report["rows"].items()])


# -- throughput per rank ---------------------------------------------------------------------------

def _arm(r: Run, arm: str) -> dict:
    from liger_rt.tools.bench.model import random_ids, train_steps
    from liger_rt.tools.distributed import wrap
    r.free()
    model = wrap(r.build(arm == "patched"), "fsdp2")
    ids = random_ids(model, r.args.batch, r.args.seq, seed=r.rank, device=r.device)
    opt = r.torch.optim.AdamW(model.parameters(), lr=1e-4)
    try:
        return {"rank": r.rank, **train_steps(model, opt, ids, r.args.warmup, r.args.steps, r.device == "cuda")[0]}
    finally:
        del model, opt
        r.free()


def part_throughput(r: Run) -> None:
    from liger_rt.tools.bench.model import LOSS_RTOL
    order = ("baseline", "patched", "patched", "baseline")
    a = r.args
    r.log(f"## throughput: {r.preset.name}, {a.dtype}, FSDP2 over {r.world} ranks, batch {a.batch} x seq {a.seq} "
          f"per rank, {a.warmup} warm-up + {a.steps} measured steps, order {' > '.join(order)}, "
          f"flags {a.flags or 'family defaults'}")
    runs = []
    for n, arm in enumerate(order):
        t0 = time.perf_counter()
        per_rank = r.gather(_arm(r, arm))
        runs += [{"kind": "run", "run": n + 1, "arm": arm, **x} for x in per_rank]
        peak = per_rank[0]["peak_alloc_GB"]
        r.log(f"[{n + 1}/{len(order)}] {arm}: " + ", ".join(
            f"rank {x['rank']} {x['median_step_ms']:.1f} ms {x['tok_per_s']:.0f} tok/s" for x in per_rank)
            + (f", rank 0 peak {peak:.2f} GB alloc {per_rank[0]['peak_reserved_GB']:.2f} GB reserved" if peak else "")
            + f" ({time.perf_counter() - t0:.0f} s)")
    summary = []
    for rank in range(r.world):
        for arm in ("baseline", "patched"):
            mine = [x for x in runs if x["arm"] == arm and x["rank"] == rank]
            row = {"kind": "summary", "arm": arm, "rank": rank,
                   "median_step_ms": statistics.mean(x["median_step_ms"] for x in mine),
                   "tok_per_s": statistics.mean(x["tok_per_s"] for x in mine)}
            for k in ("peak_alloc_GB", "peak_reserved_GB"):
                row[k] = max((x[k] for x in mine if x[k] is not None), default=None)
            summary.append(row)
        b, p = summary[-2:]         # this rank's baseline and patched rows
        mem = "" if b["peak_alloc_GB"] is None else (
            f", peak alloc {b['peak_alloc_GB']:.2f} -> {p['peak_alloc_GB']:.2f} GB"
            f", reserved {b['peak_reserved_GB']:.2f} -> {p['peak_reserved_GB']:.2f} GB")
        r.log(f"rank {rank}: baseline {b['tok_per_s']:.0f} tok/s, patched {p['tok_per_s']:.0f} tok/s "
              f"({p['tok_per_s'] / b['tok_per_s']:.3f}x){mem}")
    # the same weights and batches: only kernel rounding separates the arms' loss curves
    worst = 0.0
    for rank in range(r.world):
        curves = [x["losses"] for x in runs if x["rank"] == rank]
        worst = max(worst, max(abs(u - v) for c in curves[1:] for u, v in zip(curves[0], c)) / abs(curves[0][0]))
    tol = LOSS_RTOL[r.args.dtype]
    verdict = "overlap" if worst <= tol else "DIVERGE"
    r.log(f"loss curves: max |diff| / first loss {worst:.2e} ({verdict}, gate {tol:.0e})")
    if worst > tol:
        r.failed.append(f"throughput loss curves diverge ({worst:.2e})")
    r.write_csv("throughput", [{k: v for k, v in x.items() if k != "losses"} for x in runs] + summary)


# -- rank consistency -----------------------------------------------------------------------------

def part_consistency(r: Run) -> None:
    from liger_rt import autotune
    from liger_rt.tools.bench.harness import dispatch_env
    from liger_rt.tools.bench.model import random_ids
    from liger_rt.tools.distributed import check_decisions_agree, decisions, decisions_digest, wrap
    box = [tempfile.mkdtemp(prefix="liger_rt_multigpu_db_") if r.rank == 0 else None]
    r.dist.broadcast_object_list(box, src=0)       # one host: one empty DB file for every rank
    db = os.path.join(box[0], "tuning.db")
    tuned, real = [], autotune.tuning.tune

    def counted(op, target, dtype, dims, **kw):
        tuned.append(json.dumps([op.name, dims, str(dtype)], sort_keys=True))
        return real(op, target, dtype, dims, **kw)
    with dispatch_env(LIGER_RT_TUNING_DB=db, LIGER_RT_AUTOTUNE="1"):
        r.log(f"## consistency: LIGER_RT_AUTOTUNE=1, empty DB {db}, {r.preset.name}, {r.args.dtype}, "
              f"batch {r.args.batch} x seq {r.args.seq}, two FSDP2 training steps")
        autotune.tuning.tune = counted
        try:
            model = wrap(r.build(True), "fsdp2")
            ids = random_ids(model, r.args.batch, r.args.seq, seed=r.rank, device=r.device)
            opt = r.torch.optim.AdamW(model.parameters(), lr=1e-4)
            per_step = []
            for _ in range(2):
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                r.sync()
                per_step.append((len(tuned), len(decisions()), time.perf_counter() - t0))
            del model, opt
            r.free()
            try:
                check_decisions_agree()
                agree = True
            except RuntimeError as exc:
                agree = False
                r.log(str(exc))
            rows = r.gather({"rank": r.rank, "tuned": len(tuned), "tuned_unique": len(set(tuned)),
                             "tuned_in_step2": per_step[1][0] - per_step[0][0], "decisions": len(decisions()),
                             "new_decisions_in_step2": per_step[1][1] - per_step[0][1], "step1_s": per_step[0][2],
                             "step2_s": per_step[1][2], "agree": int(agree), "digest": decisions_digest()})
            if r.rank == 0:
                for d in decisions():
                    r.log(f"  {d['op']} {d['dims']} {d['dtype']} -> {d['impl']} {json.dumps(d['config'])}")
                from liger_rt.tuning_db import open_store
                store = open_store(db)
                r.log(f"DB rows written (rank 0, origin online): {len(store.all_rows('tuning'))}")
                store.close()
            for row in rows:
                r.log(f"rank {row['rank']}: tuned {row['tuned']} ({row['tuned_unique']} distinct, "
                      f"{row['tuned_in_step2']} in step 2), {row['decisions']} decisions, "
                      f"digest {row['digest'][:16]}, step 1 {row['step1_s']:.1f} s, step 2 {row['step2_s']:.2f} s")
            ok = (agree and len({x["digest"] for x in rows}) == 1 and rows[0]["tuned"] >= 1
                  and rows[0]["tuned"] == rows[0]["tuned_unique"] and all(x["tuned"] == 0 for x in rows[1:])
                  and all(x["tuned_in_step2"] == 0 and x["new_decisions_in_step2"] == 0 for x in rows))
            r.log("PASS: every decision identical on every rank, rank 0 tuned each case once" if ok else
                  "FAIL: decisions or tuning differ across ranks (see above)")
            if not ok:
                r.failed.append("consistency")
            r.write_csv("consistency", rows)
        finally:
            autotune.tuning.tune = real
            if r.rank == 0:
                shutil.rmtree(box[0], ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("multi_gpu.py: run it under torchrun (python3 -m torch.distributed.run --nproc-per-node 2 ...)",
              file=sys.stderr)
        return 2
    import torch
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("multi_gpu.py: --device cuda but no CUDA device here", file=sys.stderr)
        return 2
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.device == "cpu":
        if args.dtype == "bf16":
            print("multi_gpu.py: bf16 on CPU runs the kernels through the Triton interpreter, which cannot do bf16 "
                  "arithmetic; use --dtype fp32 or fp16", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"    # CPU runs the kernels interpreted; before any kernel import
        backend = {"backend": "gloo"}
    else:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")    # NVLink multicast stays off on the lent machines
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = {"backend": "nccl", "device_id": torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))}
    import torch.distributed as dist
    dist.init_process_group(**backend, timeout=timedelta(seconds=900))
    try:
        r = Run(args)
    except ValueError as exc:
        print(f"multi_gpu.py: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    import transformers
    import triton
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    r.log(f"# multi_gpu.py {time.strftime('%Y-%m-%d %H:%M:%S')}: {r.world} x {name}, torch {torch.__version__}, "
          f"triton {triton.__version__}, transformers {transformers.__version__}, parts {','.join(args.parts)}, "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', '-')}, "
          f"LIGER_RT_TUNING_DB={os.environ.get('LIGER_RT_TUNING_DB', '(default)')}")
    for part in args.parts:
        try:
            {"parity": part_parity, "throughput": part_throughput, "consistency": part_consistency}[part](r)
        except Exception:
            # every rank runs the same program: an error here is most likely everyone's; stop rather
            # than enter the next part's collectives out of step
            r.log(f"ERROR in {part} (rank {r.rank}):\n{traceback.format_exc()}")
            print(f"rank {r.rank}: {part} failed:\n{traceback.format_exc()}", file=sys.stderr)
            r.failed.append(f"{part} (error)")
            break
    r.log("failed: " + "; ".join(r.failed) if r.failed else "all parts passed")
    dist.destroy_process_group()
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
