"""`liger-tune`: fill and inspect the tuning database.

Verbs: doctor, sweep, show, explain, export, import, prune, parity, bench (docs/cli.md).
Kernel modules are imported only inside verbs: on a machine without a GPU the CLI turns the
Triton interpreter on (TRITON_INTERPRET=1) before any kernel is defined, since the `cpu` arch
means "kernels through the interpreter".
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import click


def _cpu_interpreter() -> None:
    from liger_rt import backend
    if not backend.gpu_present() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"


def _parse_shape(text: str) -> dict:
    dims = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise click.BadParameter(f"{part!r}: expected k=v (e.g. rows=4096,hidden=2048)")
        k, v = part.split("=", 1)
        try:
            dims[k.strip()] = int(v)
        except ValueError:
            raise click.BadParameter(f"{part!r}: {v!r} is not an integer") from None
    return dims


def _check_arch(name: str) -> str:
    from liger_rt import backend
    name = name.lower()
    if name not in backend.ARCH_NAMES:
        raise click.BadParameter(f"unknown arch {name!r}; valid: {', '.join(backend.ARCH_NAMES)}", param_hint="--arch")
    return name


def _check_ops(ops) -> list[str]:
    from liger_rt import dispatch
    bad = [o for o in ops if o not in dispatch.OP_MODULES]
    if bad:
        raise click.BadParameter(f"unknown op {bad[0]!r}; valid ops: {', '.join(dispatch.OP_MODULES)}", param_hint="--op")
    return list(ops)


def _table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, (dict, list)):
            return json.dumps(v, separators=(",", ":"))
        return "" if v is None else str(v)
    if not rows:
        return "(none)"
    widths = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols), "  ".join("-" * widths[c] for c in cols)]
    lines += ["  ".join(fmt(r.get(c)).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


class _Group(click.Group):
    """Lists every verb with its whole one-line summary (click cuts them at 45 characters)."""

    def format_commands(self, ctx, formatter):
        rows = [(name, cmd.get_short_help_str(limit=200)) for name, cmd in sorted(self.commands.items())]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="liger-rt", prog_name="liger-tune")
def main():
    """Fill and inspect the liger_rt tuning database."""


# -- doctor ---------------------------------------------------------------------------------------

@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def doctor(as_json):
    """Arch, device, versions, DB paths and sizes, env in force."""
    _cpu_interpreter()
    info = doctor_report()
    if as_json:
        click.echo(json.dumps(info, indent=1, default=str))
        return
    a = info["arch"]
    click.echo(f"arch         {a.get('name')} ({a.get('vendor')} {a.get('capability')}, {a.get('device_name')}, "
               f"{a.get('sm_count')} SM/CU, warp {a.get('warp_size')}, <= {a.get('max_num_warps')} warps, "
               f"<= {a.get('max_num_stages')} stages, {a.get('smem_bytes')} B smem){' [forced]' if a.get('forced') else ''}")
    click.echo(f"device       {info['device']}")
    click.echo("versions     " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    db = info["db"]
    click.echo(f"user DB      {db['user_path']} ({'exists' if db['user_exists'] else 'not created yet'}, "
               f"{db['user_bytes']} B, {db['user_rows']} tuning rows)")
    if db["user_error"]:
        click.echo(f"  UNUSABLE: {db['user_error']} -> lookups use shipped defaults only")
    click.echo(f"shipped      {db['shipped_rows']} tuning rows, {db['shipped_crossovers']} crossovers ({db['shipped_files']})")
    click.echo(f"interpreter  TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")
    click.echo(f"ops          {', '.join(info['ops'])}")
    click.echo("env          " + (", ".join(f"{k}={v}" for k, v in info["env"]["set"].items()) or "(no LIGER_* set)"))
    for k, v in info["env"]["parsed"].items():
        click.echo(f"  {k:18} {v}")


def doctor_report() -> dict:
    import platform
    from importlib import metadata, resources

    import torch
    from liger_rt import __version__, backend, dispatch, env, tuning_db

    versions = {"liger_rt": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for dist in ("triton", "transformers", "sqlite-utils", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "missing"
    try:
        arch = backend.detect().to_dict()
    except Exception as exc:
        arch = {"name": "error", "error": str(exc)}
    device = "cpu"
    if backend.gpu_present():
        device = f"{torch.cuda.get_device_name()} (cuda {torch.version.cuda}, hip {getattr(torch.version, 'hip', None)})"
    path = env.tuning_db_path()
    store = tuning_db.get_store()
    user_rows = 0
    if store.user is not None:
        try:
            user_rows = store.user.db["tuning"].count
        except Exception as exc:
            store.user_error = str(exc)
    files = [p.name for p in (resources.files("liger_rt.tuning_db") / "defaults").iterdir() if p.name.endswith(".jsonl")]
    db = {"user_path": str(path), "user_exists": path.exists(), "user_bytes": path.stat().st_size if path.exists() else 0,
          "user_rows": user_rows, "user_error": store.user_error,
          "shipped_rows": store.defaults.db["tuning"].count, "shipped_crossovers": store.defaults.db["crossover"].count,
          "shipped_files": ", ".join(sorted(files)) or "none"}
    return {"arch": arch, "device": device, "versions": versions, "db": db, "env": env.snapshot(),
            "interpreter": os.environ.get("TRITON_INTERPRET", ""), "ops": dispatch.available_ops()}


# -- sweep ----------------------------------------------------------------------------------------

def build_plan(arch, ops: list[str], preset_name: str | None, shapes: list[dict] | None, quick: bool,
               dtypes: list[str]):
    """[(op, dims, dtype, tag)] for a sweep; `shapes` (for one op) replace the op's plan."""
    from liger_rt import dispatch
    from liger_rt.tools.presets import get_preset
    preset = get_preset(preset_name) if preset_name else None
    plan = []
    for name in ops:
        op = dispatch.get_op(name)
        if shapes:
            dim_list = [op.check_dims(shape) for shape in shapes]
        else:
            dim_list = [op.check_dims(d) for d in op.plan(preset, arch, quick)]
        for dims in dim_list:
            for dt in dtypes:
                for tag in op.tags:
                    plan.append((name, dims, dt, tag))
    return plan


@main.command()
@click.option("--arch", "arch_name", required=True, help="Arch to tune for (must be this machine's, unless --dry-run).")
@click.option("--op", "ops", multiple=True, help="Op to sweep (repeatable); default: every op.")
@click.option("--model", "preset", default=None, help="Model preset whose shapes to sweep (e.g. qwen3-1.7b, lfm2-8b-a1b).")
@click.option("--shape", "shapes", multiple=True,
              help="A shape instead of the plan, k=v[,k=v...] (repeatable; needs exactly one --op).")
@click.option("--dtype", "dtypes", multiple=True, default=("bf16",), show_default=True, help="fp32, bf16 or fp16 (repeatable).")
@click.option("--quick", is_flag=True, help="A short plan: fewer shapes, shorter timing.")
@click.option("--dry-run", is_flag=True, help="Print the plan for any arch and measure nothing.")
@click.option("--db", "db_path", default=None, help="DB to write (default: LIGER_RT_TUNING_DB or the user cache).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def sweep(arch_name, ops, preset, shapes, dtypes, quick, dry_run, db_path, as_json):
    """Measure implementations and configs for the plan and persist the winners."""
    from liger_rt import autotune, backend, dispatch
    from liger_rt.kernels._common import parse_dtype
    arch_name = _check_arch(arch_name)
    ops = _check_ops(ops) if ops else list(dispatch.OP_MODULES)
    if shapes and len(ops) != 1:
        raise click.UsageError("--shape needs exactly one --op")
    if arch_name == "cpu":
        _cpu_interpreter()
    for d in dtypes:
        try:
            parse_dtype(d)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--dtype")
    if not dry_run:
        real = autotune.check_arch_matches(arch_name)
    target = dispatch.target_for_arch(arch_name) if dry_run else dispatch.current_target(
        "cpu" if arch_name == "cpu" else "cuda")
    if not dry_run:
        target = dispatch.Target(arch=real, device_type=target.device_type, interpret=target.interpret)
    try:
        plan = build_plan(target.arch, ops, preset, [_parse_shape(s) for s in shapes], quick, list(dtypes))
    except ValueError as exc:
        raise click.UsageError(str(exc))
    if dry_run:
        click.echo(f"plan for {arch_name} ({len(plan)} cases; nothing measured):")
        rows = []
        for name, dims, dt, tag in plan:
            op = dispatch.get_op(name)
            dtype = parse_dtype(dt)
            avail = op.available_impls(target, dims, dtype) or ["torch"]
            n = sum(len(op.candidates(op.impl(i), target.arch, dims, dtype)) for i in avail)
            rows.append({"op": name, "dims": dims, "dtype": dt, "tag": tag, "impls": ",".join(avail), "candidates": n})
        click.echo(json.dumps(rows, indent=1) if as_json else _table(rows, ["op", "dims", "dtype", "tag", "impls", "candidates"]))
        return
    import torch
    from tqdm import tqdm

    from liger_rt.tuning_db import TuningDBError, open_store
    try:
        store = open_store(db_path)
    except TuningDBError as exc:
        raise click.ClickException(str(exc))
    click.echo(f"sweeping {len(plan)} cases on {target.arch.name} ({target.arch.device_name}) into {store.path}", err=True)
    results, summary = [], []
    bar = tqdm(plan, unit="case", file=sys.stderr, dynamic_ncols=True)
    for name, dims, dt, tag in bar:
        op = dispatch.get_op(name)
        bar.set_postfix_str(f"{name} {','.join(f'{k}={v}' for k, v in dims.items())} {dt} {tag}".strip())
        try:
            result = autotune.tune(op, target, parse_dtype(dt), dims, quick=quick, tag=tag)
        except Exception as exc:  # e.g. the case itself does not fit in memory: skip it, keep sweeping
            if target.device_type == "cuda":
                torch.cuda.empty_cache()
            click.echo(f"\nskipped {name} {dims} {dt} {tag}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                       err=True)
            summary.append({"op": name, "dims": dims, "dtype": dt, "tag": tag, "impl": "-", "config": {},
                            "ms": None, "torch_ms": None, "speedup": None, "failed": "case"})
            continue
        autotune.persist(op, result, store)
        results.append((op, dt, tag, result))
        win = result["winner"] or {}
        failed = sum(1 for m in result["measurements"] if not m["ok"])
        summary.append({"op": name, "dims": dims, "dtype": dt, "tag": tag, "impl": win.get("impl", "-"),
                        "config": win.get("config", {}), "ms": win.get("median_ms"), "torch_ms": result["baseline_ms"],
                        "speedup": (result["baseline_ms"] / win["median_ms"]) if win and result["baseline_ms"] else None,
                        "failed": failed})
    crossovers = derive_sweep_crossovers(results, store)
    store.close()
    if as_json:
        click.echo(json.dumps({"results": summary, "crossovers": crossovers}, indent=1, default=str))
        return
    click.echo(_table(summary, ["op", "dims", "dtype", "tag", "impl", "config", "ms", "torch_ms", "speedup", "failed"]))
    for c in crossovers:
        click.echo(f"crossover {c['op']} {c['dtype']} {c['static_key']}: {c['segments']}")


def derive_sweep_crossovers(results, store, margin: float = 0.05) -> list[dict]:
    """One crossover row per (op, dtype, static dims) from this sweep's measurements."""
    from liger_rt import dispatch
    groups = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    ops = {}
    for op, dt, tag, result in results:
        if op.crossover_axis is None:
            continue
        ops[op.name] = op
        key = (op.name, dt, op.static_key(result["dims"]))
        axis = float(op.crossover_axis(result["dims"]))
        for impl, rec in result["best"].items():
            groups[key][axis][impl].append(rec["median_ms"])
    out = []
    for (name, dt, static_key), by_axis in groups.items():
        op = ops[name]
        points = [(axis, {i: sum(v) / len(v) for i, v in impls.items()}) for axis, impls in by_axis.items()]
        if len(points) < 1:
            continue
        segments = dispatch.derive_crossover(points, margin=margin)
        row = dict(op=name, variant=op.variant, arch=results[0][3]["arch"], dtype=dt, static_key=static_key,
                   axis_name=op.crossover_axis_name, segments=segments, margin=margin, origin="sweep",
                   source_hash=op.source_hash)
        store.put_crossover(row)
        out.append(row)
    return out


# -- show / explain -------------------------------------------------------------------------------

def _fresh_flag(row: dict) -> str:
    from liger_rt import dispatch
    from liger_rt.tuning_db.store import _fresh
    try:
        return "yes" if _fresh(row, dispatch.get_op(row["op"])) else "STALE"
    except Exception:
        return "?"


@main.command()
@click.option("--op", default=None, help="Only this op.")
@click.option("--arch", "arch_name", default=None, help="Only this arch.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show(op, arch_name, as_json):
    """List tuning entries and crossovers (user DB over shipped defaults)."""
    _cpu_interpreter()
    from liger_rt import tuning_db
    if op:
        _check_ops([op])
    if arch_name:
        arch_name = _check_arch(arch_name)
    conds, args = [], []
    if op:
        conds.append("op = ?"); args.append(op)  # noqa: E702
    if arch_name:
        conds.append("arch = ?"); args.append(arch_name)  # noqa: E702
    where = " AND ".join(conds) or None
    store = tuning_db.get_store()
    tuning, cross = [], []
    for layer in store.layers():
        for r in layer.all_rows("tuning", where, args):
            r.pop("rowid", None)
            r["layer"] = layer.layer
            r["fresh"] = _fresh_flag(r)
            r["config"] = json.loads(r["config"] or "{}")
            tuning.append(r)
        for r in layer.all_rows("crossover", where, args):
            r["layer"] = layer.layer
            r["segments"] = json.loads(r["segments"])
            cross.append(r)
    if as_json:
        click.echo(json.dumps({"tuning": tuning, "crossover": cross, "user_error": store.user_error}, indent=1))
        return
    if store.user_error:
        click.echo(f"warning: user DB unusable ({store.user_error}); showing shipped defaults", err=True)
    tuning.sort(key=lambda r: (r["op"], r["arch"], r["dtype"], r["static_key"], r["bucket"], r["median_ms"] or 0))
    click.echo(_table(tuning, ["layer", "op", "arch", "dtype", "static_key", "bucket", "impl", "config", "median_ms",
                               "baseline_ms", "origin", "fresh"]))
    if cross:
        click.echo("\ncrossovers:")
        click.echo(_table(cross, ["layer", "op", "arch", "dtype", "static_key", "axis_name", "segments", "margin", "origin"]))


@main.command()
@click.argument("op")
@click.option("--shape", required=True, help="k=v[,k=v...], e.g. rows=4096,hidden=2048.")
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--arch", "arch_name", default=None, help="Arch to explain for (default: this machine).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def explain(op, shape, dtype, arch_name, as_json):
    """Which implementation and config the dispatcher picks for a shape, and why."""
    _cpu_interpreter()
    from liger_rt import dispatch
    _check_ops([op])
    if arch_name:
        arch_name = _check_arch(arch_name)
    try:
        d = dispatch.select(op, dtype=dtype, arch=arch_name, **_parse_shape(shape))
    except ValueError as exc:
        raise click.UsageError(str(exc))
    if as_json:
        click.echo(json.dumps(d.to_dict(), indent=1))
        return
    click.echo(f"{d.op} on {d.arch}, {d.dtype}, {', '.join(f'{k}={v}' for k, v in d.dims.items())}")
    click.echo(f"  impl    {d.impl}")
    click.echo(f"  config  {json.dumps(dict(d.config))}")
    click.echo(f"  origin  {d.origin}")
    click.echo(f"  why     {d.reason}")


# -- export / import / prune ----------------------------------------------------------------------

@main.command(name="export")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--arch", "arch_name", default=None, help="Only this arch.")
@click.option("--db", "db_path", default=None, help="DB to read (default: LIGER_RT_TUNING_DB or the user cache).")
def export_cmd(file, arch_name, db_path):
    """Write the user DB as JSON lines (mergeable text); '-' for stdout."""
    from liger_rt.tuning_db import TuningDBError, open_store
    from liger_rt.tuning_db.store import dump_jsonl
    if arch_name:
        arch_name = _check_arch(arch_name)
    try:
        store = open_store(db_path)
    except TuningDBError as exc:
        raise click.ClickException(str(exc))
    lines = list(dump_jsonl(store, arch_name))
    text = "".join(line + "\n" for line in lines)
    if file == "-":
        click.echo(text, nl=False)
    else:
        with open(file, "w") as fh:
            fh.write(text)
        click.echo(f"wrote {len(lines)} records to {file}", err=True)


@main.command(name="import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option("--db", "db_path", default=None, help="DB to write (default: LIGER_RT_TUNING_DB or the user cache).")
def import_cmd(file, db_path):
    """Merge an export into the user DB, keeping the faster entry."""
    from liger_rt.tuning_db import TuningDBError, open_store
    from liger_rt.tuning_db.store import load_jsonl
    try:
        store = open_store(db_path)
        text = sys.stdin.read() if file == "-" else open(file).read()
        counts = load_jsonl(store, text.splitlines())
    except TuningDBError as exc:
        raise click.ClickException(str(exc))
    click.echo(f"merged {counts['tuning']} tuning, {counts['crossover']} crossover, "
               f"{counts['measurements']} measurement records into {store.path}")


@main.command()
@click.option("--stale", is_flag=True, help="Entries measured on other kernel code or config schema.")
@click.option("--op", default=None, help="Every entry of this op.")
@click.option("--arch", "arch_name", default=None, help="Every entry of this arch.")
@click.option("--dry-run", is_flag=True, help="List what would be removed, remove nothing.")
@click.option("--db", "db_path", default=None, help="DB to prune (default: LIGER_RT_TUNING_DB or the user cache).")
def prune(stale, op, arch_name, dry_run, db_path):
    """Remove stale entries (--stale) or every entry of an op/arch from the user DB."""
    _cpu_interpreter()
    from liger_rt import dispatch
    from liger_rt.tuning_db import TuningDBError, open_store
    from liger_rt.tuning_db.store import CROSSOVER_PK, TUNING_PK, _fresh
    if not (stale or op or arch_name):
        raise click.UsageError("say what to prune: --stale, --op OP and/or --arch ARCH")
    if op:
        _check_ops([op])
    if arch_name:
        arch_name = _check_arch(arch_name)
    try:
        store = open_store(db_path)
    except TuningDBError as exc:
        raise click.ClickException(str(exc))

    def selected(row, check_schema=True):
        if op and row["op"] != op:
            return False
        if arch_name and row["arch"] != arch_name:
            return False
        if stale:
            the_op = dispatch.get_op(row["op"]) if row["op"] in dispatch.OP_MODULES else None
            if the_op is None:
                return True
            if not check_schema:
                return row.get("source_hash", "") not in ("", the_op.source_hash)
            return not _fresh(row, the_op)
        return True

    tuning = [r for r in store.all_rows("tuning") if selected(r)]
    cross = [r for r in store.all_rows("crossover") if selected(r, check_schema=False)]
    for r in tuning:
        click.echo(f"tuning     {r['op']} {r['arch']} {r['dtype']} {r['static_key']} {r['bucket']} {r['impl']} "
                   f"(hash {r['source_hash'] or '-'}, schema {r['config_schema']})")
    for r in cross:
        click.echo(f"crossover  {r['op']} {r['arch']} {r['dtype']} {r['static_key']} (hash {r['source_hash'] or '-'})")
    if dry_run:
        click.echo(f"{len(tuning)} tuning and {len(cross)} crossover entries would be removed (dry run)")
        return
    n = store.delete("tuning", tuning, TUNING_PK) + store.delete("crossover", cross, CROSSOVER_PK)
    meas = [r for r in store.all_rows("measurements") if selected(r, check_schema=False)]
    if meas:
        store.db.execute(f"DELETE FROM measurements WHERE rowid IN ({','.join(str(r['rowid']) for r in meas)})")
    click.echo(f"removed {n} entries and {len(meas)} raw measurements from {store.path}")


def _add_optional_commands() -> None:
    # parity and bench import the patchers, hence the kernel modules: the interpreter switch must
    # be in place before any @triton.jit runs (it is read when a kernel is decorated)
    _cpu_interpreter()
    try:
        from liger_rt.tools.parity import parity
        main.add_command(parity)
    except ImportError:
        pass
    try:
        from liger_rt.tools.bench import bench
        main.add_command(bench)
    except ImportError:
        pass


_add_optional_commands()

if __name__ == "__main__":
    main()
