"""A model forward's host time per arm on CPU, every liger_rt Triton launch stubbed (no GPU needed).

    TRITON_INTERPRET=1 python benchmarks/profile/forward_host.py [--model lfm2 --preset lfm2-tiny --layers 16
        --attention-layers 2,5,8,10,12,14 --tokens 8] [--cprofile tottime]

Builds the preset (tiny widths: the per-call host costs do not depend on them) with the layer count changed, patches
it per arm like `liger-tune bench model` (fused loss, rope), and times forwards with labels in this thread's CPU time
(min and median of 7 means of 20) while :class:`StubbedLaunches` turns every Triton launch into a no-op and
LIGER_RT_IMPL_<OP>=triton makes dispatch take the Triton paths.  It says whether liger_rt's own Python costs more
than the eager ops it replaces; costs only a GPU pays (launches, CUDA allocations) need `step_time.py --host`.

    python benchmarks/profile/forward_host.py --device cuda --run lfm2rope [--cprofile tottime]

On a GPU: a bench_models.py run's model (bf16, B4 x T2048), launches real, no stubs; the host time of a forward is
the wall time until `model(...)` returns (the device is synchronised before each forward), the backward's until
`backward()` returns, medians of 15; cProfile splits each per function (the backward's with the autograd engine on
the calling thread, where cProfile sees it).
"""
import argparse
import importlib
import os
import pkgutil
import statistics
import time

import sys
from pathlib import Path

ON_GPU = "cuda" in sys.argv
if not ON_GPU:
    for _op in ("RMS_NORM", "SWIGLU", "ROPE"):
        os.environ.setdefault(f"LIGER_RT_IMPL_{_op}", "triton")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import liger_rt.kernels as kernels  # noqa: E402
from liger_rt.tools.bench import model as B  # noqa: E402
from liger_rt.tools.bench.host_overhead import StubbedLaunches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_models import RUNS, run_setup  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lfm2")
    ap.add_argument("--preset", default="lfm2-tiny")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--attention-layers", default="2,5,8,10,12,14")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--arms", default="baseline,liger_rt")
    ap.add_argument("--cprofile", default=None, help="also cProfile the liger_rt arm's forwards, sorted by this key")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--run", default="lfm2rope", choices=list(RUNS), help="with --device cuda: the bench_models.py run")
    args = ap.parse_args()
    if args.device == "cuda":
        return on_gpu(args)
    attn = tuple(int(a) for a in args.attention_layers.split(",")) if args.attention_layers else None
    preset = B.bench_preset(args.model, args.preset, args.layers, attn)
    mods = [importlib.import_module(f"liger_rt.kernels.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)
            if not m.name.startswith("_")]
    for arm in args.arms.split(","):
        model = B.build(preset, torch.float32, "cpu", 0, B.config_overrides(args.model))
        model.train()
        B.apply_arm(model, arm, {"fused_linear_cross_entropy": True, "rope": True})
        ids = torch.randint(0, preset.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        with StubbedLaunches(*mods):
            def forwards(n=20):
                for _ in range(n):
                    model(input_ids=ids, labels=ids)
            forwards()
            means = []
            for _ in range(7):
                t0 = time.thread_time()
                forwards()
                means.append((time.thread_time() - t0) / 20 * 1e3)
            print(f"{arm:9s} forward host {min(means):7.2f} ms (min of 7 means of 20), "
                  f"median {statistics.median(means):.2f}")
            if args.cprofile and arm == "liger_rt":
                import cProfile
                import pstats
                prof = cProfile.Profile()
                prof.runcall(forwards)
                pstats.Stats(prof).sort_stats(args.cprofile).print_stats(30)


def on_gpu(args) -> None:
    import cProfile
    import pstats
    preset, flags, overrides = run_setup(args.run)
    batch, seq = 4, 2048
    for arm in args.arms.split(","):
        model = B.build(preset, torch.bfloat16, "cuda", 0, overrides)
        model.train()
        undo = B.apply_arm(model, arm, flags)
        ids = B.random_ids(model, batch, seq, 0, "cuda")

        def host_times() -> tuple[float, float]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            return (t1 - t0) * 1e3, (t2 - t1) * 1e3
        for _ in range(3):
            host_times()
        fwd, bwd = zip(*[host_times() for _ in range(15)])
        print(f"{arm:9s} {args.run} B{batch}xT{seq}: host forward {statistics.median(fwd):7.2f} ms "
              f"(median of 15, min {min(fwd):.2f}), backward {statistics.median(bwd):7.2f} ms "
              f"(min {min(bwd):.2f}; until backward() returns)", flush=True)
        if args.cprofile:
            for phase in ("forward", "backward"):
                prof = cProfile.Profile()
                for _ in range(3):
                    torch.cuda.synchronize()
                    if phase == "forward":
                        prof.enable()
                    loss = model(input_ids=ids, labels=ids).loss
                    prof.disable()
                    if phase == "backward":     # the engine on this thread, so that cProfile sees it
                        torch.autograd.set_multithreading_enabled(False)
                        prof.enable()
                    loss.backward()
                    prof.disable()
                    torch.autograd.set_multithreading_enabled(True)
                    model.zero_grad(set_to_none=True)
                print(f"-- cProfile of 3 {arm} {phase}s (sorted by {args.cprofile})")
                pstats.Stats(prof).sort_stats(args.cprofile).print_stats(40)
        if undo:
            undo()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
