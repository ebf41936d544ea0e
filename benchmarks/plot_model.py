"""Charts of the model-step benchmark (`liger-tune bench model`'s CSV).

    python benchmarks/plot_model.py [benchmarks/results/model_h200.csv] [docs/model_h200.png]
    python benchmarks/plot_model.py --curves MODEL.csv CURVES.png

The first: tokens/s and peak memory per arm for the README.  --curves: per model, the loss curve
of every run (they must overlap) beside tokens/s and peak memory per arm.

Needs matplotlib (the `plot` extra).
"""
import csv
import json
import sys
from pathlib import Path


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def curves(rows: list[dict], path: Path) -> Path:
    """PNG: per model, the loss curves of every run (left) and tokens/s + peak memory per arm (right)."""
    import matplotlib.pyplot as plt
    keys = list(dict.fromkeys((r["model_type"], r["preset"]) for r in rows))
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, 3.6 * len(keys)), squeeze=False)
    colors = {"baseline": "tab:gray", "liger_rt": "tab:blue", "liger_kernel": "tab:orange"}
    for i, key in enumerate(keys):
        ax, bx = axes[i]
        runs = [r for r in rows if r.get("kind") == "run" and (r["model_type"], r["preset"]) == key]
        for r in runs:
            losses = r["losses"] if isinstance(r["losses"], list) else json.loads(r["losses"])
            idx = int(r["run_index"])
            ax.plot(range(len(losses)), losses, color=colors.get(r["arm"]), alpha=0.8,
                    linestyle="-" if idx < len(runs) / 2 else "--", label=f"{r['arm']} #{idx + 1}")
        if runs and int(runs[0]["warmup"]):
            ax.axvline(int(runs[0]["warmup"]) - 0.5, color="k", linewidth=0.5, linestyle=":")
        summ = [r for r in rows if r.get("kind") == "summary" and (r["model_type"], r["preset"]) == key]
        diffs = ", ".join(f"{r['arm']} {float(r['max_loss_diff']):.2g}" for r in summ)
        ax.set_title(f"{key[1]}: loss per step (warm-up left of the dotted line)\nmax |dloss| vs baseline: {diffs}",
                     fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
        names = [r["arm"] for r in summ]
        bx.bar(names, [float(r["tok_per_s"]) for r in summ], color=[colors.get(n) for n in names])
        bx.set_ylabel("tokens/s")
        peaks = [r["peak_alloc_GB"] for r in summ]
        has_mem = any(_num(v) is not None for v in peaks)
        bx.set_title(f"{key[1]}: throughput (bars)" + (" and peak allocated memory (dots)" if has_mem else ""),
                     fontsize=9)
        if has_mem:
            cx = bx.twinx()
            cx.plot(names, [_num(v) if _num(v) is not None else float("nan") for v in peaks], "ko")
            cx.set_ylabel("peak allocated GB")
            cx.set_ylim(bottom=0)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--curves"]
    src = Path(args[0] if args else "benchmarks/results/model_h200.csv")
    dst = Path(args[1] if len(args) > 1 else "docs/model_h200.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_model needs matplotlib: pip install 'liger-rt[plot]'")
    if "--curves" in sys.argv:
        print(f"wrote {curves(list(csv.DictReader(src.open())), dst)}")
        return
    rows = [r for r in csv.DictReader(src.open()) if r["kind"] == "summary"]
    for r in rows:   # one group per benchmark target (qwen3 and qwen3 with rope=True share a preset)
        r["group"] = r["preset"] + (" rope" if "rope=1" in (r.get("flags") or "") else "")
    presets = list(dict.fromkeys(r["group"] for r in rows))
    arms = ["baseline", "liger_kernel", "liger_rt"]
    colors = {"baseline": "#999999", "liger_kernel": "#6a9fd8", "liger_rt": "#d8743c"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, key, label in ((axes[0], "tok_per_s", "tokens / s (k)"), (axes[1], "peak_alloc_GB", "peak memory (GB)")):
        for i, arm in enumerate(arms):
            hit = {r["group"]: r for r in reversed(rows) if r["arm"] == arm}      # the first row of each group
            xs = [j + (i - 1) * 0.27 for j, p in enumerate(presets) if p in hit]
            ys = [float(hit[p][key]) / (1000 if key == "tok_per_s" else 1) for p in presets if p in hit]
            ax.bar(xs, ys, width=0.27, label=arm, color=colors[arm])
        ax.set_xticks(range(len(presets)), presets)
        ax.set_ylabel(label)
    axes[0].legend(frameon=False)
    steps = {(r.get("warmup"), r.get("steps")) for r in rows}
    how = ", ".join(f"{w} warm-up + {n} steps" for w, n in sorted(steps))
    date = rows[0].get("date", "") if rows else ""
    fig.suptitle(f"One SFT step, batch 4 x 2048, bf16, one H200 ({date}; {how} per run)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
