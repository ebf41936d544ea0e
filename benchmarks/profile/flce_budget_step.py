"""Compiled training steps at two settings of the fused loss's chunk: what its logits budget costs a whole step.

    python benchmarks/profile/flce_budget_step.py --run qwen3rope --a budget=320 --b budget=160
    python benchmarks/profile/flce_budget_step.py --run qwen3rope,lfm2rope --a chunk=1024 --b shipped

One process per call, counterbalanced (baseline, baseline+compile, A, B, then in reverse), each arm a fresh model
at B4 x T2048 in bf16 (`bench_models.py` runs, Liger-Kernel's arm left out). A and B are both liger_rt under
torch.compile with the default policy (fuse): setting A runs as arm `liger_rt+compile`, B as
`liger_rt+compile+fuse`. A setting is `budget=MiB` (the arch's logits budget, `LOGITS_BUDGET` in
liger_rt/kernels/fused_linear_cross_entropy.py, which the heuristic's chunk follows), `chunk=N` (the fused loss's
decision with its chunk replaced) or `shipped`. Under torch.compile the loss is decided at 4096 tokens
(dispatch.TRACED_TOKENS); a budget moves the chunk only where the heuristic decides there (no DB row serves the
shape: `liger-tune explain`), `chunk=N` everywhere. Prints each arm's step time and the fused loss's decisions
with their origin; `--csv PATH` writes every row (nothing goes to the dataset).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_models as BM                                    # noqa: E402  (benchmarks/ on the path)
from liger_rt import backend, dispatch                       # noqa: E402
from liger_rt.kernels import fused_linear_cross_entropy as flce   # noqa: E402
from liger_rt.tools.bench import harness as H, model as M    # noqa: E402

MiB = 1 << 20
ARM_OF = {"a": "liger_rt+compile", "b": "liger_rt+compile+fuse"}
SHIPPED = {"budget": None, "chunk": None}


def parse_setting(text: str) -> dict:
    """`budget=MiB`, `chunk=N` or `shipped` -> {"budget": bytes or None, "chunk": rows or None}."""
    if text == "shipped":
        return SHIPPED
    key, _, value = text.partition("=")
    if key not in ("budget", "chunk") or not value.isdigit() or int(value) < 1:
        raise ValueError(f"setting {text!r}: expected budget=MiB, chunk=N or shipped")
    return {"budget": int(value) * MiB if key == "budget" else None, "chunk": int(value) if key == "chunk" else None}


class Settings:
    """Applies a setting per arm: the arch's budget while the arm runs, the chunk in the fused loss's decision."""

    def __init__(self, by_arm: dict[str, dict]):
        self.by_arm, self.now = by_arm, SHIPPED
        self.decisions: list[str] = []

    def decide(self, op, target, dtype, dims):
        d = self.original_decide(op, target, dtype, dims)
        if op.name != flce.OP.name:
            return d
        if self.now["chunk"] and d.impl == "triton":
            d = dataclasses.replace(d, config=dataclasses.replace(d.config, chunk=self.now["chunk"]))
        self.decisions.append(f"{d.impl} {d.config} ({d.origin}) at {dict(dims)}")
        return d

    @contextlib.contextmanager
    def arm(self, arm: str):
        """While `arm` runs: its budget on this GPU's arch, its chunk in the fused loss's decisions."""
        self.now = self.by_arm.get(arm, SHIPPED)
        name = backend.detect().name
        flce.LOGITS_BUDGET[name] = self.now["budget"] or self.shipped[name]
        dispatch.reset()
        try:
            yield
        finally:
            flce.LOGITS_BUDGET[name] = self.shipped[name]
            self.now = SHIPPED
            dispatch.reset()

    def __enter__(self):
        self.shipped = dict(flce.LOGITS_BUDGET)
        self.original_decide, dispatch.decide = dispatch.decide, self.decide
        return self

    def __exit__(self, *exc):
        dispatch.decide = self.original_decide
        flce.LOGITS_BUDGET.update(self.shipped)
        dispatch.reset()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="qwen3rope", help="bench_models.py runs, comma-separated [qwen3rope]")
    ap.add_argument("--a", default="budget=320", help="setting of arm liger_rt+compile [budget=320]")
    ap.add_argument("--b", default="shipped", help="setting of arm liger_rt+compile+fuse [shipped]")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--csv", default=None, help="write every row to this CSV")
    a = ap.parse_args()
    try:
        settings = {ARM_OF["a"]: parse_setting(a.a), ARM_OF["b"]: parse_setting(a.b)}
        names = BM.run_names([a.run])
    except (ValueError, SystemExit) as exc:
        ap.error(str(exc))
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(H.no_gpu_message("flce_budget_step.py"))
    if os.environ.get("LIGER_RT_COMPILE_POLICY", "fuse") != "fuse":
        ap.error("both settings run under the default compile policy: unset LIGER_RT_COMPILE_POLICY")
    ceilings, rows = H.measure_ceilings(quick=True), []
    arms = ("baseline", "baseline+compile", ARM_OF["a"], ARM_OF["b"])
    for name in names:
        spec = {**BM.bench_spec(name), "liger_kernel": False}
        t0 = time.time()
        with Settings(settings) as s:
            got = M.run_model_bench(**spec, batch=4, seq=2048, steps=a.steps, warmup=a.warmup, dtype="bf16",
                                    device="cuda", ceilings=ceilings, compile=True, arms=arms, arm_context=s.arm)
        for r in got:
            r["run"], r["setting"] = name, {ARM_OF["a"]: a.a, ARM_OF["b"]: a.b}.get(r["arm"], "")
        rows += got
        print(f"\n== {name} ({time.time() - t0:.0f} s): {ARM_OF['a']} = {a.a}, {ARM_OF['b']} = {a.b}\n"
              + M.format_summary(got))
        print("fused loss decisions:\n  " + "\n  ".join(dict.fromkeys(s.decisions)), flush=True)
        if a.csv:
            H.write_csv(rows, a.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
