"""Chart of the model-step benchmark (tokens/s and peak memory per arm) for the README.

    python benchmarks/plot_model.py [benchmarks/results/model_h200.csv] [docs/model_h200.png]

Needs matplotlib (the `plot` extra).
"""
import csv
import sys
from pathlib import Path


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/model_h200.csv")
    dst = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/model_h200.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_model needs matplotlib: pip install 'liger-rt[plot]'")
    rows = [r for r in csv.DictReader(src.open()) if r["kind"] == "summary"]
    for r in rows:   # one group per benchmark target (qwen3 and qwen3 with rope=True share a preset)
        r["group"] = r["preset"] + (" rope" if "rope=1" in (r.get("flags") or "") else "")
    presets = list(dict.fromkeys(r["group"] for r in rows))
    arms = ["baseline", "liger_kernel", "liger_rt"]
    colors = {"baseline": "#999999", "liger_kernel": "#6a9fd8", "liger_rt": "#d8743c"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, key, label in ((axes[0], "tok_per_s", "tokens / s (k)"), (axes[1], "peak_alloc_GB", "peak memory (GB)")):
        for i, arm in enumerate(arms):
            xs, ys = [], []
            for j, p in enumerate(presets):
                hit = [r for r in rows if r["group"] == p and r["arm"] == arm]
                if hit:
                    xs.append(j + (i - 1) * 0.27)
                    ys.append(float(hit[0][key]) / (1000 if key == "tok_per_s" else 1))
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
