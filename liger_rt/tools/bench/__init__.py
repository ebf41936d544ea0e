"""`liger-tune bench` (kernels, model, host, dispatch, ceilings; docs/cli.md, "bench"): kernel benchmarks against the
measured ceilings, model training steps, host costs.

Modules: `harness` (versions, CSV, ceilings, timers, the kernel-case loop), one per kernel family (`norms`,
`lfm2_ops`, `losses`, `moe_experts`: cases and arms), `model` (the training step), `host_overhead`, `logprobs`.
CSVs go to --out (default benchmarks/results), named <bench>_<device>[_quick].csv.
"""
from __future__ import annotations

import json

import click


def _run(fn, *args, **kw):
    """Library errors as one line: ValueError as a usage error, RuntimeError as an error."""
    try:
        return fn(*args, **kw)
    except ValueError as exc:
        raise click.UsageError(str(exc))
    except RuntimeError as exc:
        raise click.ClickException(str(exc))


def _need_gpu(what: str) -> None:
    import torch

    from .harness import no_gpu_message
    if not torch.cuda.is_available():
        raise click.ClickException(no_gpu_message(what))


_OUT = click.option("--out", "out_dir", default="benchmarks/results", show_default=True,
                    type=click.Path(file_okay=False), help="Folder for the CSVs.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench():
    """Kernel, model and host-overhead benchmarks; CSV out with versions and timing method."""


@bench.command()
@click.option("--op", "names", multiple=True, help="A family (norms, lfm2_ops, losses, moe_experts) or an op "
              "(rms_norm, swiglu, ...); repeatable. Default: every family.")
@click.option("--where", multiple=True, help="Only the cases whose field has one of the values: field=v[,v...], "
              "repeatable (e.g. --where tokens=512,4096). A narrowed run replaces only its own cases in the CSV.")
@click.option("--quick", is_flag=True, help="The quick cases, shorter timing, no torch.compile.")
@click.option("--no-compile", is_flag=True, help="Leave the torch.compile arm out.")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp16", "fp32"]))
@click.option("--reverse-arms", is_flag=True, help="Time each case's arms last to first (alternate it between runs); "
              "the rows say so in arm_order.")
@_OUT
def kernels(names, where, quick, no_compile, dtype, reverse_arms, out_dir):
    """Every arm of every case (ours, forced implementations, eager, torch.compile, Liger-Kernel)."""
    from .harness import run_kernels, select_specs
    _run(select_specs, list(names), list(where), quick)       # bad arguments first, GPU or not
    _need_gpu("bench kernels")
    _run(run_kernels, list(names), where=list(where), quick=quick, compile_=not no_compile, dtype=dtype,
         out_dir=out_dir, echo=lambda s: click.echo(s), reverse_arms=reverse_arms)


@bench.command()
def ceilings():
    """Measure this GPU's copy bandwidth and bf16 matmul throughput."""
    from .harness import measure_ceilings
    _need_gpu("bench ceilings")
    c = measure_ceilings()
    click.echo(f"{c['device']}: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")


@bench.command()
@click.option("--cpu-stub", is_flag=True, help="The Python path on CPU tensors, Triton launches stubbed (no GPU): "
              "host_overhead_cpu_stub.csv.")
@_OUT
def host(cpu_stub, out_dir):
    """Host microseconds per layer of a norm call, and device against wall time (GPU)."""
    from . import host_overhead
    from .harness import device_tag, write_csv
    if not cpu_stub:
        _need_gpu("bench host")
    probe, tag = (host_overhead.cpu_stub, "cpu_stub") if cpu_stub else (host_overhead.host, device_tag())
    click.echo(f"wrote {write_csv(probe(echo=click.echo), f'{out_dir}/host_overhead_{tag}.csv')}")


@bench.command()
@click.option("--calls", default=200_000, show_default=True, type=click.IntRange(min=1))
@_OUT
def dispatch(calls, out_dir):
    """Per-call cost of a dispatch decision that hits the memo (CPU)."""
    from .harness import write_csv
    from .host_overhead import dispatch_overhead
    click.echo(f"wrote {write_csv(dispatch_overhead(calls, echo=click.echo), f'{out_dir}/dispatch_overhead.csv')}")


def _layer_list(ctx, param, text):
    try:
        return None if text is None else tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated layer indices, e.g. 2,5") from None


@bench.command("model")
@click.option("--model", "model_type", default=None,
              help="Model type: qwen3, llama, qwen3_moe, lfm2, lfm2_moe, lfm2_vl (lfm2_vl: text-only step).")
@click.option("--target", "targets", multiple=True, help="Issue 9's runs instead of --model (GPU), repeatable or "
              "comma-separated: qwen3, lfm2, qwen3rope, lfm2rope, lfm2moe, lfm2moerope or all.")
@click.option("--preset", default="tiny", show_default=True,
              help="Preset name (qwen3-1.7b, lfm2-1.2b, ...), 'tiny' for the family's tiny one, or a PATH.json.")
@click.option("--batch", default=4, show_default=True, type=int)
@click.option("--seq", default=2048, show_default=True, type=int)
@click.option("--shape", "shapes", multiple=True, help="BATCHxSEQ in place of --batch/--seq, repeatable or "
              "comma-separated (e.g. --shape 4x2048,1x512).")
@click.option("--steps", default=None, type=int, help="Measured steps per run [default: 20; --quick 8].")
@click.option("--warmup", default=None, type=int, help="Warm-up steps per run, not timed [default: 5; --quick 3].")
@click.option("--quick", is_flag=True, help="--target runs: 8 measured steps after 3 warm-up steps.")
@click.option("--dtype", default="bf16", show_default=True, help="Weight dtype: bf16, fp16, fp32.")
@click.option("--layers", default=None, type=int, help="Override the layer count (LFM2: later attention layers drop).")
@click.option("--attention-layers", default=None, callback=_layer_list, help="LFM2: the attention layers, e.g. 2,5.")
@click.option("--liger-kernel/--no-liger-kernel", "liger_kernel", default=True, show_default=True,
              help="Also time Liger-Kernel's own patch (where installed and supported for the model type).")
@click.option("--arms", default=None, help="Only these arms, comma-separated, baseline among them (e.g. "
              "baseline,liger_kernel; liger_rt+compile+kernels, +fuse: compiled under that LIGER_RT_COMPILE_POLICY); "
              "overrides --liger-kernel and --compile.")
@click.option("--compile/--no-compile", "compile", default=False, show_default=True,
              help="Also time torch.compile of the baseline and of the patched model (graph breaks, compile time).")
@click.option("--compile-mode", default="default", show_default=True, type=click.Choice(["default", "reduce-overhead"]),
              help="torch.compile mode of the compiled arms (reduce-overhead: CUDA graphs; give --warmup >= 3).")
@click.option("--compile-backend", default="inductor", show_default=True,
              help="torch.compile backend of the compiled arms (aot_eager or eager on CPU).")
@click.option("--flags", default=None, help="liger_rt.patch flags, e.g. rms_norm=1,fused_linear_cross_entropy=0.")
@click.option("--experts-implementation", default=None, help="MoE models: transformers experts implementation.")
@click.option("--config", "config_text", default=None, help="transformers config overrides, k=v[,k=v...] (JSON).")
@click.option("--lr", default=1e-4, show_default=True, type=float, help="AdamW learning rate.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--csv", "csv_path", default=None, type=click.Path(dir_okay=False),
              help="Write the rows to this CSV (--target: in place of model_<device>[_quick].csv).")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of the table.")
@_OUT
def model_cmd(model_type, targets, batch, seq, shapes, steps, warmup, quick, arms, flags, config_text, csv_path,
              as_json, out_dir, **kw):
    """Time an SFT training step: baseline vs liger_rt.patch (and Liger-Kernel, torch.compile), counterbalanced."""
    from . import model as M
    from .harness import write_csv
    if bool(model_type) == bool(targets):
        raise click.UsageError("give --model TYPE or --target NAME (one of them)")
    arms = tuple(a.strip() for a in arms.split(",") if a.strip()) if arms else None
    shapes = _run(M.parse_shapes, shapes) or [(batch, seq)]
    compile_kw = {k: kw.pop(k) for k in ("compile", "compile_backend", "compile_mode")}
    if compile_kw["compile"] or arms:      # a bad arm, backend or warm-up: a usage error before any GPU check or build
        _run(M.resolve_arms, arms, False, warmup=3 if warmup is None else warmup, **compile_kw)
    if targets:
        targets = [t.strip() for text in targets for t in text.split(",") if t.strip()]
        names = list(M.TARGETS) if "all" in targets else list(dict.fromkeys(targets))
        bad = [t for t in names if t not in M.TARGETS]
        if bad:
            raise click.BadParameter(f"unknown target {bad[0]!r}; valid: {', '.join(M.TARGETS)}, all",
                                     param_hint="--target")
        _need_gpu("bench model --target")
        failed = M.run_targets(names, out_dir=out_dir, quick=quick, steps=steps, warmup=warmup, shapes=shapes,
                               liger_kernel=kw["liger_kernel"], csv_path=csv_path, echo=click.echo, arms=arms,
                               **compile_kw)
        if failed:
            raise click.ClickException(f"failed: {', '.join(failed)} (errors above)")
        return
    kw.update(flags=_run(M.parse_flags, flags), config=_run(M.parse_config, config_text), arms=arms, **compile_kw)
    rows = []
    for b, sq in shapes:
        rows += _run(M.run_model_bench, model_type, batch=b, seq=sq, steps=steps or 20,
                     warmup=5 if warmup is None else warmup, echo=lambda m: click.echo(m, err=as_json), **kw)
    click.echo(json.dumps(rows, indent=1, default=str) if as_json else "\n" + M.format_summary(rows))
    if csv_path:
        click.echo(f"wrote {write_csv(rows, csv_path)}")
