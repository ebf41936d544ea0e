"""The op spec itself: configs validate, the hash sees code not comments, the generated custom ops
compile without graph breaks and decide per bucket at trace time."""
import dataclasses
import textwrap
import types

import pytest
import torch

import toy_op
from liger_rt import dispatch, opspec
from liger_rt.opspec import Config, ConfigError, knob, pow2


@dataclasses.dataclass(frozen=True)
class Tile(Config):
    BLOCK_M: int = knob(64, pow2(16, 256))
    num_warps: int = knob(4, (4, 8))


@dataclasses.dataclass(frozen=True)
class Nested(Config):
    up: Tile = Tile()
    down: Tile = Tile(BLOCK_M=128, num_warps=8)
    scale: float = knob(1.0, (0.5, 1.0))


def test_config_validates_types_and_choices():
    with pytest.raises(ConfigError, match="BLOCK_M=48 is not one of 16, 32, 64, 128, 256"):
        Tile(BLOCK_M=48)
    with pytest.raises(ConfigError, match="must be int"):
        Tile(BLOCK_M=True)
    with pytest.raises(ConfigError, match="must be int"):
        Tile(BLOCK_M=64.0)
    assert Nested().limits() == (8, 1)


@pytest.mark.parametrize("data, why", [
    ('{"up": {"BLOCK_M": 64, "num_warps": 4}}', "missing"),
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ({"up": {"BLOCK_M": 0, "num_warps": 4}, "down": {"BLOCK_M": 64, "num_warps": 4}, "scale": 1.0}, "is not one of"),
    ({"up": [], "down": {"BLOCK_M": 64, "num_warps": 4}, "scale": 1.0}, "JSON object"),
    ({"up": {"BLOCK_M": 64, "num_warps": 4}, "down": {"BLOCK_M": 64, "num_warps": 4}, "scale": 1.0, "x": 1}, "unknown"),
    ({"up": {"BLOCK_M": 64, "num_warps": 4}, "down": {"BLOCK_M": 64, "num_warps": 4}, "scale": float("nan")}, "not one of"),
])
def test_parse_refuses_what_is_not_declared(data, why):
    with pytest.raises(ConfigError, match=why):
        Nested.parse(data)


def test_parse_round_trips_and_configs_hash_as_values():
    cfg = Nested(up=Tile(BLOCK_M=32))
    back = Nested.parse(cfg.to_dict())
    assert back == cfg and hash(back) == hash(cfg) and dict(back)["scale"] == 1.0


def _fn_from(src: str):
    ns = {"__name__": "liger_rt.kernels._hash_probe"}
    exec(compile(textwrap.dedent(src), "<probe>", "exec"), ns)
    fn = ns["f"]
    return types.FunctionType(fn.__code__, ns, "f")


def test_hash_ignores_comments_and_docstrings_but_not_code(monkeypatch):
    monkeypatch.setattr(opspec.inspect, "getsource", lambda fn: fn.__src__)

    def norm(src):
        fn = _fn_from(src)
        fn.__src__ = textwrap.dedent(src)
        return opspec._normalised_source(fn)

    base = norm('def f(x):\n    return x + 1\n')
    assert norm('def f(x):\n    """Adds one."""\n    # why: a comment\n    return x + 1  # trailing\n') == base
    assert norm('def f(x):\n    return x + 2\n') != base


def test_toy_hash_covers_kernel_and_launcher():
    names = {f.__qualname__ for f in opspec._reachable([toy_op._forward, toy_op._backward])}
    assert {"_forward", "_backward", "toy_triton", "_toy_kernel"} <= names


def test_hash_covers_the_methods_of_a_helper_class():
    """MoE's launch code builds its tile schedule in `_Routing` methods and a kernel they launch: a change
    there changes the grid, so the freshness hash must see it."""
    from liger_rt.kernels import moe_experts as M
    roots = [f for i in M.OP.impls for f in (i.forward, i.backward) if f is not None]
    names = {f.__qualname__ for f in opspec._reachable(roots)}
    assert {"_Routing.tiles", "_Routing.sort", "_moe_tiles_kernel", "_n_tiles"} <= names


def test_traced_exact_and_bucket():
    for v in (1, 2, 3, 40, 64, 65, 1000):
        assert opspec._traced_exact(v) == v
        assert opspec.bucket(v) == (1 << (v - 1).bit_length())


def test_toy_compiles_fullgraph_and_decides_per_bucket(monkeypatch):
    """Zero graph breaks (fullgraph); one decision per bucket of rows, taken at trace time; the
    Triton pair runs as the generated custom ops, gradients included."""
    decided = []
    real = toy_op.OP.select
    monkeypatch.setattr(toy_op.OP, "select", lambda x, **dims: decided.append(dims["rows"]) or real(x, **dims))
    dispatch.reset()
    torch._dynamo.reset()
    f = torch.compile(lambda x: toy_op.toy(x) + 1.0, backend="aot_eager", fullgraph=True, dynamic=True)
    before = toy_op.CALLS["triton"]
    for rows in (3, 4, 9):
        x = torch.randn(rows, 40, requires_grad=True)
        y = f(x)
        torch.testing.assert_close(y, x.detach() * 2 + 1)
        y.sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    assert decided == [4, 16]
    assert toy_op.CALLS["triton"] - before == 3


def test_integer_inputs_are_refused_with_the_accepted_list():
    with pytest.raises(TypeError, match="accepted: torch.float32, torch.bfloat16, torch.float16"):
        toy_op.toy(torch.ones(2, 3, dtype=torch.int64))


def test_every_generated_custom_op_has_a_schema_inductor_can_read():
    """Inductor reads each custom op's schema into an inspect.Signature while lowering: a duplicate
    parameter name (fused_linear_cross_entropy's `int grads` beside the backward's gradients) failed
    there on the H200, and only with backend="inductor"."""
    from torch.fx.operator_schemas import get_signature_for_torch_op

    from liger_rt import dispatch
    ops = [dispatch.get_op(name) for name in dispatch.OP_MODULES]
    assert len(ops) >= 10, sorted(opspec.REGISTERED)
    for op in ops:
        op._custom_ops
        for half in ("fwd", "bwd"):
            overload = getattr(getattr(torch.ops.liger_rt, f"{op.name}_{half}"), "default")
            assert get_signature_for_torch_op(overload), f"{op.name}_{half}"


def test_each_generated_op_has_exactly_one_fake():
    """torch 2.11 (the H200 image) refuses a second register_fake for an op; newer torch replaces
    the first one silently.  rope's backward fake was registered twice (the runtime's, then the
    kernel file's own), which only the H200 saw: every fake comes through the spec, once."""
    from torch._library.simple_registry import singleton

    from liger_rt import dispatch
    for name in dispatch.OP_MODULES:
        op = dispatch.get_op(name)
        op._custom_ops
        for half in ("fwd", "bwd"):
            kernels = singleton.find(f"liger_rt::{op.name}_{half}").fake_impl.kernels
            assert len(kernels) == 1, f"{op.name}_{half}: {len(kernels)} fake implementations registered"
