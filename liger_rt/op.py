"""An op's declaration: what a kernel file states in one ``Op(...)`` at its bottom (dims, a launch
:class:`~liger_rt.config.Config`, implementations, tuning cases and sweep plans).  It is data plus spec
queries; the runtime's services take it: ``dispatch`` (decide and call), ``autograd`` (run an
implementation eagerly), ``custom_ops`` (the torch.compile ops), ``freshness`` (the kernel hash),
``autotune``.  docs/adding_an_op.md walks through one.

A Triton implementation is a pair of launchers, :data:`Forward` and :data:`Backward`::

    forward(config, *args) -> (outputs, saved)
    backward(config, args, saved, needs, *grad_outputs) -> one gradient (or None) per arg

where ``saved`` are the extra tensors the forward kept and ``needs`` which args want a gradient.

An op's prologue is its ``dims``: ``dispatch.call`` runs it once per call, before the decision, so every check in
it holds whichever implementation runs.  It refuses, in one line naming the op and what is valid, anything an
implementation would reject, misread or compute differently (ValueError for a shape or value, TypeError for a
type); a value check that would need a device sync (an id range on CUDA) is done only where the values are on
the host (:func:`host_values`), and the op's docstring says what every implementation does on the GPU instead.
"""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from .backend import Arch
from .config import Config, NoConfig
from .dtypes import DTYPES

if TYPE_CHECKING:       # annotations only: Target is the dispatcher's (a layer above)
    from .dispatch import Target

Dims = dict[str, int]
# Float dtypes no kernel takes that an op still accepts: its torch reference runs them (fp64 checks, HF's tests).
REFERENCE_DTYPES = (torch.float64,)
Tensors = Sequence[torch.Tensor]

# -- the callables an op declares (positional arguments as shown) ------------------------------------
Forward = Callable[..., tuple[Tensors, Tensors]]                  # (config, *args) -> (outputs, saved)
Backward = Callable[..., Sequence[Any]]                           # (config, args, saved, needs, *grads) -> per arg
TracedBackward = Callable[..., "Sequence[Any] | None"]            # (args, saved, needs, *grads) -> per arg, or None
Available = Callable[["Target"], bool]                            # can it run on this target at all
Supports = Callable[[Dims, torch.dtype], "str | None"]            # None, or why it cannot take this shape
DimsOf = Callable[..., Dims]                                      # (*args) -> dims; raises on a bad call
ConfigFor = Callable[[Arch, Dims, torch.dtype], Config]           # heuristic, pinned
CandidatesFor = Callable[[Arch, Dims, torch.dtype], list[Config]]
SmemOf = Callable[[Config, Dims, torch.dtype], int]               # shared memory per program, bytes
Launchable = Callable[[Config, Dims, Arch, torch.dtype], "str | None"]   # None, or why it cannot launch at dims
MakeCase = Callable[..., "Case"]                                  # (dims, dtype, device[, tag=]) -> Case
Plan = Callable[[Any, Arch, bool], list[Dims]]                    # (preset or None, arch, quick) -> dims to sweep
Fake = Callable[..., tuple[Tensors, Tensors]]                     # (config, *args) -> empty (outputs, saved)
BwdFake = Callable[..., list[torch.Tensor]]                       # the backward op's fake (custom_ops)
HeuristicImpl = Callable[["Target", Dims, torch.dtype, list[str]], "str | None"]
Axis = Callable[[Dims], float]


# -- prologue checks ------------------------------------------------------------------------------------

def check_dtype(op: str, what: str, t: torch.Tensor | None, accepted: Sequence[torch.dtype]) -> None:
    """A prologue check: argument `what` of `op` (None passes) holds one of the `accepted` dtypes, else TypeError."""
    if t is not None and t.dtype not in accepted:
        raise TypeError(f"{op}: unsupported {what} dtype {t.dtype}; accepted: {', '.join(map(str, accepted))}")


def host_values(t: torch.Tensor) -> bool:
    """Whether a prologue may read `t`'s values: on the CPU (no device sync), outside a torch.compile trace."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


@dataclasses.dataclass
class Impl:
    """One implementation of an op: either native (``fn(*args)``, differentiated by autograd) or a Triton
    pair (``forward``/``backward``) that takes the op's config.  ``available(target)``: can it run on this
    device/arch at all; ``supports(dims, dtype)``: None, or why it cannot take this shape.
    """
    name: str
    fn: Callable | None = None
    forward: Forward | None = None
    backward: Backward | None = None
    available: Available = lambda target: True
    supports: Supports | None = None
    # args whose values the backward reads (None: all); the others are saved as shape-only stand-ins
    keep: tuple[int, ...] | None = None
    # under torch.compile: the backward in plain torch ops (inductor plans their memory; the backward op
    # allocates fresh buffers), or None: the backward op
    traced_backward: TracedBackward | None = None

    @property
    def tuned(self) -> bool:
        return self.forward is not None


@dataclasses.dataclass
class Case:
    """A tuning case: the call's arguments and one upstream gradient per output (None: not used)."""
    args: tuple
    grads: tuple


def bucket(value) -> int:
    """Dynamic dims are bucketed to the next power of two (1, 2, 4, ...).  By comparisons only: under
    torch.compile a symbolic value is guarded on its bucket, not on its exact value."""
    b = 1
    while b < value:
        b *= 2
    return b


@dataclasses.dataclass(eq=False)
class Op:
    """An op's declaration.

    dims(*args), the prologue (module docstring), checks a call's arguments and returns its dims (static ones key
    tuning exactly, dynamic ones are bucketed to powers of two).  config/candidates/heuristic/pinned describe the
    tuned implementation's launch space; smem(config, dims, dtype) its shared memory per program; launchable(config, dims, arch, dtype)
    None, or why a config cannot launch at these dims on the arch past warps, stages and shared memory (Triton's
    largest block, the grid): import, lookups, `doctor` and sweeps apply both.  make_case(dims, dtype, device[,
    tag]) -> Case with fresh random inputs; plan(preset, arch, quick) lists the dims a sweep measures;
    reduce_len(dims) sizes the validation tolerance; crossover_axis(dims) is the quantity that decides between
    competing implementations; wall_clock: a GPU sweep ranks the implementations by wall clock per call (host
    cost included), not device time (ops whose kernels take microseconds, where the host path decides).
    schema: the args of the custom op ("Tensor x, Tensor weight, float eps"); fake(config, *args) -> (outputs,
    saved) as empty tensors; outputs: how many tensors the op returns; bwd_fake: the backward op's fake where the
    gradients are not laid out like the inputs (default: contiguous).
    """
    name: str
    static: tuple[str, ...]
    dynamic: tuple[str, ...]
    impls: list[Impl]
    make_case: MakeCase
    plan: Plan
    dims: DimsOf | None = None
    config: type[Config] = NoConfig
    candidates: CandidatesFor | None = None
    heuristic: ConfigFor | None = None
    pinned: ConfigFor | None = None
    smem: SmemOf | None = None
    launchable: Launchable | None = None
    schema: str = ""
    fake: Fake | None = None
    bwd_fake: BwdFake | None = None
    outputs: int = 1
    reduce_len: Callable[[Dims], int] = lambda dims: 1
    heuristic_impl: HeuristicImpl | None = None
    crossover_axis: Axis | None = None
    crossover_axis_name: str = ""
    wall_clock: bool = False
    pinned_by_fused_moe_env: bool = False
    schema_version: int = 1
    variant: str = "fwdbwd"
    tags: tuple[str, ...] = ("",)       # input variants a sweep measures (make_case takes tag=)
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    # torch.compile fuses the torch implementation with its neighbours (adds, casts):
    # LIGER_RT_COMPILE_POLICY=fuse traces it
    compiler_fuses: bool = False
    # derived from the above at construction, read on the hot path
    by_name: dict[str, Impl] = dataclasses.field(init=False, repr=False)
    torch_dtypes: tuple[torch.dtype, ...] = dataclasses.field(init=False, repr=False)
    accepted_dtypes: tuple[torch.dtype, ...] = dataclasses.field(init=False, repr=False)   # + REFERENCE_DTYPES

    def __post_init__(self) -> None:
        self.by_name = {i.name: i for i in self.impls}
        self.torch_dtypes = tuple(DTYPES[d] for d in self.dtypes)
        self.accepted_dtypes = self.torch_dtypes + REFERENCE_DTYPES
        if "torch" not in self.by_name:
            raise ValueError(f"op {self.name} must register a 'torch' reference implementation")

    # -- identity ----------------------------------------------------------------------------------
    @property
    def impl_names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    def impl(self, name: str) -> Impl:
        try:
            return self.by_name[name]
        except KeyError:
            raise ValueError(f"{self.name} has no implementation {name!r}; valid: {', '.join(self.by_name)}") from None

    @property
    def reference(self) -> Callable:
        return self.by_name["torch"].fn

    # -- dims --------------------------------------------------------------------------------------
    def check_dims(self, dims: Mapping[str, int]) -> Dims:
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
        cls = self.config if self.by_name.get(impl, Impl(impl)).tuned else NoConfig
        return data if isinstance(data, cls) else cls.parse(data)

    def candidates_for(self, impl: Impl, arch: Arch, dims: Dims, dtype: torch.dtype) -> list[Config]:
        """The configs a sweep measures for `impl` on `arch`, pruned to what the arch can run."""
        if not impl.tuned:
            return [NoConfig()]

        def fits(cfg: Config) -> bool:
            warps, stages = cfg.limits()
            return (warps <= arch.max_num_warps and stages <= arch.max_num_stages
                    and (self.smem is None or self.smem(cfg, dims, dtype) <= arch.smem_bytes)
                    and (self.launchable is None or self.launchable(cfg, dims, arch, dtype) is None))
        return list(dict.fromkeys(filter(fits, self.candidates(arch, dims, dtype))))

    def default_config(self, impl: str, arch: Arch, dims: Dims, dtype: torch.dtype, *,
                       pinned: bool = False) -> Config:
        if not self.impl(impl).tuned:
            return NoConfig()
        if pinned and self.pinned is not None:
            return self.pinned(arch, dims, dtype)
        return self.heuristic(arch, dims, dtype)

    def available_impls(self, target: Target, dims: Dims, dtype: torch.dtype) -> list[str]:
        return [i.name for i in self.impls
                if i.available(target) and (i.supports is None or i.supports(dims, dtype) is None)]

    # -- tuning cases -----------------------------------------------------------------------------------
    def new_case(self, dims: Dims, dtype: torch.dtype, device: str, tag: str = "") -> Case:
        if self.tags != ("",):
            return self.make_case(dims, dtype, device, tag=tag or self.tags[0])
        return self.make_case(dims, dtype, device)
