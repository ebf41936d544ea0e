"""A model step's speed and peak memory at each fused-loss chunk size (GPU; eager liger_rt arm only).

    python benchmarks/flce_chunk_step.py --target qwen3rope --chunks 512,1024,2048 [--steps 10]

Every run builds the `bench model` target fresh, patches it like the bench (fused loss, the target's flags) and
forces the fused linear cross-entropy's chunk (the dispatched config with only `chunk` replaced; 0 = all tokens at
once), then times warm-up + measured steps between synchronisations (`train_steps`, the bench's method).  The chunk
list is run forwards and then backwards (ABBA), so each chunk has two runs; the table gives both.  The question it
answers: does a larger chunk than the 160 MiB logits budget allows buy step time, and does it raise the step's peak?
"""
import argparse
import dataclasses
import gc

import torch

from liger_rt import dispatch
from liger_rt.tools.bench import model as B


def forced_chunk(chunk: int):
    """Make every fused_linear_cross_entropy decision use `chunk` (the rest of its config as decided)."""
    decide = dispatch.decide

    def patched(op, target, dtype, dims):
        d = decide(op, target, dtype, dims)
        if op.name != "fused_linear_cross_entropy" or d.impl != "triton":
            return d
        return dataclasses.replace(d, config=d.config.replace(chunk=chunk), origin="env",
                                   reason=f"chunk forced to {chunk} by flce_chunk_step.py")
    dispatch.decide = patched
    dispatch.reset()
    return lambda: (setattr(dispatch, "decide", decide), dispatch.reset())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3rope")
    ap.add_argument("--chunks", default="512,1024,2048")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    preset, flags, overrides = B.target_setup(args.target)
    batch, seq = B.TARGET_SHAPE
    chunks = [int(c) for c in args.chunks.split(",")]
    results: dict[int, list] = {c: [] for c in chunks}
    for chunk in chunks + chunks[::-1]:
        model = B.build(preset, torch.bfloat16, "cuda", 0, overrides)
        model.train()
        unpatch = B.apply_arm(model, "liger_rt", flags)
        ids = B.random_ids(model, batch, seq, 0, "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        undo = forced_chunk(chunk)
        try:
            res, _ = B.train_steps(model, opt, ids, args.warmup, args.steps, True)
        finally:
            undo()
        results[chunk].append(res)
        print(f"chunk {chunk:5d}: {res['tok_per_s']:9.0f} tok/s, {res['median_step_ms']:.2f} ms/step "
              f"(min {res['min_step_ms']:.2f}), peak {res['peak_alloc_GB']:.3f} GB, loss {res['loss_last']:.4f}",
              flush=True)
        unpatch()        # the patch's ledger holds the model: without this, each run's peak counts the last ones
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
    print(f"{args.target}, B{batch}xT{seq}, ABBA over chunks {chunks}:")
    for c, rs in results.items():
        speeds = ", ".join(f"{r['tok_per_s']:.0f}" for r in rs)
        peaks = ", ".join(f"{r['peak_alloc_GB']:.3f}" for r in rs)
        print(f"  chunk {c:5d}: tok/s {speeds}; peak GB {peaks}")


if __name__ == "__main__":
    main()
