"""The op spec: what a kernel file declares in one ``Op(...)`` (dims, a frozen :class:`Config` whose
fields declare the values they may take, candidate/heuristic/pinned configs, implementations, tuning
cases and sweep plans), and what the runtime builds from it: the functional's prologue, the autograd
wiring (:class:`KernelFunction` in eager mode, generated ``torch.library`` ops under ``torch.compile``),
config validation and the freshness hash.  docs/architecture.md and docs/adding_an_op.md say more.

A Triton implementation is a pair of launchers: ``forward(config, *args) -> (outputs, saved)`` and
``backward(config, args, saved, needs, *grad_outputs) -> one gradient (or None) per arg``, where
``saved`` are the extra tensors the forward kept and ``needs`` which args want a gradient.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import textwrap
import types
import typing
from typing import Callable, Mapping

import torch

from . import env

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


REGISTERED: dict = {}        # op name -> Op, filled by dispatch.register (the spec never imports dispatch)


class ConfigError(ValueError):
    """A config (from a DB row, a file or code) that the op does not declare."""


# -- configs ---------------------------------------------------------------------------------------

def knob(default, choices):
    """A config field and the values it may take (what candidates and DB rows must stay within)."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def pow2(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo to hi inclusive."""
    return tuple(1 << k for k in range(lo.bit_length() - 1, hi.bit_length()))


WARPS = pow2(1, 32)
STAGES = (1, 2, 3, 4, 5, 6)


@dataclasses.dataclass(frozen=True)
class Config:
    """Base of every op's launch config: frozen, typed, each field declared with :func:`knob` (or a nested
    Config).  Construction validates, so a config outside the declared space can neither be generated nor read
    back from a DB row."""

    def __post_init__(self) -> None:
        for f, typ in _fields(type(self)):
            value = getattr(self, f.name)
            if isinstance(typ, type) and issubclass(typ, Config):
                if not isinstance(value, typ):
                    raise ConfigError(f"{type(self).__name__}.{f.name} must be a {typ.__name__}, got {value!r}")
                continue
            if type(value) is not typ and not (typ is float and type(value) is int):
                raise ConfigError(f"{type(self).__name__}.{f.name} must be {typ.__name__}, got {value!r}")
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ConfigError(f"{type(self).__name__}.{f.name}={value!r} is not one of "
                                  f"{', '.join(map(str, choices))}")

    @classmethod
    def parse(cls, data: Mapping | str) -> "Config":
        """The config a DB row or an export holds; every field must be present and declared."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except ValueError as exc:
                raise ConfigError(f"{cls.__name__}: config is not JSON ({exc})") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"{cls.__name__}: config must be a JSON object, got {type(data).__name__}")
        fields = dict((f.name, typ) for f, typ in _fields(cls))
        unknown = sorted(set(data) - set(fields))
        missing = sorted(set(fields) - set(data))
        if unknown or missing:
            raise ConfigError(f"{cls.__name__}: fields are {', '.join(fields) or 'none'}; "
                              f"unknown {unknown or 'none'}, missing {missing or 'none'}")
        return cls(**{k: (typ.parse(data[k]) if isinstance(typ, type) and issubclass(typ, Config) else data[k])
                      for k, typ in fields.items()})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def keys(self):                 # dict(config) gives the JSON form's top level
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, name: str):
        return getattr(self, name)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def limits(self) -> tuple[int, int]:
        """(most warps, most stages) of any launch this config makes: what an arch prunes on."""
        warps, stages = 1, 1
        for f, typ in _fields(type(self)):
            v = getattr(self, f.name)
            if isinstance(v, Config):
                w, s = v.limits()
                warps, stages = max(warps, w), max(stages, s)
            elif f.name.endswith("num_warps"):
                warps = max(warps, v)
            elif f.name.endswith("num_stages"):
                stages = max(stages, v)
        return warps, stages


@dataclasses.dataclass(frozen=True)
class NoConfig(Config):
    """Implementations without launch knobs (torch, grouped MM)."""


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> tuple:
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def config_dict(config) -> dict:
    """A config (dataclass or mapping) as a JSON-able dict."""
    return config.to_dict() if isinstance(config, Config) else dict(config)


# -- implementations and tuning cases -----------------------------------------------------------------

@dataclasses.dataclass
class Impl:
    """One implementation of an op: either native (``fn(*args)``, differentiated by autograd) or a Triton pair
    (``forward``/``backward``, see the module docstring) that takes the op's config.  available(target) -> bool:
    can it run on this device/arch at all; supports(dims, dtype) -> None, or why it cannot take this shape.
    """
    name: str
    fn: Callable | None = None
    forward: Callable | None = None
    backward: Callable | None = None
    available: Callable = lambda target: True
    supports: Callable | None = None
    # args whose values the backward reads (None: all); the others are saved as shape-only stand-ins
    keep: tuple[int, ...] | None = None
    run: Callable | None = None           # run(case, config): set by the Op (autotune's entry)
    # under torch.compile: traced_backward(args, saved, needs, *grads) -> one gradient per arg in plain
    # torch ops (inductor plans their memory; the backward op allocates fresh buffers), or None: the op
    traced_backward: Callable | None = None

    @property
    def tuned(self) -> bool:
        return self.forward is not None


@dataclasses.dataclass
class Case:
    """A tuning case: the call's arguments and one upstream gradient per output (None: not used)."""
    args: tuple
    grads: tuple


# -- the op spec -----------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Op:
    """An op's declaration.

    dims(*args) checks a call's arguments and returns its dims (static ones key tuning exactly, dynamic ones
    are bucketed to powers of two).  config/candidates/heuristic/pinned describe the tuned implementation's
    launch space; smem(config, dims, dtype) its shared memory per program.  make_case(dims, dtype, device[,
    tag]) -> Case with fresh random inputs; plan(preset, arch, quick) lists the dims a sweep measures;
    reduce_len(dims) sizes the validation tolerance; crossover_axis(dims) is the quantity that decides between
    competing implementations.  schema: the args of the custom op ("Tensor x, Tensor weight, float eps");
    fake(config, *args) -> (outputs, saved) as empty tensors; outputs: how many tensors the op returns;
    bwd_fake: the backward op's fake where the gradients are not laid out like the inputs (default: contiguous).
    """
    name: str
    static: tuple[str, ...]
    dynamic: tuple[str, ...]
    impls: list[Impl]
    make_case: Callable
    plan: Callable
    dims: Callable[..., dict] | None = None
    config: type = NoConfig
    candidates: Callable | None = None
    heuristic: Callable | None = None
    pinned: Callable | None = None
    smem: Callable | None = None
    schema: str = ""
    fake: Callable | None = None
    bwd_fake: Callable | None = None
    outputs: int = 1
    reduce_len: Callable[[dict], int] = lambda dims: 1
    heuristic_impl: Callable | None = None
    crossover_axis: Callable[[dict], float] | None = None
    crossover_axis_name: str = ""
    pinned_by_fused_moe_env: bool = False
    schema_version: int = 1
    variant: str = "fwdbwd"
    tags: tuple[str, ...] = ("",)       # input variants a sweep measures (make_case takes tag=)
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    # torch.compile fuses the torch implementation with its neighbours (adds, casts):
    # LIGER_RT_COMPILE_POLICY=fuse traces it
    compiler_fuses: bool = False

    def __post_init__(self) -> None:
        self._by_name = {i.name: i for i in self.impls}
        self._memo: dict = {}
        self._decide = None           # set by dispatch.register
        self._dtypes = tuple(DTYPES[d] for d in self.dtypes)
        if "torch" not in self._by_name:
            raise ValueError(f"op {self.name} must register a 'torch' reference implementation")
        for impl in self.impls:
            if impl.run is None:
                impl.run = functools.partial(self.run_case, impl)

    # -- identity ----------------------------------------------------------------------------------
    @property
    def impl_names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def impl(self, name: str) -> Impl:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"{self.name} has no implementation {name!r}; valid: {', '.join(self._by_name)}") from None

    @property
    def reference(self) -> Callable:
        return self._by_name["torch"].fn

    @functools.cached_property
    def source_hash(self) -> str:
        """Hash of what changes behaviour: the Triton kernels and the launch code reachable from the
        tuned implementations' forward/backward (docstrings and comments do not count)."""
        roots = [f for i in self.impls for f in (i.forward, i.backward) if f is not None]
        text = "\n".join(_normalised_source(f) for f in _reachable(roots)) or self.name
        return hashlib.sha256(f"{self.schema_version}\n{text}".encode()).hexdigest()[:16]

    def check_dims(self, dims: Mapping[str, int]) -> dict:
        names = self.static + self.dynamic
        missing = [d for d in names if d not in dims]
        extra = [d for d in dims if d not in names]
        if missing or extra:
            raise ValueError(f"{self.name} takes dims {','.join(names)}; missing {missing or 'none'}, "
                             f"unknown {extra or 'none'}")
        return {d: int(dims[d]) for d in names}

    def static_key(self, dims: Mapping[str, int]) -> str:
        return json.dumps({d: int(dims[d]) for d in self.static}, sort_keys=True, separators=(",", ":"))

    def bucket_key(self, dims: Mapping[str, int]) -> str:
        return json.dumps({d: bucket(dims[d]) for d in self.dynamic}, sort_keys=True, separators=(",", ":"))

    # -- configs -------------------------------------------------------------------------------------
    def parse_config(self, data, impl: str = "triton") -> Config:
        """A stored config for `impl`, validated against the declared fields (ConfigError if not)."""
        cls = self.config if self._by_name.get(impl, Impl(impl)).tuned else NoConfig
        return data if isinstance(data, cls) else cls.parse(data)

    def candidates_for(self, impl: Impl, arch, dims: dict, dtype: torch.dtype) -> list[Config]:
        """The configs a sweep measures for `impl` on `arch`, pruned to what the arch can run."""
        if not impl.tuned:
            return [NoConfig()]

        def fits(cfg: Config) -> bool:
            warps, stages = cfg.limits()
            return (warps <= arch.max_num_warps and stages <= arch.max_num_stages
                    and (self.smem is None or self.smem(cfg, dims, dtype) <= arch.smem_bytes))
        return list(dict.fromkeys(filter(fits, self.candidates(arch, dims, dtype))))

    def default_config(self, impl: str, arch, dims: dict, dtype: torch.dtype, *, pinned: bool = False) -> Config:
        if not self.impl(impl).tuned:
            return NoConfig()
        if pinned and self.pinned is not None:
            return self.pinned(arch, dims, dtype)
        return self.heuristic(arch, dims, dtype)

    def available_impls(self, target, dims: dict, dtype: torch.dtype) -> list[str]:
        return [i.name for i in self.impls
                if i.available(target) and (i.supports is None or i.supports(dims, dtype) is None)]

    # -- the hot path ----------------------------------------------------------------------------------
    def select(self, x: torch.Tensor, **dims: int):
        """Decide for a call on tensor `x` (its device and dtype) with these dims (memoised)."""
        key = (x.device, x.dtype, *dims.values())
        return self._memo.get(key) or self._decide(self, x, dims, key)

    def __call__(self, *args):
        """The functional's body: check the inputs, decide, run the chosen implementation."""
        dims = self.dims(*args)
        x = args[0]
        if x.dtype not in self._dtypes or x.numel() == 0:
            if not x.dtype.is_floating_point:
                raise TypeError(f"{self.name}: unsupported dtype {x.dtype}; accepted: "
                                f"{', '.join(map(str, self._dtypes))} (other float dtypes run the reference)")
            return self.reference(*args)
        if torch.compiler.is_compiling():
            return self._traced_call(dims, args)
        # the memo key: x.device (not .device.type, which builds a string each time), dtype, dims
        key = (x.device, x.dtype, *dims.values())
        d = self._memo.get(key) or self._decide(self, x, dims, key)     # a Decision is always truthy
        impl = self._by_name[d.impl]
        if impl.fn is not None:
            return impl.fn(*args)
        return _apply_kernel(impl, d.config, *args)

    def call_impl(self, impl: str, config, *args):
        """Run one implementation with a given config, bypassing the decision (tests, benchmarks)."""
        the_impl = self.impl(impl)
        if the_impl.fn is not None:
            return the_impl.fn(*args)
        return _apply_kernel(the_impl, self.parse_config(config, impl), *args)

    def run_case(self, impl: Impl, case: Case, config) -> list[torch.Tensor]:
        """Outputs and input gradients of one implementation on a tuning case (autotune, tests)."""
        outs = self.call_impl(impl.name, config, *case.args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        inputs = [a for a in case.args if isinstance(a, torch.Tensor) and a.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, case.grads) if g is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                    allow_unused=True, materialize_grads=True) if inputs and pairs else ()
        return [*outs, *grads]

    def new_case(self, dims: dict, dtype: torch.dtype, device: str, tag: str = "") -> Case:
        if self.tags != ("",):
            return self.make_case(dims, dtype, device, tag=tag or self.tags[0])
        return self.make_case(dims, dtype, device)

    # -- torch.compile ----------------------------------------------------------------------------------
    def _traced_call(self, dims: dict, args: tuple):
        # dims are pinned down by comparisons only, so under dynamic shapes dynamo guards on the
        # bucket of a dynamic dim (a new bucket recompiles) and on the exact value of a static one,
        # and the decision below sees plain ints it can treat as constants
        key = tuple(bucket(dims[d]) if d in self.dynamic else _traced_exact(dims[d])
                    for d in self.static + self.dynamic)
        impl_name, config_json = _decide_constant(self.name, args[0].device.type, args[0].dtype, *key)
        impl = self._by_name[impl_name]
        if impl.fn is not None:
            return impl.fn(*args)
        out = self._custom_ops.apply(config_json, impl.keep, impl.traced_backward, *args)
        return out[0] if self.outputs == 1 else out

    @functools.cached_property
    def _custom_ops(self):
        return _build_custom_ops(self)


def bucket(value) -> int:
    """Dynamic dims are bucketed to the next power of two (1, 2, 4, ...).  By comparisons only: under
    torch.compile a symbolic value is guarded on its bucket, not on its exact value."""
    b = 1
    while b < value:
        b *= 2
    return b


def _traced_exact(value) -> int:
    """A (possibly symbolic) positive int as a plain int, by bisection between powers of two."""
    lo, hi = 0, bucket(value)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if value <= mid else (mid, hi)
    return hi


@torch.compiler.assume_constant_result
def _decide_constant(op_name: str, device_type: str, dtype: torch.dtype, *key: int) -> tuple[str, str]:
    op = REGISTERED[op_name]
    dims = dict(zip(op.static + op.dynamic, key))
    if compiler_takes(op):
        if env.log_decisions():
            logging.getLogger("liger_rt.dispatch").warning(
                "liger_rt decision: %s under torch.compile -> torch (LIGER_RT_COMPILE_POLICY=fuse: the compiler "
                "fuses it)", op.name)
        return "torch", json.dumps({"impl": "torch", "config": {}}, sort_keys=True)
    d = op.select(_probe(device_type, dtype), **dims)
    return d.impl, json.dumps({"impl": d.impl, "config": config_dict(d.config)}, sort_keys=True)


def compiler_takes(op: Op) -> bool:
    """Whether a torch.compile trace hands `op` to the compiler (its torch implementation): the op says
    compiler_fuses, LIGER_RT_COMPILE_POLICY=fuse, and neither LIGER_RT_DISABLE nor LIGER_RT_IMPL_<OP> decides."""
    return (op.compiler_fuses and env.compile_policy() == "fuse" and not env.disabled()
            and env.impl_override(op.name, op.impl_names) is None)


@functools.lru_cache(maxsize=None)
def _probe(device_type: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device_type)


# -- autograd ---------------------------------------------------------------------------------------------

class KernelFunction(torch.autograd.Function):
    """Eager autograd for any Triton pair: apply(impl, config, *args)."""

    @staticmethod
    def forward(ctx, impl, config, *args):
        outs, saved = impl.forward(config, *args)
        keep = impl.keep
        if keep is None:
            ctx.save_for_backward(*[a if isinstance(a, torch.Tensor) else None for a in args], *saved)
        else:
            ctx.save_for_backward(*[_kept(a, i, keep) if isinstance(a, torch.Tensor) else None
                                    for i, a in enumerate(args)], *saved)
        ctx.impl, ctx.config, ctx.n = impl, config, len(args)
        ctx.scalars = tuple([None if isinstance(a, torch.Tensor) else a for a in args])
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # the launchers are not differentiable: under create_graph (grad mode on in the backward)
        # once_differentiable makes a second differentiation raise; otherwise its wrapper (a no_grad
        # block and a grad-mode check, ~8 us of host time) would only return the outputs as they are
        if torch.is_grad_enabled():
            return _kernel_backward_once(ctx, *grads)
        return _kernel_backward(ctx, *grads)


_function_apply = super(torch.autograd.Function, KernelFunction).apply     # the C entry of Function.apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _apply_kernel(impl, config, *args):
    """KernelFunction.apply(impl, config, *args) through the C entry, skipping the Python wrapper's
    per-call work (~1.5 us); under functorch transforms, the wrapper itself."""
    if torch._C._are_functorch_transforms_active():
        return KernelFunction.apply(impl, config, *args)
    return _function_apply(impl, config, *[_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args])


def _kernel_backward(ctx, *grads):
    saved = ctx.saved_tensors
    n = ctx.n
    args = tuple([c if t is None else t for t, c in zip(saved[:n], ctx.scalars)])
    dargs = ctx.impl.backward(ctx.config, args, saved[n:], ctx.needs_input_grad[2:], *grads)
    return (None, None, *dargs)


_kernel_backward_once = torch.autograd.function.once_differentiable(_kernel_backward)


def _kept(t, index: int, keep):
    """The arg itself if the backward reads it, else a stand-in with its shape, dtype and device
    (one element, expanded) so the activation it holds can be freed."""
    if t is None or keep is None or index in keep:
        return t
    return t.new_empty(()).expand(t.shape)


def _schema_args(schema: str) -> list[tuple[str, str]]:
    return [tuple(a.strip().rsplit(" ", 1)) for a in schema.split(",") if a.strip()]


_LIB = torch.library.Library("liger_rt", "FRAGMENT")     # the namespace of every generated op


def _build_custom_ops(op: Op):
    """liger_rt::<op>_fwd(args..., str config) -> Tensor[] (outputs then saved) and liger_rt::<op>_bwd,
    with fakes; returns the autograd.Function that joins them under dynamo.  Plain ``Library`` ops: a
    ``torch.library.custom_op`` costs ~6 us more per call in a compiled graph (docs/architecture.md)."""
    spec = _schema_args(op.schema)
    is_tensor = [t.startswith("Tensor") for t, _ in spec]
    scalars = [(t, n) for t, n in spec if not t.startswith("Tensor")]

    def fwd(*a):
        *args, config_json = a
        impl, cfg = _parse_decision(op.name, config_json)
        outs, saved = impl.forward(cfg, *args)
        return [*(o.clone() if any(o is t for t in args) else o for o in outs), *saved]

    def fwd_fake(*a):
        *args, config_json = a
        outs, saved = op.fake(_parse_decision(op.name, config_json)[1], *args)
        return [*outs, *saved]

    # the op's own scalar names sit beside these: prefixed so that none can clash (fused_linear_
    # cross_entropy has an `int grads`; a duplicate name broke inductor's lowering on the H200)
    bwd_schema = ", ".join(["Tensor?[] _fwd_tensors", "Tensor[] _fwd_saved", "Tensor?[] _out_grads",
                            *(f"{t} {n}" for t, n in scalars), "bool[] _needs", "str _config"])

    def rebuild(tensors, scalar_values):
        it_t, it_s = iter(tensors), iter(scalar_values)
        return tuple(next(it_t) if flag else next(it_s) for flag in is_tensor)

    def bwd(tensors, saved, grads, *rest):
        *scalar_values, needs, config_json = rest
        impl, cfg = _parse_decision(op.name, config_json)
        args = rebuild(tensors, scalar_values)
        per_arg = rebuild(map(bool, needs), [False] * len(scalars))     # one flag per arg, as in eager mode
        dargs = [g for g, flag in zip(impl.backward(cfg, args, tuple(saved), per_arg, *grads), is_tensor) if flag]
        like = next(t for t in tensors if t is not None)
        return [g.to(t.dtype) if g is not None and need and t is not None else like.new_empty(0)
                for g, t, need in zip(dargs, tensors, needs)]

    def bwd_fake(tensors, saved, grads, *rest):
        needs = rest[-2]
        like = next(t for t in tensors if t is not None)
        return [t.new_empty(t.shape) if need and t is not None else like.new_empty(0)
                for t, need in zip(tensors, needs)]

    for half, schema, kernel, fake in (("fwd", f"({op.schema}, str _config)", fwd, fwd_fake),
                                       ("bwd", f"({bwd_schema})", bwd, op.bwd_fake or bwd_fake)):
        _LIB.define(f"{op.name}_{half}{schema} -> Tensor[]")
        _LIB.impl(f"{op.name}_{half}", kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"liger_rt::{op.name}_{half}", fake, lib=_LIB)
    fwd_op = getattr(torch.ops.liger_rt, f"{op.name}_fwd").default
    bwd_op = getattr(torch.ops.liger_rt, f"{op.name}_bwd").default
    n_out = op.outputs

    class TracedFunction(torch.autograd.Function):
        """apply(config_json, keep, traced_backward, *args): the op's outputs (`keep`, `traced_backward`:
        the implementation's); traced by dynamo, never run eagerly."""

        @staticmethod
        def forward(ctx, config_json, keep, traced_backward, *args):
            out = fwd_op(*args, config_json)
            tensors = [_kept(a, i, keep) for i, (a, flag) in enumerate(zip(args, is_tensor)) if flag]
            ctx.save_for_backward(*tensors, *out[n_out:])
            ctx.n_tensors = len(tensors)
            ctx.scalars = [a for a, flag in zip(args, is_tensor) if not flag]
            ctx.config_json, ctx.traced_backward = config_json, traced_backward
            return tuple(out[:n_out])

        @staticmethod
        def backward(ctx, *grads):
            saved = ctx.saved_tensors
            tensors, extra = list(saved[:ctx.n_tensors]), list(saved[ctx.n_tensors:])
            if ctx.traced_backward is not None:
                dargs = ctx.traced_backward(rebuild(tensors, ctx.scalars), tuple(extra), ctx.needs_input_grad[3:],
                                            *grads)
                if dargs is not None:
                    return (None, None, None, *dargs)
            needs = [bool(n) for n, flag in zip(ctx.needs_input_grad[3:], is_tensor) if flag]
            out = bwd_op(tensors, extra, list(grads), *ctx.scalars, needs, ctx.config_json)
            dargs = rebuild(out, [None] * len(ctx.scalars))
            return (None, None, None, *(g if g is not None and g.numel() else None for g in dargs))

    return TracedFunction


@functools.lru_cache(maxsize=256)
def _parse_decision(op_name: str, config_json: str):
    op = REGISTERED[op_name]
    data = json.loads(config_json)
    return op.impl(data["impl"]), op.parse_config(data["config"], data["impl"])


# -- freshness -----------------------------------------------------------------------------------------

def _reachable(roots: list) -> list:
    """Functions and Triton kernels reachable from `roots` through module globals, in the roots'
    modules and in liger_rt (library code of torch or triton does not count); a class reached there
    brings its methods (a launcher's helper class, e.g. MoE routing, changes behaviour too)."""
    home = {getattr(r, "__module__", "") for r in roots}
    seen, order, todo = set(), [], list(roots)
    while todo:
        fn = todo.pop()
        fn = getattr(fn, "fn", fn)               # triton JITFunction -> the Python function
        if (not isinstance(fn, (types.FunctionType, type)) or id(fn) in seen
                or not (fn.__module__ in home or fn.__module__.startswith("liger_rt."))):
            continue
        seen.add(id(fn))
        if isinstance(fn, type):
            todo += [m for m in map(_method_function, vars(fn).values()) if m is not None]
            continue
        order.append(fn)
        todo += [fn.__globals__.get(name) for name in set(_code_names(fn.__code__))]
    return sorted(order, key=lambda f: (f.__module__, f.__qualname__))


def _method_function(member):
    """The plain function behind a class member (method, static/class method, property), else None."""
    member = getattr(member, "__func__", None) or getattr(member, "fget", None) or member
    return member if isinstance(member, types.FunctionType) else None


def _code_names(code) -> list[str]:
    out = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out += _code_names(c)
    return out


def _normalised_source(fn) -> str:
    """The function's code as the AST sees it: no comments, no docstrings, no formatting."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return f"{fn.__module__}.{fn.__qualname__}\n{ast.unparse(tree)}"
