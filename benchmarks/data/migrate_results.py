"""One-off: the per-run CSVs of benchmarks/results/ as rows of the cumulative dataset (benchmarks/data/*.csv).

    python benchmarks/data/migrate_results.py

Every value comes from its source file: the device, versions, date and method its columns give; where a file
lacks a version its log's header line ("torch ... triton ... transformers ...") gives it (LOGS below); what neither
records stays empty.  A run id is one per source file and (date, liger_rt version, torch version) group in it: the
harness merged earlier runs' rows into later files, so a row found again in a later file (the same non-empty
values) is kept once, with the run of the file that first held it (files in the order git added them).
"""
from __future__ import annotations

import csv
import hashlib
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "benchmarks" / "results"
OUT = ROOT / "benchmarks" / "data"
COLUMNS = ("kind", "name", "shape", "arm", "metric", "value", "unit", "gpu", "dtype", "method", "torch", "triton",
           "transformers", "liger_rt", "peer_version", "commit", "date", "run_id", "notes")
# files without a transformers column: the run's log header names the versions it ran
LOGS = {"flce_overlap_h200.csv": "h200_s7_call2.log", "moe_wgrad_h200.csv": "h200_s9_call2_wgrad.log"}
OP_KINDS = {"rms_norm": "norms", "layer_norm": "norms", "swiglu": "gated_mlp", "geglu": "gated_mlp",
            "short_conv": "lfm2_ops", "moe_router": "moe_router", "moe_experts": "moe_experts",
            "fused_linear_cross_entropy": "losses", "cross_entropy": "losses",
            "fused_linear_logprobs": "logprobs"}
ARMS = {"compile": "torch_compile", "baseline": "eager", "hf_grouped_mm": "eager", "baseline+compile": "torch_compile"}
PEER_COLUMN = {"liger_kernel": "liger_kernel", "trl": "trl"}
WALL = "do_bench"                 # triton.testing.do_bench median, L2 flushed: host time included
DEVICE = "cuda-graph"              # a CUDA-graph replay: device time only
PEAK = "peak fwd+bwd"              # peak allocated during fwd+bwd beyond the live inputs
DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def num(v: str) -> str:
    """A measured value with 5 significant digits (the timers' resolution is coarser)."""
    return f"{float(v):.5g}"


def present(v) -> bool:
    return v not in ("", None, "n/a", "None") and str(v).lower() != "nan"


def arm_of(impl: str) -> str:
    return ARMS.get(impl) or impl.replace("+compile", "+torch_compile")


def shape_of(case: str) -> str:
    """'rows=16384,hidden=4096,dtype=bf16' -> 'rows=16384;hidden=4096'."""
    return ";".join(p for p in case.split(",") if not p.startswith("dtype="))


def loss_shape(s: str) -> str:
    """'BT8192_H2048_V65536' -> 'tokens=8192;hidden=2048;vocab=65536'; 'R8192_V151936' -> 'rows=8192;vocab=151936'."""
    names = {"BT": "tokens", "H": "hidden", "V": "vocab", "R": "rows"}
    return ";".join(f"{names[k]}={v}" for k, v in re.findall(r"([A-Z]+)(\d+)", s))


def config_note(config: str) -> str:
    """'triton {"BLOCK_V": 4096, ...} (db)' -> 'config triton (db)': which implementation and whence, not the tiles."""
    return "config " + re.sub(r" ?\{.*\}", "", config).strip() if present(config) else ""


def log_versions(name: str) -> dict:
    m = re.search(r"torch (\S+) triton (\S+) transformers (\S+)", (SRC / "logs" / name).read_text())
    return {"torch": m.group(1), "triton": m.group(2), "transformers": m.group(3)} if m else {}


class Migration:
    def __init__(self):
        self.rows: dict[str, list[dict]] = {"kernels": [], "models": [], "host": []}
        self.seen: set[frozenset] = set()
        self.run_ids: dict[tuple, str] = {}
        self.ceilings: set[tuple] = set()

    def provenance(self, file: str, r: dict) -> dict:
        """The columns every row of this source row shares; the run id of its (file, date, versions) group."""
        extra = log_versions(LOGS[file]) if file in LOGS else {}
        version = r.get("liger_rt", "")
        m = re.fullmatch(r"([\w.]+)\+([0-9a-f]+)(\.dirty)?", version or "")
        key = (file, r["date"], version, r.get("torch", ""))
        if key not in self.run_ids:
            digest = hashlib.sha1("|".join(key).encode()).hexdigest()[:4]
            self.run_ids[key] = f"{r['date'].replace('-', '')}-{digest}"
        return {"gpu": r["gpu"], "torch": r.get("torch") or extra.get("torch", ""),
                "triton": r.get("triton") or extra.get("triton", ""),
                "transformers": r.get("transformers") or extra.get("transformers", ""),
                "liger_rt": m.group(1) if m else "", "date": r["date"], "run_id": self.run_ids[key],
                "commit": (m.group(2) + ("-dirty" if m.group(3) else "")) if m else ""}

    def add(self, table: str, file: str, r: dict, base: dict, metrics: list[tuple], notes: list[str] = ()):
        """metrics: (metric, value, unit, method); rows whose value is missing are left out."""
        prov = self.provenance(file, r)
        peer = PEER_COLUMN.get(base["arm"])
        # the device copy of the tree carried a stale git HEAD under newer files (docs/perf.md of that commit)
        stale = "code at adffa0f" if prov["commit"] == "59b6ea5" else ""
        text = "; ".join(filter(None, [*notes, stale]))
        for metric, value, unit, method in metrics:
            if present(value):
                self.rows[table].append({**base, **prov, "metric": metric, "value": num(value), "unit": unit,
                                         "method": method, "notes": text,
                                         "peer_version": r.get(PEER_COLUMN[peer], "") if peer else ""})

    def ceiling(self, file: str, r: dict, kind: str, rate: str, value, how: str):
        """The run's copy (GB/s) or bf16 matmul (TFLOP/s) ceiling, once per run and kind: a rate's fraction of the
        ceiling is rate / ceiling of the same run."""
        if not present(value):
            return
        prov = self.provenance(file, r)
        key = (prov["run_id"], kind, rate)
        if key not in self.ceilings:
            self.ceilings.add(key)
            metric, unit = ("ceiling_tflops", "TFLOP/s") if rate == "tflops" else ("ceiling_gbps", "GB/s")
            self.rows["kernels"].append({**prov, "kind": kind, "name": "ceiling", "shape": "", "arm": "probe",
                                         "dtype": "bf16", "metric": metric, "value": f"{float(value):.4g}",
                                         "unit": unit, "method": how, "notes": "", "peer_version": ""})

    def rates(self, file: str, r: dict, kind: str):
        """A script's fixed ceiling, from a row's rate and its fraction of it."""
        for unit, metric in (("TFLOPs", "tflops"), ("GBps", "gbps")):
            rate, frac = r.get(unit), r.get("frac_ceiling")
            if present(rate) and present(frac) and float(frac):
                self.ceiling(file, r, kind, metric, float(rate) / float(frac), "the script's constant")

    def fresh(self, r: dict) -> bool:
        key = frozenset((k, v) for k, v in r.items() if present(v))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    # -- kernel families ------------------------------------------------------------------------------
    def harness_row(self, file: str, r: dict):
        """The bench harness's rows (norms, lfm2 ops, MoE): one per arm and pass."""
        if present(r.get("error")) or not present(r.get("ms")):
            return
        unit = "TFLOPs" if present(r.get("TFLOPs")) else "GBps"
        p = r["pass"]
        base = {"kind": OP_KINDS[r["op"]], "name": f"{r['op']}.{p}", "shape": shape_of(r["case"]),
                "arm": arm_of(r["impl"]), "dtype": DTYPES.get(r["dtype"], r["dtype"])}
        metric = "tflops" if unit == "TFLOPs" else "gbps"
        self.ceiling(file, r, base["kind"], metric,
                     r.get("matmul_ceiling_TFLOPs" if unit == "TFLOPs" else "copy_ceiling_GBps"), "measured by the run")
        metrics = [("ms", r["ms"], "ms", WALL if r.get("ms_method") == "do_bench" else r.get("ms_method", WALL)),
                   ("dev_ms", r.get("dev_ms") if r.get("dev_ms_method") == DEVICE else "", "ms", DEVICE),
                   (metric, r.get(unit), "TFLOP/s" if unit == "TFLOPs" else "GB/s", WALL),
                   ("extra_gb", r.get("peak_GB") if p == "fwdbwd" else "", "GB", PEAK)]
        notes = [config_note(r["config"]) if r["impl"] == "liger_rt" else "",
                 "arms reversed" if r.get("arm_order") == "reversed" else ""]
        self.add("kernels", file, r, base, metrics, notes)

    def early_kernel_row(self, file: str, r: dict):
        """The first benchmark scripts' rows (norms, lfm2 ops, MoE): one per arm, fwd and fwd+bwd in columns."""
        if present(r.get("error")):
            return
        op = r["op"]
        if "M" in r and present(r.get("M")):
            shape = f"rows={r['M']};{'cols' if op in ('swiglu', 'geglu') else 'hidden'}={r['N']}"
        elif op == "short_conv":
            shape = ";".join(f"{k}={r[k]}" for k in ("batch", "seq", "hidden", "kernel"))
        elif op == "moe_router":
            shape = ";".join(f"{k}={r[k]}" for k in ("tokens", "experts", "top_k"))
        else:
            shape = ";".join(f"{k}={r[k]}" for k in ("tokens", "experts", "top_k", "hidden", "intermediate",
                                                     "routing"))
        unit = "TFLOPs" if present(r.get("fwd_TFLOPs")) else "GBps"
        metric = "tflops" if unit == "TFLOPs" else "gbps"
        for p, col in (("fwd", "fwd"), ("fwdbwd", "fwdbwd")):
            base = {"kind": OP_KINDS[op], "name": f"{op}.{p}", "shape": shape, "arm": arm_of(r["impl"]),
                    "dtype": DTYPES.get(r["dtype"], r["dtype"])}
            rate, frac = r.get(f"{col}_{unit}"), r.get(f"{col}_frac_ceiling")
            if present(rate) and present(frac) and float(frac):
                self.ceiling(file, r, base["kind"], metric, float(rate) / float(frac), "the script's constant")
            metrics = [("ms", r.get(f"{col}_ms"), "ms", WALL),
                       ("dev_ms", r.get(f"{col}_dev_ms"), "ms", DEVICE),
                       (metric, rate, "TFLOP/s" if unit == "TFLOPs" else "GB/s", WALL),
                       ("extra_gb", r.get("peak_gb") if p == "fwdbwd" else "", "GB", PEAK)]
            notes = [config_note(r["config"]) if r["impl"] == "liger_rt" else ""]
            self.add("kernels", file, r, base, metrics, notes)

    def loss_row(self, file: str, r: dict):
        """The first losses script: kind flce / ce, fwd+bwd of a training step's loss."""
        if not present(r.get("ms")):
            return
        name = {"flce": "fused_linear_cross_entropy", "ce": "cross_entropy"}[r["kind"]]
        base = {"kind": "losses", "name": f"{name}.fwdbwd", "shape": loss_shape(r["shape"]),
                "arm": arm_of(r["impl"]), "dtype": r["dtype"]}
        notes = [config_note(r.get("config", "")) if r["impl"].startswith("liger_rt") else ""]
        if r["impl"] == "liger_rt_inplace":                        # a variant of the dispatched op, not a peer
            base["arm"] = "liger_rt@inplace_backward=True"
        self.rates(file, r, base["kind"])
        self.add("kernels", file, r, base, [
            ("ms", r["ms"], "ms", WALL), ("extra_gb", r.get("peak_extra_GB"), "GB", PEAK),
            ("tflops", r.get("TFLOPs"), "TFLOP/s", WALL), ("gbps", r.get("GBps"), "GB/s", WALL)], notes)

    def logprobs_row(self, file: str, r: dict):
        if present(r.get("error")) or not present(r.get("ms")):
            return
        p = {"fwd_nograd": "fwd_nograd"}.get(r["pass"], r["pass"])
        base = {"kind": "logprobs", "name": f"{r['op']}.{p}",
                "shape": ";".join(f"{k}={r[k]}" for k in ("tokens", "hidden", "vocab")),
                "arm": arm_of(r["impl"]), "dtype": r["dtype"]}
        notes = [config_note(r.get("config", "")) if r["impl"] == "liger_rt" else "",
                 f"temperature {r['temperature']}" if r.get("temperature") not in ("", "1.0") else ""]
        self.add("kernels", file, r, base, [
            ("ms", r["ms"], "ms", WALL),
            ("dev_ms", r.get("dev_ms") if r.get("dev_ms_method") == DEVICE else "", "ms", DEVICE),
            ("extra_gb", r.get("peak_GB"), "GB", PEAK if p == "fwdbwd" else "peak fwd")], notes)

    def probe_row(self, file: str, r: dict):
        """Config and variant probes (FLCE chunks, CE launch configs, MoE kernel variants): arms named `impl@knobs`."""
        if not present(r.get("ms")):
            return
        notes, method = [], WALL
        if file.startswith("flce_overlap"):
            m = re.fullmatch(r"c(\d+)_o(\d+)", r["arm"])
            arm = f"triton@chunk={m.group(1)},overlap={m.group(2)}" if m else arm_of(r["arm"])
            base = {"kind": "losses", "name": "fused_linear_cross_entropy.fwdbwd", "shape": loss_shape(r["shape"])}
            notes.append("warm-up 100 ms, rep 400 ms")
        elif file.startswith("flce_chunks"):
            arm = f"triton@chunk={r['chunk']}"
            base = {"kind": "losses", "name": "fused_linear_cross_entropy.fwdbwd", "shape": loss_shape(r["shape"])}
            notes.append(f"config {r['config']}" + ("; outside the candidate space" if r["in_space"] == "False"
                                                     else ""))
        elif file.startswith("ce_configs"):
            arm = f"triton@BLOCK_V={r['BLOCK_V']},num_warps={r['num_warps']}"
            base = {"kind": "losses", "name": "cross_entropy.fwdbwd", "shape": loss_shape(r["shape"])}
            notes.append("the heuristic's config" if r["heuristic"] == "True" else "")
        else:                                                      # moe_wgrad, moe_split, moe_desc
            knobs = {"triton_sorted0": "wgrad_sorted=0", "triton_sorted1": "wgrad_sorted=1",
                     "triton_sorted2": "wgrad_sorted=2", "triton_heuristic": "heuristic",
                     "triton_split": "up_bwd_split=1", "triton_split_d": "up_bwd_split=1,down_desc=1",
                     "triton_split_ud": "up_bwd_split=1,down_desc=1,up_desc=1"}
            m = re.fullmatch(r"triton_desc(\d)(\d)", r["arm"])
            knob = f"up_desc={m.group(1)},down_desc={m.group(2)}" if m else knobs.get(r["arm"])
            arm = f"triton@{knob}" if knob else f"{r['arm']}@default"
            base = {"kind": "moe_experts", "name": "moe_experts.fwdbwd",
                    "shape": ";".join(f"{k}={r[k]}" for k in ("tokens", "experts", "top_k", "hidden",
                                                               "intermediate"))}
            notes.append("warm-up 50 ms, rep 300 ms; heuristic tiles")
        base.update(arm=arm, dtype="bf16")
        self.rates(file, r, base["kind"])
        self.add("kernels", file, r, base, [
            ("ms", r["ms"], "ms", method), ("extra_gb", r.get("peak_extra_GB"), "GB", PEAK),
            ("tflops", r.get("TFLOPs"), "TFLOP/s", WALL), ("gbps", r.get("GBps"), "GB/s", WALL),
            ("wgrad_dev_ms", r.get("wgrad_dev_ms"), "ms", "profiler")], notes)

    # -- model steps, host --------------------------------------------------------------------------------
    def model_row(self, file: str, r: dict):
        if r.get("kind") != "run" or present(r.get("error")) or not present(r.get("tok_per_s")):
            return
        # the name is the preset plus the patch flags beyond the fused loss (qwen3-1.7b+rope), as the bench names it
        extra = [f.removesuffix("=1") for f in r.get("flags", "").split(",")
                 if f and f != "fused_linear_cross_entropy=1"]
        kind = "model_compiled" if file.startswith("model_compiled") else "model"
        base = {"kind": kind, "name": r["preset"] + "".join(f"+{f}" for f in extra),
                "shape": f"batch={r['batch']};seq={r['seq']}", "arm": arm_of(r["arm"]), "dtype": r["dtype"]}
        notes = [f"{r['layers']} layers, {r['warmup']}+{r['steps']} steps",
                 f"config {r['config']}" if present(r.get("config")) else "",
                 f"compile mode {r['compile_mode']}" if "compile" in r["arm"] and present(r.get("compile_mode"))
                 else ""]
        self.add("models", file, r, base, [
            ("tok_s", r["tok_per_s"], "tok/s", "median step"),
            ("peak_gb", r.get("peak_alloc_GB"), "GB", "max allocated"),
            ("frac_ceiling", r.get("mfu"), "", "model FLOPs / bf16 matmul ceiling")], notes)

    def host_row(self, file: str, r: dict):
        what = r["what"]
        if file.startswith("dispatch_overhead"):
            method, value = f"perf_counter mean of {r['calls']} calls", r["us_per_call"]
            notes = [f"Python {r['python']}"]
        else:
            method, value, notes = r.get("method", ""), r["us"], []
            for prefix, how in (("host: ", "perf_counter mean"), ("do_bench: ", WALL), ("graph: ", "cuda-graph")):
                if what.startswith(prefix):
                    what, method = what[len(prefix):], method or how
            method = {"device: cuda-graph": DEVICE, "do_bench median (wall)": WALL}.get(method, method)
            method = method.removeprefix("host: ")
        # liger_rt for our calls, liger_kernel for the peer's, floor for what any call pays (as the bench names them)
        arm = ("liger_kernel" if "Liger" in what else
               "liger_rt" if re.search(r"ops\.|select|launcher|RMSNormFunction|autotune|sweep case", what) else
               "floor")
        rows, cols = (r.get("shape") or "x").partition("x")[::2]
        shape = f"rows={rows};hidden={cols}" if cols else ""
        self.add("host", file, r, {"kind": "host", "name": what, "shape": shape, "arm": arm, "dtype": ""},
                 [({DEVICE: "dev_us", WALL: "wall_us"}.get(method, "host_us"), value, "us", method)], notes)

    # -- files --------------------------------------------------------------------------------------------
    def handler(self, file: str):
        if file.startswith(("flce_overlap", "flce_chunks", "ce_configs", "moe_wgrad", "moe_split", "moe_desc")):
            return self.probe_row
        if file.startswith("model"):
            return self.model_row
        if file.startswith(("host_overhead", "dispatch_overhead")):
            return self.host_row
        if file.startswith("losses"):
            return self.loss_row
        if file.startswith("logprobs"):
            return self.logprobs_row
        return lambda f, r: (self.harness_row if present(r.get("pass")) else self.early_kernel_row)(f, r)

    def run(self) -> None:
        def added(p: Path) -> tuple:
            out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%ct", "--", str(p)], cwd=ROOT,
                                 capture_output=True, text=True).stdout.split()
            return (int(out[-1]) if out else 0, p.name)
        for path in sorted(SRC.glob("*.csv"), key=added):
            with path.open(newline="") as fh:
                for r in csv.DictReader(fh):
                    if self.fresh(r):
                        self.handler(path.name)(path.name, r)
        OUT.mkdir(parents=True, exist_ok=True)
        for table, rows in self.rows.items():
            with (OUT / f"{table}.csv").open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=COLUMNS, lineterminator="\n")
                w.writeheader()
                w.writerows(rows)
            print(f"{table}.csv: {len(rows)} rows, {len({r['run_id'] for r in rows})} runs")


if __name__ == "__main__":
    Migration().run()
