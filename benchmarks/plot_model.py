"""Chart of the model-step benchmark (tokens/s and peak memory per arm) for the README.

    python benchmarks/plot_model.py [benchmarks/results/model_h200_quick.csv] [docs/model_h200.png]

Needs matplotlib (the `plot` extra).
"""
import csv
import sys
from pathlib import Path


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/model_h200_quick.csv")
    dst = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/model_h200.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_model needs matplotlib: pip install 'liger-rt[plot]'")
    rows = [r for r in csv.DictReader(src.open()) if r["kind"] == "summary"]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    arms = ["baseline", "liger_kernel", "liger_rt"]
    colors = {"baseline": "#999999", "liger_kernel": "#6a9fd8", "liger_rt": "#d8743c"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, label in ((axes[0], "tok_per_s", "tokens / s (k)"), (axes[1], "peak_alloc_GB", "peak memory (GB)")):
        for i, arm in enumerate(arms):
            xs, ys = [], []
            for j, p in enumerate(presets):
                hit = [r for r in rows if r["preset"] == p and r["arm"] == arm]
                if hit:
                    xs.append(j + (i - 1) * 0.27)
                    ys.append(float(hit[0][key]) / (1000 if key == "tok_per_s" else 1))
            ax.bar(xs, ys, width=0.27, label=arm, color=colors[arm])
        ax.set_xticks(range(len(presets)), presets)
        ax.set_ylabel(label)
    axes[0].legend(frameon=False)
    fig.suptitle("One SFT step, batch 4 x 2048, bf16, one H200 (2026-12-02, quick run)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
