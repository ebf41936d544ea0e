"""`liger-tune`: fill and inspect the tuning database (docs/cli.md).

Kernel modules are imported only inside verbs: without a GPU the CLI turns the Triton interpreter
on (the `cpu` arch) before any kernel is defined.  Every failure is one line on stderr and a
non-zero exit (`--debug`: the traceback); `--json` output is JSON alone on stdout.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys
import warnings

import click


def _parse_shape(text: str) -> dict:
    dims = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise click.BadParameter(f"{part!r}: expected k=v (e.g. rows=4096,hidden=2048)", param_hint="--shape")
        k, v = part.split("=", 1)
        try:
            dims[k.strip()] = int(v)
        except ValueError:
            raise click.BadParameter(f"{part!r}: {v!r} is not an integer", param_hint="--shape") from None
        if dims[k.strip()] < 1:
            raise click.BadParameter(f"{part!r}: dims are positive integers", param_hint="--shape")
    return dims


def _check_arch(ctx, param, name: str | None) -> str | None:
    from liger_rt import backend
    name = name and name.lower()
    if name and name not in backend.ARCH_NAMES:
        raise click.BadParameter(f"unknown arch {name!r}; valid: {', '.join(backend.ARCH_NAMES)}", param_hint="--arch")
    return name


def _device_option(verb: str):
    return click.option("--device", "device_name", default=None,
                        help=f"Device to {verb} for: a class or a device name (h100, h200, gh200, 'NVIDIA H100 80GB "
                             "HBM3'); its arch is implied for known devices.")


def _check_ops(ctx, param, ops):
    from liger_rt.registry import REGISTRY
    bad = [o for o in ([ops] if isinstance(ops, str) else ops or ()) if o not in REGISTRY.names()]
    if bad:
        raise click.BadParameter(f"unknown op {bad[0]!r}; valid ops: {', '.join(REGISTRY.names())}",
                                 param_hint="--op")
    return ops


def _table(rows: list[dict], cols: list[str]) -> str:
    from liger_rt.tools.bench.harness import format_table
    return format_table(rows, cols, none="", empty="(none)")


def _one_line(text) -> str:
    """`text` on one line, control characters escaped (it may quote a DB row or a path)."""
    from liger_rt.tuning_db.rows import printable
    return printable(" ".join(str(text).split()))


def _echo(text: str = "", **kw) -> None:
    """One line of a DB-reading verb's text output, control characters escaped (DB text is not trusted)."""
    from liger_rt.tuning_db.rows import printable
    click.echo(printable(text), **kw)


def _printable_rows(rows: list[dict]) -> list[dict]:
    """Rows for _table: string cells escaped (lists and dicts are printed as JSON, which escapes them)."""
    from liger_rt.tuning_db.rows import printable
    return [{k: printable(v) if isinstance(v, str) else v for k, v in r.items()} for r in rows]


class _Group(click.Group):
    """Lists every verb with its whole one-line summary (click cuts them at 45 characters), and
    turns every failure into one line on stderr with a non-zero exit (--debug: the traceback)."""

    def format_commands(self, ctx, formatter):
        rows = [(name, cmd.get_short_help_str(limit=200)) for name, cmd in sorted(self.commands.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in args
        args = [a for a in args if a != "--debug"]
        shown = warnings.showwarning
        warnings.showwarning = lambda message, *rest, **kw: click.echo(f"warning: {_one_line(message)}", err=True)
        try:
            code = super().main(args, prog_name=prog_name or "liger-tune", complete_var=complete_var,
                                standalone_mode=False, **extra)
        except click.ClickException as exc:
            verbs = f"; verbs: {', '.join(sorted(self.commands))}" if isinstance(exc, click.NoSuchCommand) else ""
            click.echo(f"liger-tune: error: {_one_line(exc.format_message())}{verbs}", err=True)
            code = exc.exit_code
        except click.Abort:
            click.echo("liger-tune: aborted", err=True)
            code = 1
        except Exception as exc:
            if debug:
                raise
            from liger_rt import autotune
            from liger_rt.tuning_db import TuningDBError
            # errors that carry a message for the user (EnvError and RowError are ValueErrors)
            known = isinstance(exc, (TuningDBError, autotune.ArchMismatchError, autotune.ShardedSweepError,
                                     ValueError, OSError))
            what = _one_line(str(exc)) if known and str(exc) else f"{type(exc).__name__}: {_one_line(exc)}"
            hint = "" if known else " (an internal error: `liger-tune --debug ...` shows the traceback)"
            click.echo(f"liger-tune: error: {what}{hint}", err=True)
            code = 1
        finally:
            warnings.showwarning = shown
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="liger-rt", prog_name="liger-tune")
@click.option("--debug", is_flag=True, help="Show the traceback of a failure (also accepted after the verb).")
def main(debug):
    """Fill and inspect the liger_rt tuning database."""


def _open_user(db_path: str | None, *, readonly: bool, must_exist: bool = True, create: bool = True):
    """The user DB (--db, else LIGER_RT_TUNING_DB): read-only for reading verbs (a missing file is
    None unless must_exist), writable (created if missing) for writing ones.  A path that cannot hold a
    DB (a directory, a pipe or device, too long, under a file) is a TuningDBError."""
    from pathlib import Path

    from liger_rt import env
    from liger_rt.tuning_db import Store, TuningDBError
    from liger_rt.tuning_db.store import path_problem
    if db_path is not None and not db_path.strip():
        raise TuningDBError("--db is empty; give the tuning DB's path (or leave --db out for LIGER_RT_TUNING_DB)")
    path = Path(db_path).expanduser() if db_path else env.tuning_db_path()
    if why := path_problem(path):
        raise TuningDBError(why)
    if readonly and not path.exists():
        if must_exist:
            raise TuningDBError(f"no tuning DB at {path}")
        return None
    return Store(path, layer="user", readonly=readonly, create=create)


@main.command()
@click.option("--model", "preset", default="qwen3-1.7b", show_default=True,
              help="Model preset whose shapes the coverage line counts (rows of this device for each).")
@click.option("--arch", "arch_name", default=None, callback=_check_arch,
              help="Count the coverage for this arch's profile (default: this machine, or --device's).")
@_device_option("count the coverage")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def doctor(preset, arch_name, device_name, as_json):
    """Arch, device, versions, DB paths, sizes and row health (ok/stale/bad), a model's coverage, env in force."""
    target = None if arch_name is None and device_name is None else _device_target(arch_name, device_name).arch
    info = doctor_report(preset, target)
    if as_json:
        click.echo(json.dumps(info, indent=1, default=str))
        return
    a = info["arch"]
    if "error" in a:
        _echo(f"arch         error: {a['error']}")
    else:
        _echo(f"arch         {a.get('name')} ({a.get('vendor')} {a.get('capability')}, {a.get('device_name')}, "
              f"{a.get('sm_count')} SM/CU, warp {a.get('warp_size')}, <= {a.get('max_num_warps')} warps, "
              f"<= {a.get('max_num_stages')} stages, {a.get('smem_bytes')} B smem)"
              f"{' [forced]' if a.get('forced') else ''}")
    _echo(f"device       {info['device']} (rows keyed as {info['device_class'] or '-'})")
    _echo("versions     " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    t = info["triton"]
    _echo(f"triton       {'imports: the Triton kernels can run' if t['available'] else 'kernels OFF: ' + t['reason']}")
    db = info["db"]
    _echo(f"user DB      {db['user_path']} ({'exists' if db['user_exists'] else 'not created yet'}, "
          f"{db['user_bytes']} B, schema {db['user_schema'] or '-'})")
    if db["user_error"]:
        _echo(f"  UNUSABLE: {db['user_error']} -> lookups use the shipped defaults only; nothing touches the file")
    for layer in ("user", "shipped"):
        for table, c in (db[f"{layer}_health"] or {}).items():
            _echo(f"  {layer:8} {table:13} {c['ok']} ok, {c['stale']} stale, {c['bad']} bad")
        for line in db[f"{layer}_bad"]:
            _echo(f"    bad: {line}")
    _echo(f"shipped      {db['shipped_files']}")
    _echo(f"coverage     {_coverage_line(info['coverage'])}")
    _echo(f"interpreter  TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")
    _echo(f"ops          {', '.join(info['ops'])}")
    _echo("env          " + (", ".join(f"{k}={v}" for k, v in info["env"]["set"].items()) or "(no LIGER_* set)"))
    for k, v in info["env"]["parsed"].items():
        _echo(f"  {k:18} {v}")
    for k, hint in info["env"]["unknown"].items():
        _echo(f"  UNKNOWN {k} (ignored; {hint})")


def _coverage_line(c: dict) -> str:
    if "error" in c:
        return f"{c['model']}: {c['error']}"
    have = (f"{c['covered']} of {c['shapes']} {c['model']} shapes ({c['dtype']}) have rows for "
            f"{c['device'] or 'this device'}")
    if c["covered"] == c["shapes"]:
        return have
    if c["command"] is None:
        return f"{have}; {c['note']}"
    return f"{have}; the rest: {c['command']}" + (f" ({c['note']})" if c["note"] else "")


def _coverage(preset_name: str, arch) -> dict:
    """How many of the shapes a sweep of `preset_name` measures (per op: static dims and bucket, bf16) have a
    row of this device, code and software, and the command that measures them (None where no sweep can: an
    unknown GPU, whose generic profile has no sweep); `note` says where it must run when LIGER_RT_ARCH names
    another arch than the hardware's."""
    import warnings as _warnings

    from liger_rt import backend, tuning_db
    from liger_rt.registry import REGISTRY
    from liger_rt.tools.presets import get_preset
    device = backend.device_class(arch.device_name)
    out = {"model": preset_name, "device": device, "dtype": "bf16",
           "command": f"liger-tune sweep --arch {arch.name} --model {preset_name}", "note": ""}
    if arch.name not in backend.ARCH_NAMES:
        out.update(command=None, note=f"an unknown GPU runs the {arch.name} heuristics and has no sweep "
                                      f"(profiled arches: {', '.join(backend.ARCH_NAMES)})")
    elif (hw := backend.detect_hardware().name) != arch.name:
        out["note"] = f"it measures on {arch.name} hardware only; this machine is {hw}"
    try:
        preset = get_preset(preset_name)
    except ValueError as exc:
        return {**out, "error": str(exc)}
    shapes = {}
    for name in REGISTRY.names():
        try:
            op = REGISTRY.get(name)
            for dims in op.plan(preset, arch, False):
                dims = op.check_dims(dims)
                shapes[op.name, op.static_key(dims), op.bucket_key(dims)] = (op, dims)
        except Exception:        # an op that cannot load is reported under "ops"
            continue
    try:
        with _warnings.catch_warnings():      # bad rows and an unusable user DB: reported on their own lines
            _warnings.simplefilter("ignore")
            store = tuning_db.get_store()
            covered = sum(store.covered(op, arch, "bf16", dims) for op, dims in shapes.values())
    except Exception as exc:                  # a bad LIGER_* value: the env lines show it
        return {**out, "error": f"cannot read the tuning DB ({_one_line(exc)})"}
    return {**out, "covered": covered, "shapes": len(shapes)}


def _health(store) -> tuple[dict, list[str]]:
    """Per table the count of ok / stale / bad rows (store.classify), and the first five bad ones."""
    from liger_rt.tuning_db.store import classify, row_name
    counts, bad = {}, []
    for table in ("tuning", "crossover", "measurements"):
        c = counts[table] = {"ok": 0, "stale": 0, "bad": 0}
        for row in store.select(table):
            status, why = classify(table, row)
            c[status] += 1
            if status == "bad" and len(bad) < 5:
                bad.append(f"{table} {row_name(row)}: {why}")
    return counts, bad


def doctor_report(preset: str = "qwen3-1.7b", coverage_arch=None) -> dict:
    """What `liger-tune doctor` prints; the coverage line counts rows for `coverage_arch` (an arch profile, its
    device_name naming the device) where given, else for this machine."""
    import platform
    from importlib import metadata, resources

    import torch
    from liger_rt import __version__, _triton, backend, env, tuning_db
    from liger_rt.registry import REGISTRY
    from liger_rt.tuning_db import Store, TuningDBError
    from liger_rt.tuning_db.store import path_problem

    versions = {"liger_rt": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for dist in ("triton", "transformers", "sqlite-utils", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "missing"
    versions["runtime"] = backend.runtime_version() or "cpu build"
    try:
        detected = backend.detect()
        arch, device_class = detected.to_dict(), backend.device_class(detected.device_name)
    except Exception as exc:
        detected, arch, device_class = None, {"name": "error", "error": str(exc)}, ""
    device = f"{torch.cuda.get_device_name()} ({backend.runtime_version()})" if backend.gpu_present() else "cpu"
    ops = []
    for name in REGISTRY.names():        # a kernel module that fails to import is reported, not fatal
        try:
            REGISTRY.get(name)
            ops.append(name)
        except Exception as exc:
            ops.append(f"{name} (cannot be loaded: {type(exc).__name__}: {_one_line(exc)})")
    db = {"user_path": None, "user_exists": False, "user_bytes": 0, "user_schema": None, "user_error": None,
          "user_health": None, "user_bad": []}
    try:
        path = env._tuning_db_path()
        db["user_path"] = str(path)
        if why := path_problem(path):
            db["user_error"] = why
        elif path.exists():
            db.update(user_exists=True, user_bytes=path.stat().st_size)
    except env.EnvError as exc:
        db["user_error"] = str(exc)
    if db["user_exists"]:
        try:
            timeout = env._timeout()
        except env.EnvError:
            timeout = 10.0
        try:
            with Store(path, layer="user", readonly=True, timeout=timeout) as store:
                db["user_schema"] = store.schema
                db["user_health"], db["user_bad"] = _health(store)
        except Exception as exc:     # beyond TuningDBError and OSError, e.g. locked while reading rows
            db["user_error"] = str(exc) if isinstance(exc, (TuningDBError, OSError)) else f"{type(exc).__name__}: {exc}"
    db["shipped_health"], db["shipped_bad"] = _health(tuning_db.store.shipped_defaults())
    files = (resources.files("liger_rt.tuning_db") / "defaults").iterdir()
    db["shipped_files"] = ", ".join(sorted(p.name for p in files if p.name.endswith(".jsonl"))) or "none"
    counted = coverage_arch or detected
    coverage = _coverage(preset, counted) if counted else {"model": preset, "error": "no arch detected"}
    triton = {"available": _triton.available(), "reason": _triton.reason()}
    return {"arch": arch, "device": device, "device_class": device_class, "versions": versions, "triton": triton,
            "db": db, "coverage": coverage, "env": env.snapshot(), "interpreter": os.environ.get("TRITON_INTERPRET", ""),
            "ops": ops}


@main.command()
@click.option("--arch", "arch_name", required=True, callback=_check_arch,
              help="Arch to tune for (must be this machine's, unless --dry-run).")
@click.option("--op", "ops", multiple=True, callback=_check_ops, help="Op to sweep (repeatable); default: every op.")
@click.option("--model", "preset", default=None,
              help="Model preset whose shapes to sweep (e.g. qwen3-1.7b, lfm2-8b-a1b).")
@click.option("--shape", "shapes", multiple=True,
              help="A shape instead of the plan, k=v[,k=v...] (repeatable; needs exactly one --op).")
@click.option("--dtype", "dtypes", multiple=True, default=("bf16",), show_default=True,
              help="fp32, bf16 or fp16 (repeatable).")
@click.option("--quick", is_flag=True, help="A short plan: fewer shapes, shorter timing.")
@click.option("--dry-run", is_flag=True, help="Print the plan for any arch and measure nothing.")
@click.option("--db", "db_path", default=None, help="DB to write (default: LIGER_RT_TUNING_DB or the user cache).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def sweep(arch_name, ops, preset, shapes, dtypes, quick, dry_run, db_path, as_json):
    """Measure every implementation and config for the plan; persist the winners and crossovers."""
    import dataclasses

    from liger_rt import autotune, dispatch
    from liger_rt.dtypes import parse_dtype
    from liger_rt.registry import REGISTRY
    from liger_rt.tools import distributed
    from liger_rt.tools.parity import checked
    from liger_rt.tools.presets import get_preset
    ops = list(ops or REGISTRY.names())
    if shapes and len(ops) != 1:
        raise click.UsageError("--shape needs exactly one --op")
    for d in dtypes:
        checked(parse_dtype, d, param="--dtype")
    sharded = not dry_run and distributed.launched()     # under torchrun: autotune.sweep_sharded
    if sharded:
        _, world = distributed.init_from_env("cpu" if arch_name == "cpu" else "cuda")
    if dry_run:
        target = dispatch.target_for_arch(arch_name)
    else:
        real = autotune.check_arch_matches(arch_name)
        target = dataclasses.replace(dispatch.current_target("cpu" if arch_name == "cpu" else "cuda"), arch=real)
    plan, shapes = [], [_parse_shape(s) for s in shapes]     # [(op, dims, dtype, tag)]; shapes replace the op's plan
    try:
        preset = get_preset(preset) if preset else None
        for op in map(REGISTRY.get, ops):
            for dims in shapes or op.plan(preset, target.arch, quick):
                plan += [(op, op.check_dims(dims), dt, tag) for dt in dtypes for tag in op.tags]
    except ValueError as exc:
        raise click.UsageError(str(exc))
    if dry_run:
        if distributed.launched() and os.environ["RANK"] != "0":
            return           # under torchrun the plan is printed once
        rows = []
        for op, dims, dt, tag in plan:
            dtype = parse_dtype(dt)
            avail = op.available_impls(target, dims, dtype) or ["torch"]
            n = sum(len(op.candidates_for(op.impl(i), target.arch, dims, dtype)) for i in avail)
            skipped = autotune.unavailable(op, target, dims, dtype)
            rows.append({"op": op.name, "dims": dims, "dtype": dt, "tag": tag, "impls": ",".join(avail),
                         "candidates": n, "not_measured": ", ".join(f"{k} ({v})" for k, v in skipped.items())})
        click.echo(f"plan for {arch_name} ({len(plan)} cases; nothing measured):", err=as_json)
        click.echo(json.dumps(rows, indent=1) if as_json else
                   _table(rows, ["op", "dims", "dtype", "tag", "impls", "candidates", "not_measured"]))
        return
    from tqdm import tqdm

    def open_store():
        store = _open_user(db_path, readonly=False)
        _echo(f"sweeping {len(plan)} cases on {target.arch.name} ({target.arch.device_name}) into {store.path}"
              + (f", split across {world} ranks" if sharded else ""), err=True)
        return store

    shown = {"unit": "round", "desc": f"{world} ranks"} if sharded else {"unit": "case"}   # rank 0's case shown
    bar = (lambda p: tqdm(p, file=sys.stderr, dynamic_ncols=True, **shown))
    if sharded:
        out = autotune.sweep_sharded(plan, target, open_store, quick=quick, progress=bar)
        if out is None:      # not rank 0: rank 0 prints
            return
    else:
        with open_store() as store:
            out = autotune.sweep(plan, target, store, quick=quick, progress=bar)
    summary = []
    for res in out["results"]:
        win = res["winner"] or {}
        summary.append({"op": res["op"], "dims": res["dims"], "dtype": res["dtype"], "tag": res["tag"],
                        "impl": win.get("impl", "-"), "config": win.get("config", {}), "ms": win.get("median_ms"),
                        "host_ms": win.get("host_ms"), "method": win.get("method"), "torch_ms": res["baseline_ms"],
                        "speedup": (res["baseline_ms"] / win["median_ms"]) if win and res["baseline_ms"] else None,
                        "measured": ",".join(res["best"]), "not_measured": res["unavailable"],
                        "failed": sum(1 for m in res["measurements"] if not m["ok"])})
    for s in out["skipped"]:
        click.echo(f"skipped {s['op']} {s['dims']} {s['dtype']} {s['tag']}: {s['error']}", err=True)
    if as_json:
        click.echo(json.dumps({"results": summary, "skipped": out["skipped"], "crossovers": out["crossovers"]},
                              indent=1, default=str))
        return
    click.echo(_table(summary, ["op", "dims", "dtype", "tag", "impl", "config", "ms", "host_ms", "method", "torch_ms",
                                "speedup", "measured", "failed"]))
    for res in summary:
        for impl, why in res["not_measured"].items():
            click.echo(f"not measured: {res['op']} {impl}: {why}")
    for c in out["crossovers"]:
        click.echo(f"crossover {c['op']} {c['dtype']} {c['static_key']}: {c['segments']} ({c['method']})")


def _device_target(arch_name: str | None, device_name: str | None):
    """The target explain decides for: this machine (or --arch's planning target) on --device's class."""
    import dataclasses

    from liger_rt import backend, dispatch
    if device_name is None:
        return (dispatch.current_target("cuda" if backend.gpu_present() else "cpu") if arch_name is None
                else dispatch.target_for_arch(arch_name))
    device = backend.device_class(device_name)
    if not device:
        raise click.BadParameter(f"{device_name!r} names no device", param_hint="--device")
    known = backend.DEVICE_ARCH.get(device)
    if arch_name is None and known is None:
        raise click.BadParameter(f"{device!r}: say its arch with --arch (devices of known arch: "
                                 f"{', '.join(backend.DEVICE_ARCH)})", param_hint="--device")
    if arch_name is not None and known is not None and known != arch_name:
        raise click.BadParameter(f"{device} is a {known} device, not {arch_name}", param_hint="--device")
    target = dispatch.target_for_arch(arch_name or known)
    if backend.device_class(target.arch.device_name) == device:
        return target
    return dataclasses.replace(target, arch=dataclasses.replace(target.arch, device_name=device_name))


@main.command()
@click.option("--op", default=None, callback=_check_ops, help="Only this op.")
@click.option("--arch", "arch_name", default=None, callback=_check_arch, help="Only this arch.")
@_device_option("show rows")
@click.option("--db", "db_path", default=None, help="DB to read (default: LIGER_RT_TUNING_DB or the user cache).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show(op, arch_name, device_name, db_path, as_json):
    """List tuning entries and crossovers (user DB over shipped defaults), each ok / stale / bad."""
    from liger_rt import backend, tuning_db
    from liger_rt.tuning_db.store import classify, op_arch_where
    where, args = op_arch_where(op, arch_name)
    device = backend.device_class(device_name) if device_name is not None else None
    user_error, layers = None, [None, tuning_db.store.shipped_defaults()]
    try:
        layers[0] = _open_user(db_path, readonly=True, must_exist=db_path is not None)    # None: no user DB yet
    except tuning_db.TuningDBError as exc:
        if db_path is not None:     # the DB asked for cannot be read: say so, do not show another one
            raise
        user_error = str(exc)
    tuning, cross = [], []
    for layer in filter(None, layers):
        for table, out in (("tuning", tuning), ("crossover", cross)):
            for r in layer.select(table, where, args):
                if device is not None and r["device"] != device:
                    continue
                status, why = classify(table, r)
                r["layer"], r["status"], r["why"] = layer.layer, status, why
                r["fresh"] = {"ok": "yes", "stale": "STALE", "bad": "BAD"}[status]
                for col in r.keys() & {"config", "segments"}:
                    with contextlib.suppress(TypeError, ValueError):
                        r[col] = json.loads(r[col])
                out.append(r)
    if as_json:
        click.echo(json.dumps({"tuning": tuning, "crossover": cross, "user_error": user_error}, indent=1, default=str))
        return
    if user_error:
        _echo(f"warning: user DB unusable ({user_error}); showing shipped defaults", err=True)
    tuning.sort(key=lambda r: (str(r["op"]), str(r["arch"]), str(r["device"]), str(r["dtype"]), str(r["static_key"]),
                               str(r["bucket"]), r["median_ms"] if isinstance(r["median_ms"], (int, float)) else 0))
    click.echo(_table(_printable_rows(tuning), ["layer", "op", "arch", "device", "dtype", "static_key", "bucket",
                                                "impl", "config", "median_ms", "host_ms", "baseline_ms", "method",
                                                "origin", "fresh"]))
    if cross:
        click.echo("\ncrossovers:")
        click.echo(_table(_printable_rows(cross), ["layer", "op", "arch", "device", "dtype", "static_key", "axis_name",
                                                   "segments", "margin", "method", "origin", "fresh"]))
    notes = [r for r in tuning + cross if r["status"] != "ok"]
    if notes:
        click.echo("\nnot fresh:")
        for r in notes:
            _echo(f"  {r['fresh']:5} {r['layer']} {r['op']} {r['arch']} {r['device']} {r['dtype']} {r['static_key']} "
                  f"{r.get('bucket', '')} {r.get('impl', '')}: {r['why']}")


@main.command()
@click.argument("op", callback=_check_ops)
@click.option("--shape", required=True, help="k=v[,k=v...], e.g. rows=4096,hidden=2048.")
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--arch", "arch_name", default=None, callback=_check_arch,
              help="Arch to explain for (default: this machine, or --device's).")
@_device_option("explain")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def explain(op, shape, dtype, arch_name, device_name, as_json):
    """Which implementation and config the dispatcher picks for a shape, and why (and from which row)."""
    from liger_rt import backend, dispatch
    from liger_rt.config import config_dict
    from liger_rt.dtypes import parse_dtype
    from liger_rt.registry import REGISTRY
    dims = _parse_shape(shape)
    target = _device_target(arch_name, device_name)
    the_op = REGISTRY.get(op)
    try:
        d = dispatch.decide(the_op, target, parse_dtype(dtype), the_op.check_dims(dims))
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc))
    note = _crossover_note(the_op, d, target)
    if dispatch.compiler_takes(the_op):
        note = (note + "; " if note else "") + "under torch.compile: torch (LIGER_RT_COMPILE_POLICY=fuse)"
    device = backend.device_class(target.arch.device_name)
    row, cross = _rows_behind(the_op, d, target)
    if as_json:
        click.echo(json.dumps({**d.to_dict(), "device": device, "config": config_dict(d.config), "note": note,
                               "row": row, "crossover_row": cross}, indent=1, default=str))
        return
    _echo(f"{d.op} on {d.arch} ({device or 'no device class'}), {d.dtype}, "
          f"{', '.join(f'{k}={v}' for k, v in d.dims.items())}")
    for label, value in (("impl", d.impl), ("config", json.dumps(config_dict(d.config))),
                         ("origin", d.origin), ("why", d.reason), ("row", _describe_row(row)),
                         ("cross", _describe_row(cross)), ("note", note)):
        if value:
            _echo(f"  {label:7} {value}")


_ROW_FIELDS = ("layer", "device", "device_name", "sm_count", "method", "origin", "median_ms", "torch_version",
               "triton_version", "runtime_version", "source_hash", "created", "stale", "fallback")


def _rows_behind(op, d, target) -> tuple[dict | None, dict | None]:
    """(the tuning row whose config the decision took, the crossover row that picked its implementation),
    found as decide found them, each with its device class, timing method and fingerprint (None: none)."""
    from liger_rt import tuning_db
    store, dims = tuning_db.get_store(), dict(d.dims)
    row = cross = None
    if d.origin not in ("heuristic", "online", "pinned"):
        exact = d.reason.startswith("exact bucket")
        row = store.lookup(op, target.arch, d.dtype, dims, impls=[d.impl], nearest=not exact)
        if row is not None:
            row = {k: row.get(k) for k in ("bucket", "impl", *_ROW_FIELDS)}
    if "(segments " in d.reason and (found := store.crossover(op, target.arch, d.dtype, dims)) is not None:
        cross = {"segments": found["segments"], **{k: found.get(k) for k in _ROW_FIELDS}, "origin": found["source"]}
    return row, cross


def _describe_row(row: dict | None) -> str | None:
    if row is None:
        return None
    where = f"{row['device'] or 'any device'} ({row['device_name'] or 'device not recorded'}, {row['sm_count']} SMs)"
    prints = ", ".join(f"{label} {row[k] or '-'}" for label, k in (
        ("torch", "torch_version"), ("triton", "triton_version"), ("runtime", "runtime_version"),
        ("kernel", "source_hash")))
    return f"{row['layer']} DB, {row['origin']}, {row['method']} on {where}; {prints}" + (
        f"; STALE: {row['stale']}" if row["stale"] else "")


def _crossover_note(op, d, target) -> str | None:
    """When a crossover row exists but its pick cannot run here, say so (the decision fell through)."""
    if op.crossover_axis is None or "(segments " in d.reason:
        return None
    from liger_rt import tuning_db
    from liger_rt.tuning_db.crossover import crossover_pick
    row = tuning_db.get_store().crossover(op, target.arch, d.dtype, dict(d.dims))
    if row is None:
        return None
    value = float(op.crossover_axis(dict(d.dims)))
    if (pick := crossover_pick(row["segments"], value)) == d.impl:
        return None
    return (f"the {row['layer']} crossover row ({row['origin']}) picks {pick} at "
            f"{op.crossover_axis_name or 'axis'}={value:.4g}, but {pick} is not available here")


@main.command(name="export")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--arch", "arch_name", default=None, callback=_check_arch, help="Only this arch.")
@_device_option("export rows")
@click.option("--winners", is_flag=True, help="Only tuning and crossover rows, no raw measurements (what the "
                                              "shipped defaults hold).")
@click.option("--shipped", is_flag=True, help="Include the shipped defaults (user rows win on the same key).")
@click.option("--db", "db_path", default=None, help="DB to read (default: LIGER_RT_TUNING_DB or the user cache).")
def export_cmd(file, arch_name, device_name, winners, shipped, db_path):
    """Write the user DB (and with --shipped the shipped defaults) as JSON lines; '-' for stdout."""
    from liger_rt import backend, tuning_db
    from liger_rt.tuning_db.store import classify, dump_jsonl
    user = _open_user(db_path, readonly=True, must_exist=not shipped)
    layers = ([user] if user is not None else []) + ([tuning_db.store.shipped_defaults()] if shipped else [])
    device = backend.device_class(device_name) if device_name is not None else None
    bad = []

    def keep(table, row):
        if (winners and table == "measurements") or (device is not None and row["device"] != device):
            return False
        status, why = classify(table, row)
        if status == "bad":
            bad.append(why)
        return status != "bad"

    with user or contextlib.nullcontext():
        try:
            out = click.open_file(file, "w")     # fail before any warning
        except OSError as exc:
            raise click.ClickException(f"cannot write {file}: {exc.strerror or exc}") from None
        lines = list(dump_jsonl(layers, arch_name, keep=keep))
    with out:
        out.write("".join(line + "\n" for line in lines))
    if file != "-":
        _echo(f"wrote {len(lines) - 1} records to {file}", err=True)
    if bad:
        _echo(f"warning: left out {len(bad)} invalid rows (first: {bad[0]}); `liger-tune doctor` lists them",
              err=True)


@main.command(name="import")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--db", "db_path", default=None, help="DB to write (default: LIGER_RT_TUNING_DB or the user cache).")
def import_cmd(file, db_path):
    """Merge an export into the user DB: all records or none, validated; importing twice changes nothing."""
    from liger_rt.tuning_db import TuningDBError
    from liger_rt.tuning_db.store import load_jsonl
    try:
        if file == "-":
            text = sys.stdin.read()
        elif file.endswith(".gz"):      # the repository keeps sweep measurements gzipped
            with gzip.open(file, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            text = open(file, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise click.ClickException(f"cannot read {file}: {getattr(exc, 'strerror', None) or exc}") from None
    with _open_user(db_path, readonly=False) as store:
        try:
            counts = load_jsonl(store, text.splitlines())
        except TuningDBError as exc:
            raise click.ClickException(f"{file}: {exc}; nothing imported") from None
    _echo(f"merged {counts['tuning']} tuning, {counts['crossover']} crossover, "
          f"{counts['measurements']} measurement records into {store.path}")


@main.command()
@click.option("--stale", is_flag=True, help="Entries measured on other kernel code or config schema, without a timing "
                                            "method, or (this machine's arch) under other software versions.")
@click.option("--invalid", is_flag=True, help="Entries that fail validation (what lookups skip with a warning).")
@click.option("--op", default=None, callback=_check_ops, help="Only entries of this op (alone: every entry of it).")
@click.option("--arch", "arch_name", default=None, callback=_check_arch,
              help="Only entries of this arch (alone: every entry of it).")
@click.option("--dry-run", is_flag=True, help="List what would be removed, remove nothing.")
@click.option("--db", "db_path", default=None, help="DB to prune (default: LIGER_RT_TUNING_DB or the user cache).")
def prune(stale, invalid, op, arch_name, dry_run, db_path):
    """Remove stale (--stale) or invalid (--invalid) entries, or every entry of an op/arch."""
    from liger_rt.tuning_db import TuningDBError
    if not (stale or invalid or op or arch_name):
        raise click.UsageError("say what to prune: --stale, --invalid, --op OP and/or --arch ARCH")
    try:
        store = _open_user(db_path, readonly=dry_run, create=False)
    except TuningDBError as exc:
        raise TuningDBError(f"{exc}; nothing to prune") from None
    with store:
        out = store.prune(stale=stale, invalid=invalid, op=op, arch=arch_name, dry_run=dry_run)
    for table in ("tuning", "crossover"):
        for r, why in out[table]:
            _echo(f"{table:10} {r['op']} {r['arch']} {r['device']} {r['dtype']} {r['static_key']} "
                  f"{r.get('bucket', '')} {r.get('impl', '')} (kernel {r['source_hash'] or '-'}): {why}")
    if dry_run:
        click.echo(f"{len(out['tuning'])} tuning and {len(out['crossover'])} crossover entries and "
                   f"{out['measurements']} raw measurements would be removed (dry run)")
    else:
        _echo(f"removed {len(out['tuning']) + len(out['crossover'])} entries and {out['measurements']} "
              f"raw measurements from {store.path}")


# parity and bench import the patchers, hence the kernel modules: without a GPU the interpreter switch
# must be in place before any @triton.jit runs (it is read when a kernel is decorated)
from liger_rt import backend  # noqa: E402

if not backend.gpu_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from liger_rt.tools.bench import bench  # noqa: E402
from liger_rt.tools.parity import parity  # noqa: E402

main.add_command(parity)
main.add_command(bench)

if __name__ == "__main__":
    main()
