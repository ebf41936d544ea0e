"""`liger-tune bench` (kernels, model, logprobs, host, dispatch, ceilings; docs/cli.md, "bench"): this GPU against
eager PyTorch, torch.compile and Liger-Kernel (where installed), as a table; a CSV only with --csv PATH, and with
--data DIR one row per measurement appended to DIR/kernels.csv, models.csv or host.csv (harness.DATASET_COLUMNS).

Modules: `harness` (versions, CSV and dataset rows, ceilings, timers, the kernel-case loop), one per kernel family
(`norms`, `gated_mlp`, `losses`, `lfm2_ops`, `moe`: cases and arms), `model` (the training step), `logprobs`,
`host_overhead`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .harness import dataset_sink
from .logprobs import main as logprobs_cmd

MAX_SEQ_ARMS = ("baseline", "baseline+compile", "liger_kernel", "liger_rt", "liger_rt+ckpt",
                "baseline+ckpt", "liger_kernel+ckpt", "liger_rt+compile")    # max_seq.ARMS, without importing torch


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


def _csv(fn):
    fn = click.option("--data", "data_dir", default=None, type=click.Path(file_okay=False),
                      help="Append one row per measurement to a CSV in this folder (kernels.csv, models.csv or "
                           "host.csv), with device, versions, commit, date and a run id.")(fn)
    return click.option("--csv", "csv_path", default=None, type=click.Path(dir_okay=False),
                        help="Also write the rows (versions included) to this CSV.")(fn)


def script(args: list[str], data_dir: str | Path) -> None:
    """`liger-tune bench ARGS` with this process's arguments, for a repository script: rows appended under
    `data_dir` unless the arguments name another --data folder or say --no-data.

        script(["kernels", "--op", "norms"], Path(__file__).parent / "data")
    """
    argv = sys.argv[1:]
    if "--no-data" in argv:
        argv = [a for a in argv if a != "--no-data"]
    elif not any(a == "--data" or a.startswith("--data=") for a in argv):
        argv += ["--data", str(data_dir)]
    bench.commands[args[0]].main([*args[1:], *argv], prog_name=f"python {sys.argv[0]}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench():
    """This GPU against eager PyTorch, torch.compile and Liger-Kernel: kernels, model steps, host costs."""


bench.add_command(logprobs_cmd, "logprobs")


@bench.command()
@click.option("--op", "names", multiple=True, help="A family (norms, gated_mlp, losses, lfm2_ops, moe) or an op "
              "(rms_norm, swiglu, ...); repeatable. Default: every family.")
@click.option("--where", multiple=True, help="Only the cases whose field has one of the values: field=v[,v...], "
              "repeatable (e.g. --where tokens=512,4096).")
@click.option("--quick", is_flag=True, help="The quick cases, shorter timing, no torch.compile.")
@click.option("--no-compile", is_flag=True, help="Leave the torch.compile arm out.")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp16", "fp32"]))
@click.option("--reverse-arms", is_flag=True, help="Time each case's arms last to first (alternate it between runs); "
              "the rows say so in arm_order.")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1, 9),
              help="Measure each case this many times in one process, the arm order reversed every other round "
              "(compiles and the peers' autotuning paid once); the verdicts take each arm's median.")
@_csv
def kernels(names, where, quick, no_compile, dtype, reverse_arms, rounds, csv_path, data_dir):
    """Every arm of every case (ours, forced implementations, eager, torch.compile, Liger-Kernel)."""
    from .harness import kernel_records, run_kernels, select_specs
    _run(select_specs, list(names), list(where), quick)       # bad arguments first, GPU or not
    _need_gpu("bench kernels")
    _run(run_kernels, list(names), where=list(where), quick=quick, compile_=not no_compile, dtype=dtype,
         echo=click.echo, reverse_arms=reverse_arms, csv_path=csv_path, rounds=rounds,
         on_case=dataset_sink(data_dir, "kernels.csv", kernel_records))


@bench.command()
def ceilings():
    """Measure this GPU's copy bandwidth and bf16 matmul throughput."""
    from .harness import measure_ceilings
    _need_gpu("bench ceilings")
    c = measure_ceilings()
    click.echo(f"{c['device']}: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")


@bench.command()
@click.option("--cpu-stub", is_flag=True, help="The Python path on CPU tensors, Triton launches stubbed (no GPU).")
@_csv
def host(cpu_stub, csv_path, data_dir):
    """Host microseconds per layer of a norm call, and device against wall time (GPU)."""
    from . import host_overhead
    from .harness import write_csv
    if not cpu_stub:
        _need_gpu("bench host")
    rows = (host_overhead.cpu_stub if cpu_stub else host_overhead.host)(echo=click.echo)
    if data_dir:
        dataset_sink(data_dir, "host.csv", host_overhead.host_records)(rows)
    if csv_path:
        click.echo(f"wrote {write_csv(rows, csv_path)}")


@bench.command()
@click.option("--calls", default=200_000, show_default=True, type=click.IntRange(min=1))
@_csv
def dispatch(calls, csv_path, data_dir):
    """Per-call cost of a dispatch decision that hits the memo (CPU)."""
    from .harness import write_csv
    from .host_overhead import dispatch_overhead, host_records
    rows = dispatch_overhead(calls, echo=click.echo)
    if data_dir:
        dataset_sink(data_dir, "host.csv", host_records)(rows)
    if csv_path:
        click.echo(f"wrote {write_csv(rows, csv_path)}")


def _layer_list(ctx, param, text):
    try:
        return None if text is None else tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated layer indices, e.g. 2,5") from None


@bench.command("model")
@click.option("--model", "model", required=True,
              help="Model type (qwen3, llama, qwen3_moe, lfm2, lfm2_moe, lfm2_vl: text-only step, ...) or a preset "
                   "name (qwen3-1.7b: its model type implied).")
@click.option("--preset", default=None, help="Preset name (qwen3-1.7b, lfm2-1.2b, ...), 'tiny' for the family's tiny "
              "one, or a PATH.json.  [default: tiny, or the preset --model names]")
@click.option("--batch", default=None, type=int, help="[default: 4; --max-seq 1]")
@click.option("--seq", default=None, type=int, help="[default: 2048]")
@click.option("--shape", "shapes", multiple=True, help="BATCHxSEQ in place of --batch/--seq, repeatable or "
              "comma-separated (e.g. --shape 4x2048,1x512).")
@click.option("--steps", default=None, type=int, help="Measured steps per run [default: 20; --max-seq: steps per "
              "probe, 1].")
@click.option("--warmup", default=None, type=int, help="Warm-up steps per run, not timed [default: 5].")
@click.option("--dtype", default="bf16", show_default=True, help="Weight dtype: bf16, fp16, fp32.")
@click.option("--layers", default=None, type=int, help="Override the layer count (LFM2: later attention layers drop).")
@click.option("--attention-layers", default=None, callback=_layer_list, help="LFM2: the attention layers, e.g. 2,5.")
@click.option("--liger-kernel/--no-liger-kernel", "liger_kernel", default=True, show_default=True,
              help="Also time Liger-Kernel's own patch (where installed and supported for the model type).")
@click.option("--arms", default=None, help="Only these arms, comma-separated, baseline among them (e.g. "
              "baseline,liger_kernel; liger_rt+compile+kernels, +fuse: compiled under that LIGER_RT_COMPILE_POLICY); "
              "overrides --liger-kernel and --compile.  --max-seq: any of "
              f"{', '.join(MAX_SEQ_ARMS)} [default: the first six].")
@click.option("--compile/--no-compile", "compile", default=False, show_default=True,
              help="Also time torch.compile of the baseline and of the patched model (graph breaks, compile time).")
@click.option("--compile-mode", default="default", show_default=True, type=click.Choice(["default", "reduce-overhead"]),
              help="torch.compile mode of the compiled arms (reduce-overhead: CUDA graphs; give --warmup >= 3).")
@click.option("--compile-backend", default="inductor", show_default=True,
              help="torch.compile backend of the compiled arms (aot_eager or eager on CPU).")
@click.option("--flags", default=None, help="liger_rt.patch flags, e.g. rms_norm=1,fused_linear_cross_entropy=0 "
              "(--max-seq: over fused_linear_cross_entropy=1,rope=1).")
@click.option("--experts-implementation", default=None, help="MoE models: transformers experts implementation.")
@click.option("--config", "config_text", default=None, help="transformers config overrides, k=v[,k=v...] (JSON).")
@click.option("--lr", default=1e-4, show_default=True, type=float, help="AdamW learning rate.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--max-seq", "max_seq", is_flag=True, help="Find each arm's longest trainable sequence (batch 1) by "
              "doubling then bisecting, and its tok/s there, in place of timing steps at a shape.")
@click.option("--start", default=4096, show_default=True, type=int, help="--max-seq: the first length probed.")
@click.option("--max", "max_len", default=1 << 20, show_default=True, type=int,
              help="--max-seq: the longest length probed (reaching it without running out of memory ends the arm).")
@click.option("--granularity", default=None, type=int, help="--max-seq: bisect until the bracket is this many "
              "tokens wide [default: 1/16 of the bracket, at least 1024].")
@click.option("--limit-gib", default=None, type=float, help="--max-seq: cap the GPU memory a probe may use at this "
              "many GiB (torch.cuda.set_per_process_memory_fraction: a smaller card emulated).")
@click.option("--time-limit", default=None, type=float, help="--max-seq: seconds per arm; the search stops before a "
              "probe past it (and a probe process is stopped there) with the bracket it has.")
@click.option("--isolate/--no-isolate", default=None, help="--max-seq: each probe in a fresh process [default: on a "
              "GPU], so that a probe that ran out of memory leaves nothing behind.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of the table.")
@_csv
def model_cmd(model, preset, batch, seq, shapes, arms, flags, config_text, csv_path, data_dir, as_json, max_seq,
              start, max_len, granularity, limit_gib, time_limit, isolate, **kw):
    """Time an SFT training step: baseline vs liger_rt.patch (and Liger-Kernel, torch.compile), counterbalanced;
    with --max-seq, find each arm's longest trainable sequence."""
    from . import model as M
    from .harness import write_csv
    model_type, kw["preset"] = _run(M.resolve_model, model, preset)
    kw.update(flags=_run(M.parse_flags, flags), config=_run(M.parse_config, config_text))
    echo = lambda m: click.echo(m, err=as_json)    # noqa: E731 - progress on stderr when stdout is JSON
    if max_seq:
        return _max_seq(model_type, batch, seq, shapes, arms, csv_path, data_dir, as_json, echo, start=start,
                        max_seq=max_len, granularity=granularity, limit_gib=limit_gib, time_limit=time_limit,
                        isolate=isolate, **kw)
    arms = tuple(a.strip() for a in arms.split(",") if a.strip()) if arms else None
    shapes = _run(M.parse_shapes, shapes) or [(4 if batch is None else batch, 2048 if seq is None else seq)]
    steps, warmup = kw.pop("steps"), kw.pop("warmup")
    kw.update(arms=arms, steps=20 if steps is None else steps, warmup=5 if warmup is None else warmup)
    rows, sink = [], dataset_sink(data_dir, "models.csv", M.model_records)
    for b, sq in shapes:
        rows += (got := _run(M.run_model_bench, model_type, batch=b, seq=sq, echo=echo, **kw))
        if sink:
            sink(got)
    click.echo(json.dumps(rows, indent=1, default=str) if as_json else "\n" + M.format_summary(rows))
    if csv_path:
        click.echo(f"wrote {write_csv(rows, csv_path)}")


def _max_seq(model_type, batch, seq, shapes, arms, csv_path, data_dir, as_json, echo, *, steps, warmup, compile,
             compile_mode, **kw):
    """`bench model --max-seq`: run_max_seq with the command's options; an arm that failed exits non-zero."""
    from . import max_seq as S
    from .harness import write_csv
    if seq is not None or shapes:
        raise click.UsageError("--max-seq searches the length: leave out --seq/--shape (give --start and --max)")
    if warmup is not None:
        raise click.UsageError("--max-seq runs one short warm-up step per probe: leave out --warmup")
    if compile:
        raise click.UsageError("--max-seq names its compiled arms in --arms (baseline+compile, liger_rt+compile)")
    sink = dataset_sink(data_dir, "models.csv", S.max_seq_records)
    rows = _run(S.run_max_seq, model_type, arms=arms, batch=1 if batch is None else batch,
                steps=1 if steps is None else steps, echo=echo, on_arm=sink and (lambda row: sink([row])), **kw)
    click.echo(json.dumps(rows, indent=1, default=str) if as_json else "\n" + S.format_max_seq(rows))
    if csv_path:
        click.echo(f"wrote {write_csv(rows, csv_path)}")
    failed = [r for r in rows if r["error"]]
    if failed:
        raise click.ClickException(f"{len(failed)} arm(s) failed: "
                                   + "; ".join(f"{r['arm']}: {r['error']}" for r in failed))
