"""What is live at a training step's memory peak, per arm (CUDA allocator history).

    python benchmarks/profile/step_memory.py [--model qwen3 --preset qwen3-1.7b] [--arms liger_rt,liger_rt+compile]
        [--flags rope=1] [--batch 4 --seq 2048] [--top 15]

Builds each arm like `liger-tune bench model` (same seed, fused AdamW), runs three warm-up steps, then records
the allocator's history over one step. Replaying its alloc/free events finds the moment of the step's peak; the
blocks live then that were allocated during the step are grouped by the innermost frame in liger_rt,
transformers or compiled code (else the innermost outside torch) and the largest groups printed, after the
memory already allocated when the step began (weights, gradients of the last step, optimizer state).
"""
import argparse
import collections
import linecache
import re

import torch

from liger_rt.tools.bench import model as B

OURS = ("liger_rt", "transformers", "torchinductor", "benchmarks")
ARMS = ("baseline", "liger_rt", "liger_kernel", "baseline+compile", "liger_rt+compile", "liger_kernel+compile")


def _where(frames) -> str:
    """The frame an allocation is charged to: the innermost in OURS, else the innermost outside torch.
    Inductor's generated files have hashed names: they are grouped by file and the line's source with the
    buffer's name taken out (its shape stays), so one buffer repeated over the layers is one group."""
    frames = frames or []
    pick = next((f for f in frames if any(k in f["filename"] for k in OURS)), None)
    pick = pick or next((f for f in frames if "/torch/" not in f["filename"]), None)
    if pick is None:   # torch's own allocation: its innermost frames name it
        inner = " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames[:3])
        return f"(torch internals) {inner}".rstrip()
    file = '/'.join(pick['filename'].split('/')[-2:])
    if "torchinductor" in pick["filename"]:
        source = re.sub(r"\bbuf\d+\b", "buf", linecache.getline(pick["filename"], pick["line"]).strip())
        return f"{file} {pick['name']}  {source[:110]}"
    return f"{file}:{pick['line']} {pick['name']}"


def peak_live_set(events: list[dict]) -> tuple[int, dict[str, int]]:
    """(bytes live at the peak, {where: bytes}) over allocator events in order: `alloc` adds a block,
    `free_completed` removes it (blocks freed but still in use by a stream count until then).
    `peak_live_set.at` is the peak's event index (where in the step it falls), `peak_live_set.blocks` the
    number of blocks per group."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    peak_live_set.at = 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames")))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
                peak_live_set.at = i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    groups: dict[str, int] = collections.Counter()
    peak_live_set.blocks = collections.Counter()
    for size, where in at_peak.values():
        groups[where] += size
        peak_live_set.blocks[where] += 1
    return peak, dict(groups)


def profile_arm(arm: str, preset, flags: dict, batch: int, seq: int, top: int) -> None:
    base, compiled = arm.removesuffix("+compile"), arm.endswith("+compile")
    model = B.build(preset, torch.bfloat16, "cuda", 0, {})
    model.train()
    undo = B.apply_arm(model, base, flags)
    step_model = torch.compile(model) if compiled else model
    ids = B.random_ids(model, batch, seq, 0, "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    step = B.step_fn(step_model, opt, ids)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    peak, groups = peak_live_set(events)
    print(f"\n== {arm}: {start / 1e9:.2f} GB allocated at the step's start, peak "
          f"{torch.cuda.max_memory_allocated() / 1e9:.2f} GB (+{peak / 1e9:.2f} GB allocated during the step and "
          f"live at its peak; peak at event {peak_live_set.at} of {len(events)})")
    for where, size in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {size / 1e9:8.3f} GB {peak_live_set.blocks[where]:4d} blocks  {where}")
    if undo is not None:
        undo()
    del model, step_model, opt
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--arms", default="liger_rt,liger_rt+compile")
    ap.add_argument("--flags", default=None, help="extra liger_rt.patch flags, e.g. rope=1")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"step_memory.py: unknown arm {bad[0]!r}; valid: {', '.join(ARMS)}")
    if not torch.cuda.is_available():
        raise SystemExit("step_memory.py needs a CUDA GPU (the allocator history is CUDA's)")
    preset = B.bench_preset(args.model, args.preset, None, None)
    flags = {"fused_linear_cross_entropy": True, **B.parse_flags(args.flags)}     # as `bench model`
    for arm in arms:
        profile_arm(arm, preset, flags, args.batch, args.seq, args.top)


if __name__ == "__main__":
    main()
