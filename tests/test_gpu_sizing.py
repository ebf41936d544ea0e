"""The GPU suite's CPU-side logic (tests/gpu_sizing.py) with torch.cuda faked: skip reasons from the
card's size, the leak check around each GPU test, and the layer cuts of model-level tests."""
import ast
import importlib
import types
import warnings

import pytest
import torch

import gpu_sizing as gs
from liger_rt.tools.presets import get_preset

GIB, MIB = gs.GIB, gs.MIB


class FakeCuda:
    """torch.cuda's memory functions over a counter of allocated bytes, on an H100-sized card."""

    def __init__(self, monkeypatch, total=int(79.2 * GIB), name="NVIDIA H100 80GB HBM3"):
        import torch._dynamo
        self.total, self.allocated, self.peak, self.resets = total, 0, 0, 0
        for fn, impl in {"is_available": lambda: True, "get_device_name": lambda *a: name,
                         "mem_get_info": lambda *a: (self.total - self.allocated - GIB // 2, self.total),
                         "memory_allocated": lambda *a: self.allocated,
                         "max_memory_allocated": lambda *a: max(self.peak, self.allocated),
                         "reset_peak_memory_stats": lambda *a: setattr(self, "peak", self.allocated),
                         "synchronize": lambda *a: None, "empty_cache": lambda: None}.items():
            monkeypatch.setattr(torch.cuda, fn, impl)
        monkeypatch.setattr(torch._dynamo, "reset", lambda: setattr(self, "resets", self.resets + 1))
        monkeypatch.setattr(gs.gc, "collect", lambda *a: 0)     # fake tensors go by refcount; a full gc takes 0.5 s
        monkeypatch.setattr(gs, "_last_settled", None)          # no test settled on this card yet

    def alloc(self, nbytes):
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)


class FakeTensor:
    """Holds `nbytes` of fake device memory until garbage."""

    def __init__(self, cuda, nbytes):
        self.cuda, self.nbytes = cuda, nbytes
        cuda.alloc(nbytes)

    def __del__(self):
        self.cuda.allocated -= self.nbytes


class FakeItem:
    def __init__(self, gib=None, keywords=("gpu",), path=gs.GPU_DIR / "test_x_gpu.py"):
        self.nodeid, self.path, self.keywords = "tests/gpu/test_x_gpu.py::test_x", path, set(keywords)
        self.marks = {} if gib is None else {"gpu_mem": pytest.mark.gpu_mem(gib=gib).mark}
        self.user_properties, self.stash = [], pytest.Stash()

    def get_closest_marker(self, name):
        return self.marks.get(name)


def _run_guarded(item, body):
    """Drive gs.guard as the autouse fixture does: setup, the test body, teardown."""
    fixture = gs.guard(item)
    next(fixture)
    body()
    with pytest.raises(StopIteration):
        next(fixture)


# -- needs and skips ------------------------------------------------------------------------------

def test_need_comes_from_the_closest_mark_or_the_default():
    assert gs.need_gib(FakeItem(gib=24)) == 24.0
    assert gs.need_gib(FakeItem()) == gs.DEFAULT_GIB


def test_skip_reason_names_the_need_and_the_card(monkeypatch):
    FakeCuda(monkeypatch)
    assert gs.skip_reason(78.0) is None
    reason = gs.skip_reason(88.8)
    assert "88.8 GiB" in reason and "79.2 GiB" in reason and "NVIDIA H100 80GB HBM3" in reason


def test_guard_skips_a_test_larger_than_the_card(monkeypatch):
    FakeCuda(monkeypatch)
    with pytest.raises(pytest.skip.Exception, match="needs 99.3 GiB"):
        next(gs.guard(FakeItem(gib=99.3)))
    FakeCuda(monkeypatch, total=int(139.8 * GIB), name="NVIDIA H200")
    next(gs.guard(FakeItem(gib=99.3)))


def test_every_tests_gpu_test_must_state_its_need():
    items = [FakeItem(gib=4), FakeItem(), FakeItem(keywords=()), FakeItem(path=gs.GPU_DIR.parent / "test_bench.py")]
    assert gs.unstated(items) == [items[1].nodeid]       # not CPU tests, not GPU tests outside tests/gpu


def _module_names_read(path):
    """(line, module, name) for each `alias.name` and `monkeypatch.setattr(alias, "name", ...)` of a module the file
    imports from liger_rt."""
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("liger_rt"):
            for a in node.names:
                if isinstance(getattr(importlib.import_module(node.module), a.name, None), types.ModuleType):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            yield node.lineno, aliases[node.value.id], node.attr
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "setattr" and len(node.args) > 1
              and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases
              and isinstance(node.args[1], ast.Constant)):
            yield node.lineno, aliases[node.args[0].id], node.args[1].value


def test_gpu_tests_read_only_names_their_modules_have():
    """CI runs no GPU test, so a name a GPU test reads or monkeypatches on a liger_rt module is checked here:
    a private helper that moved to another file is missing from its old home, and monkeypatching a name the
    module lacks fails the test on the GPU."""
    missing = [f"{path.name}:{line}: {module}.{name}" for path in sorted(gs.GPU_DIR.glob("test_*.py"))
               for line, module, name in _module_names_read(path) if not hasattr(importlib.import_module(module), name)]
    assert not missing, missing


# -- the leak check ---------------------------------------------------------------------------------

def test_memory_given_back_passes_and_the_peak_is_recorded(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    cuda.alloc(300 * MIB)                                # another test's cache: part of the baseline
    item = FakeItem(gib=8)

    def body():
        t = FakeTensor(cuda, 2 * GIB)
        del t
    _run_guarded(item, body)
    assert item.user_properties == [("gpu_peak_gib", 2.0)]
    assert cuda.resets == 2                              # dynamo's compiled code dropped before and after


def test_the_next_test_starts_from_the_last_settle_unless_memory_moved(monkeypatch):
    """Back-to-back tests settle once between them; memory allocated between them (a module fixture's
    model) is settled into the next test's baseline, not taken for that test's leak."""
    cuda = FakeCuda(monkeypatch)
    _run_guarded(FakeItem(gib=8), lambda: None)
    assert cuda.resets == 2
    _run_guarded(FakeItem(gib=8), lambda: None)
    assert cuda.resets == 3                              # its baseline is the first test's last settle
    model = FakeTensor(cuda, 3 * GIB)                    # noqa: F841 (a module fixture's, alive through the test)
    _run_guarded(FakeItem(gib=8), lambda: None)
    assert cuda.resets == 5


def test_a_leak_fails_the_test_that_leaked_with_the_figure(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    kept = []
    fixture = gs.guard(FakeItem(gib=8))
    next(fixture)
    kept.append(FakeTensor(cuda, 100 * MIB))
    with pytest.raises(pytest.fail.Exception, match="100 MiB of GPU memory stayed allocated.*tolerance 64 MiB"):
        next(fixture)


def test_small_first_use_caches_are_tolerated(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    kept = []
    _run_guarded(FakeItem(gib=8), lambda: kept.append(FakeTensor(cuda, 32 * MIB)))   # a cuBLAS workspace


def _fail_holding(cuda, nbytes):
    activations = FakeTensor(cuda, nbytes)       # noqa: F841 (held by this frame, as a test's tensors are)
    raise torch.OutOfMemoryError("CUDA out of memory")


def _read_locals(exc):
    """What pytest does to report a failure: read every frame's locals (before Python 3.13 this leaves
    a snapshot dict of them on the frame, which frame.clear() does not empty)."""
    tb = exc.__traceback__
    while tb is not None:
        tb.tb_frame.f_locals
        tb = tb.tb_next


@pytest.mark.parametrize("stashed", [True, False])
def test_a_failed_tests_frames_are_cleared(monkeypatch, stashed):
    """A test that raised keeps its tensors in its traceback's frames (pytest keeps the exception):
    the guard clears the frames of the exception conftest stashed, so nothing is left allocated."""
    cuda = FakeCuda(monkeypatch)
    item = FakeItem(gib=8)
    fixture = gs.guard(item)
    next(fixture)
    try:
        _fail_holding(cuda, 5 * GIB)
    except torch.OutOfMemoryError as exc:
        held = exc                                   # what pytest's CallInfo / sys.last_value keep
    _read_locals(held)
    if stashed:
        item.stash[gs.CALL_EXCEPTION] = held
        with pytest.raises(StopIteration):
            next(fixture)
        assert gs.CALL_EXCEPTION not in item.stash
        assert cuda.allocated == 0
    else:                                            # the check itself: the frame still holds 5 GiB
        with pytest.raises(pytest.fail.Exception, match="5120 MiB"):
            next(fixture)
        gs.clear_frames(held)
        assert cuda.allocated == 0


def test_clear_frames_follows_causes_and_contexts(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    try:
        try:
            _fail_holding(cuda, GIB)
        except torch.OutOfMemoryError:
            raise RuntimeError("while handling")      # noqa: B904 (a context, as a failing cleanup gives)
    except RuntimeError as exc:
        held = exc
    assert cuda.allocated == GIB
    gs.clear_frames(held)
    assert cuda.allocated == 0


def test_a_peak_above_the_stated_need_warns(monkeypatch):
    cuda = FakeCuda(monkeypatch)

    def body():
        t = FakeTensor(cuda, 10 * GIB)
        del t
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_guarded(FakeItem(gib=8), body)
    assert [w.category for w in caught] == [gs.GpuMemoryWarning]
    assert "peak 10.0 GiB" in str(caught[0].message) and "8.0 GiB" in str(caught[0].message)


# -- model-level tests: needs and layer cuts -----------------------------------------------------------

def _linear_stats(preset):
    """1 GiB of parameters a layer beside 4 GiB of embeddings (in 'parameters' of one byte)."""
    return gs.Stats(params=4 * GIB + preset.layers * GIB, largest=GIB)


def _bytes(s):
    return s.params


def test_plan_keeps_the_model_where_it_fits():
    p = get_preset("qwen3-tiny")                     # 2 layers
    plan = gs.plan_model(p, 100 * GIB, need=_bytes, stats=_linear_stats)
    assert (plan.id, plan.preset.layers, plan.need, plan.note) == ("qwen3-tiny", 2, 6 * GIB, "")
    plan = gs.plan_model(p, None, layers=1, need=_bytes, stats=_linear_stats)       # no device: no cut
    assert (plan.id, plan.preset.layers) == ("qwen3-tiny-1L", 1)


def test_plan_cuts_to_the_most_layers_that_fit_and_says_so():
    p = get_preset("gemma3-4b")                      # 34 layers
    plan = gs.plan_model(p, int(30.5 * GIB), need=_bytes, stats=_linear_stats)
    assert plan.preset.layers == 26 and plan.id == "gemma3-4b-cut26L" and plan.need == 30 * GIB
    assert "gemma3-4b cut to 26 of its 34 layers" in plan.note and "38.0 GiB" in plan.note
    plan = gs.plan_model(p, int(30.5 * GIB), layers=16, need=_bytes, stats=_linear_stats)
    assert plan.id == "gemma3-4b-16L" and plan.fits        # 16 layers asked for: 20 GiB fits


def test_plan_that_cannot_fit_skips_with_the_figures():
    plan = gs.plan_model(get_preset("gemma3-4b"), 4 * GIB, need=_bytes, stats=_linear_stats)
    assert not plan.fits and plan.preset.layers == 1
    param = plan.param(id_suffix="-x")
    assert param.id == "gemma3-4b-cut1L-x"
    names = [m.name for m in param.marks]
    assert names == ["gpu_mem", "skip"]
    assert "fewest layers (1) need 5.0 GiB, 4.0 GiB available" in param.marks[1].kwargs["reason"]
    assert param.marks[0].kwargs == {"gib": 5.0}


def test_cuts_keep_each_kind_of_layer():
    lfm2_moe = gs.cut(get_preset("lfm2-8b-a1b"), 2)          # 2 dense layers, attention at 2, 6, ...
    assert (lfm2_moe.attention_layers, lfm2_moe.dense_layers, lfm2_moe.name) == ((1,), 1, "lfm2-8b-a1b-2L")
    qwen35 = gs.cut(get_preset("qwen3.5-35b-a3b"), 4)        # full attention every 4th layer
    assert qwen35.attention_layers == (3,)
    assert gs.fewest_layers(get_preset("lfm2-8b-a1b")) == gs.fewest_layers(get_preset("lfm2-1.2b")) == 2
    assert gs.fewest_layers(get_preset("mistral-7b")) == 1
    assert gs.cut(get_preset("mistral-7b"), 32) is get_preset("mistral-7b")


@pytest.mark.slow
def test_model_stats_count_the_built_model():
    from liger_rt.tools.models import build_model
    p = get_preset("qwen3-moe-tiny")
    sizes = [t.numel() for t in build_model(p).parameters()]
    assert gs.model_stats(p) == gs.Stats(sum(sizes), max(sizes))


def test_parity_need_is_the_larger_phase():
    step = gs.Stats(params=10 ** 9, largest=10 ** 8)         # the AdamW step dominates
    assert gs.parity_need(step) == 24 * 10 ** 9 + gs.OVERHEAD
    rows = gs.Stats(params=10 ** 9, largest=5 * 10 ** 8)     # one huge tensor: the diff rows dominate
    assert gs.parity_need(rows) == 17 * 10 ** 9 + 24 * 5 * 10 ** 8 + gs.OVERHEAD
    assert gs.gib(gs.parity_need(step)) == 24.4


def test_clear_frames_leaves_a_module_namespace_alone():
    namespace = {"__name__": "some_module"}
    with pytest.raises(ZeroDivisionError) as info:
        exec("kept = 1\n1 / 0", namespace)           # a module-level frame: its f_locals is the namespace
    gs.clear_frames(info.value)
    assert namespace["kept"] == 1


@pytest.mark.slow
def test_plans_on_an_80_gb_h100():
    """With an H100's free memory (78.6 of 79.2 GiB), every model case whose two resident models fit
    80 GB keeps its layers; only those that cannot are cut, to most of their depth."""
    budget = int(0.95 * 78.6 * GIB)                 # free_bytes() there
    plans = {name: gs.plan_model(get_preset(name), budget, layers=layers)
             for name, layers in [("gemma3-4b", None), ("mistral-7b", 16), ("mixtral-8x7b", 2), ("qwen2.5-7b", 14),
                                  ("qwen3.5-35b-a3b", 4), ("qwen1.5-moe-a2.7b", 4), ("glm4-9b", 4)]}
    assert {name: plan.id for name, plan in plans.items()} == {
        "gemma3-4b": "gemma3-4b-cut27L", "mistral-7b": "mistral-7b-16L-cut13L", "mixtral-8x7b": "mixtral-8x7b-2L",
        "qwen2.5-7b": "qwen2.5-7b-14L-cut9L", "qwen3.5-35b-a3b": "qwen3.5-35b-a3b-4L-cut2L",
        "qwen1.5-moe-a2.7b": "qwen1.5-moe-a2.7b-4L", "glm4-9b": "glm4-9b-4L"}
    assert all(plan.need <= budget and plan.fits for plan in plans.values())
