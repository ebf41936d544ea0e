"""GPU memory for the GPU tests: what a test needs, whether this card has it, how many layers of a
large model fit, and the check that a test gives back what it allocated.

A GPU test states its need with ``@pytest.mark.gpu_mem(gib=N)`` (module-wide through ``pytestmark``
or per test; the closest mark wins).  On a card whose total memory (``torch.cuda.mem_get_info``) is
below N GiB the test is skipped, the reason naming both figures.  Model-level tests size themselves:
``plan_model`` cuts a preset to the most layers whose estimated need fits this card's free memory
and says so in the test id (``gemma3-4b-cut27L``: Gemma 3 4B's widths with 27 of its 34 layers).

    @pytest.mark.gpu_mem(gib=24)
    def test_big(): ...

    FREE = free_bytes()
    PLANS = [plan_model(get_preset("gemma3-4b"), FREE), plan_model(get_preset("mistral-7b"), FREE, layers=16)]
    @pytest.mark.parametrize("plan", [p.param() for p in PLANS])
    def test_parity(plan): ...          # plan.preset: the preset to build

tests/conftest.py applies ``guard`` around every GPU test: skip on a small card, free and record the
allocated memory before, free again after and fail the test itself if memory stayed allocated.
"""
from __future__ import annotations

import dataclasses
import gc
import inspect
import math
import warnings
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

GPU_DIR = Path(__file__).parent / "gpu"     # every test here states its need
GIB = 2 ** 30
MIB = 2 ** 20
DEFAULT_GIB = 8             # a GPU test without a gpu_mem mark (those outside tests/gpu)
# what a first use may legitimately keep: cuBLAS/cuBLASLt workspaces (32 MiB each on Hopper) and
# small caches (a packed-sequence index); a leaked activation or model is far larger
LEAK_TOLERANCE = 64 * MIB
OVERHEAD = 2 * GIB          # beside a model's tensors: cuBLAS workspaces, Triton modules, fragmentation
CALL_EXCEPTION = pytest.StashKey[BaseException]()   # what a test's setup or body raised (conftest sets it)


class GpuMemoryWarning(UserWarning):
    """A test's measured peak exceeded the memory its gpu_mem mark states."""


# -- the card -------------------------------------------------------------------------------------

def card() -> tuple[int, int, str]:
    """(free bytes, total bytes, name) of the current CUDA device."""
    free, total = torch.cuda.mem_get_info()
    return free, total, torch.cuda.get_device_name()


def need_gib(item) -> float:
    """GiB a test item states through its closest gpu_mem mark (DEFAULT_GIB without one)."""
    mark = item.get_closest_marker("gpu_mem")
    return float(mark.kwargs.get("gib", mark.args[0] if mark.args else DEFAULT_GIB)) if mark else DEFAULT_GIB


def unstated(items) -> list[str]:
    """Node ids of the GPU tests under tests/gpu that carry no gpu_mem mark (conftest refuses to run them)."""
    return [item.nodeid for item in items if "gpu" in item.keywords and GPU_DIR in Path(item.path).parents
            and item.get_closest_marker("gpu_mem") is None]


def skip_reason(gib: float) -> str | None:
    """Why a test needing `gib` GiB cannot run on this card (its total memory is less), else None."""
    _, total, name = card()
    if gib * GIB <= total:
        return None
    return f"needs {gib:.1f} GiB of GPU memory; this {name} has {total / GIB:.1f} GiB"


# -- freeing and the leak check -------------------------------------------------------------------

def settle() -> int:
    """Free what nothing references and return the bytes still allocated: unreachable cycles,
    dynamo's compiled code (its guards and CUDA graph trees hold the modules and memory pools they
    traced), cuBLAS workspaces, then the allocator's cache.

    torch._dynamo is imported here, before any test body: its first import from inside an
    optimizer's step leaves that optimizer, and its moments, in a reference cycle."""
    import torch._dynamo
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def clear_frames(exc: BaseException | None) -> None:
    """Drop the locals of every finished frame in `exc`'s traceback and those of its causes and contexts.

    pytest keeps a failed test's exception (``sys.last_value``, for post-mortem debugging) until the
    next failure, and its traceback's frames hold the test's tensors: without this a test that ran
    out of memory would keep its models resident and fail every test after it.  Before Python 3.13 a
    frame also keeps a snapshot dict of its locals once read (pytest reads them to report the
    failure), which frame.clear() leaves: it is emptied too."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frame, tb = tb.tb_frame, tb.tb_next
            try:
                frame.clear()
            except RuntimeError:                      # still running (a caller up the stack)
                continue
            if frame.f_code.co_flags & inspect.CO_OPTIMIZED and isinstance(frame.f_locals, dict):
                frame.f_locals.clear()                # a function's snapshot, never a module's namespace
        stack += [e.__cause__, e.__context__]


def leak_message(before: int, after: int, tolerance: int = LEAK_TOLERANCE) -> str | None:
    """A failure message when `after` exceeds `before` by more than `tolerance` bytes, else None."""
    if after - before <= tolerance:
        return None
    return (f"{(after - before) / MIB:.0f} MiB of GPU memory stayed allocated after the test "
            f"({before / MIB:.0f} MiB before, {after / MIB:.0f} MiB after, tolerance {tolerance / MIB:.0f} MiB): "
            "a tensor outlives it (a module-level cache, a global, or a reference kept by a fixture)")


_last_settled: int | None = None     # the bytes allocated after the last test's settle


def baseline() -> int:
    """The bytes allocated before a test: the last test's settled figure where nothing was allocated or
    freed since (the common case; a full gc takes tenths of a second in the suite's process, and a settle
    makes two), else a fresh settle (a module fixture's model, allocated between the tests, is part of the
    baseline and not a leak)."""
    if _last_settled is not None and torch.cuda.memory_allocated() == _last_settled:
        return _last_settled
    return settle()


def guard(item) -> Iterator[None]:
    """The body of conftest's autouse fixture for a GPU test: skip where the card is smaller than the
    test's need; settle and record the allocated memory and reset the peak; after the test clear its
    exception's frames, settle again and fail it if its memory did not come back."""
    global _last_settled
    gib = need_gib(item)
    if reason := skip_reason(gib):
        pytest.skip(reason)
    before = baseline()
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_allocated() - before
    item.user_properties.append(("gpu_peak_gib", round(peak / GIB, 2)))
    if peak > gib * GIB:
        warnings.warn(GpuMemoryWarning(f"{item.nodeid}: peak {peak / GIB:.1f} GiB allocated over its baseline, "
                                       f"more than the {gib:.1f} GiB its gpu_mem mark states"))
    if CALL_EXCEPTION in item.stash:
        clear_frames(item.stash[CALL_EXCEPTION])
        del item.stash[CALL_EXCEPTION]
    _last_settled = after = settle()
    if message := leak_message(before, after):
        pytest.fail(message, pytrace=False)


# -- model-level tests ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Stats:
    params: int          # parameters of the model
    largest: int         # elements of its largest parameter


_STATS: dict[str, Stats] = {}


def model_stats(preset) -> Stats:
    """Parameter count and largest parameter of a preset's model, built on the meta device (no memory)."""
    key = repr(preset)
    if key not in _STATS:
        from liger_rt.tools.models import build_model
        model = build_model(preset, dtype=torch.bfloat16, device="meta")
        sizes = [p.numel() for p in model.parameters()]
        _STATS[key] = Stats(sum(sizes), max(sizes))
    return _STATS[key]


def parity_need(s: Stats) -> int:
    """Bytes of ``liger_rt.tools.parity.compare`` on two resident bf16 models (2 bytes a parameter).

    Per parameter, the larger of two phases:
    - the patched model's AdamW step: the baseline holds its weights, gradient copy and weights
      before and after its step (4 x 2 bytes); the patched model the same but the after copy, plus
      .grad, AdamW's two moments and one foreach temporary (7 x 2 bytes): 22, counted as 24;
    - the rows: both models' 16 bytes (17 counted), then one tensor at a time differenced in fp32,
      up to 21 bytes an element of the largest (after - before of both models, their difference
      and its abs), counted as 24.
    The baseline's AdamW is freed when its step returns: settle() has imported torch._dynamo, whose
    lazy import inside a first AdamW step would keep that optimizer in a reference cycle.
    """
    return max(24 * s.params, 17 * s.params + 24 * s.largest) + OVERHEAD


def training_need(bytes_per_param: float, extra_gib: float = 0.0) -> Callable[[Stats], int]:
    """A need of `bytes_per_param` per parameter plus `extra_gib` (activations) plus OVERHEAD."""
    return lambda s: int(bytes_per_param * s.params + extra_gib * GIB) + OVERHEAD


def gib(nbytes: int) -> float:
    """Bytes as a gpu_mem figure: GiB rounded up to a tenth."""
    return math.ceil(nbytes / GIB * 10) / 10


def need_gib_of(preset, need: Callable[[Stats], int]) -> float:
    """The gpu_mem figure of a test on `preset`'s model: gib(need(model_stats(preset)))."""
    return gib(need(model_stats(preset)))


def fewest_layers(preset) -> int:
    """The fewest layers that keep a preset's structure: a layer of each kind where it mixes attention
    with conv or linear-attention layers (LFM2, Qwen3.5), an MoE layer after dense ones (LFM2-MoE)."""
    return 2 if preset.attention_layers or (preset.experts and preset.dense_layers) else 1


def cut(preset, layers: int):
    """`preset` with its first `layers` layers: attention layers past the cut dropped (the last layer
    turned attention if none is left), dense layers leaving at least one MoE layer."""
    if layers == preset.layers:
        return preset
    attn = tuple(i for i in preset.attention_layers if i < layers) or ((layers - 1,) if preset.attention_layers else ())
    return dataclasses.replace(preset, name=f"{preset.name}-{layers}L", layers=layers, attention_layers=attn,
                               dense_layers=min(preset.dense_layers, max(layers - 1, 0)))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A model-level test case: the preset to build, its estimated need, and why it was cut."""
    preset: object         # liger_rt.tools.presets.Preset, cut
    id: str                # test id: NAME, NAME-<n>L (n layers asked for), ...-cut<m>L (m fit this card)
    need: int              # bytes
    note: str = ""         # why it was cut or cannot run
    fits: bool = True

    def param(self, *values, id_suffix: str = "", marks=()):
        """pytest.param(self, *values) with this plan's id and its gpu_mem mark (a skip if it cannot fit)."""
        marks = [pytest.mark.gpu_mem(gib=gib(self.need)), *marks]
        if not self.fits:
            marks.append(pytest.mark.skip(reason=self.note))
        return pytest.param(self, *values, id=self.id + id_suffix, marks=marks)


def free_bytes() -> int | None:
    """What a model-level test may plan to fill: 95% of the current CUDA device's free memory (the
    rest left to allocator fragmentation), None without a device."""
    return int(0.95 * card()[0]) if torch.cuda.is_available() else None


def plan_model(preset, budget: int | None, *, layers: int | None = None, need: Callable[[Stats], int] = parity_need,
               stats: Callable[..., Stats] = model_stats) -> Plan:
    """`preset` cut to `layers` (all by default) or, where that needs more than `budget` bytes (this
    card's free_bytes(); None: no limit), to the most layers that fit, never below fewest_layers.

    The need grows with the layer count, so a bisection finds the cut in a few meta builds."""
    wanted = min(layers or preset.layers, preset.layers)
    base_id = preset.name if wanted == preset.layers else f"{preset.name}-{wanted}L"

    def need_at(n):
        return need(stats(cut(preset, n)))
    full = need_at(wanted)
    if budget is None or full <= budget:
        return Plan(cut(preset, wanted), base_id, full)
    lo = min(fewest_layers(preset), wanted)
    where = f"{budget / GIB:.1f} GiB available on this GPU"
    if need_at(lo) > budget:
        return Plan(cut(preset, lo), f"{base_id}-cut{lo}L", need_at(lo), fits=False,
                    note=f"{base_id} does not fit: its fewest layers ({lo}) need {need_at(lo) / GIB:.1f} GiB, {where}")
    hi = wanted                       # need_at(lo) fits, need_at(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need_at(mid) <= budget else (lo, mid)
    return Plan(cut(preset, lo), f"{base_id}-cut{lo}L", need_at(lo),
                note=f"{preset.name} cut to {lo} of its {preset.layers} layers: {wanted} layers need "
                     f"{full / GIB:.1f} GiB, {where}")
