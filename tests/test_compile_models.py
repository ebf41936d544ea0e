"""torch.compile(fullgraph=True) of every supported family, instance-patched with every layer flag it
takes, rope where it has a rope row and the fused loss (specs.parity_flags plus the layer flags off by
default), and of Qwen3 with the other loss heads (cross_entropy with kept logits, logprobs): no graph
break, a training step (loss and every gradient) that matches the eager patched model, every routed
op on its Triton kernel inside the graph, no recompile on a second call of the same shapes, and
losses that match the unpatched Hugging Face model.  Tiny presets cut to one or two decoder layers
(hidden 64), 2 x 8 tokens, fp32, the Triton kernels through the interpreter.
"""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import liger_rt
from liger_rt import _swaps, dispatch
from liger_rt.patch import core, specs
from liger_rt.registry import REGISTRY
from liger_rt.tools.models import build_model
from liger_rt.tools.parity import make_inputs
from liger_rt.tools.presets import get_preset
from routing import record_impls

# dynamo and AOTAutograd with inductor's decompositions and partitioner, graphs run eagerly (no codegen);
# plain aot_eager fails the unpatched Qwen3.5 backward (a view of softplus_backward's output)
BACKEND = "aot_eager_decomp_partition"

# flags with no module to replace in the tiny model: Qwen3-MoE's every layer is sparse (no dense MLP)
NO_MODULE = {"qwen3_moe": {"swiglu"}}

pytestmark = [pytest.mark.filterwarnings("ignore:.*(causal_conv1d|flash-linear-attention|overflow encountered).*"),
              # a memoised liger_rt function traced by dynamo (it ignores the cache and warns once per process)
              pytest.mark.filterwarnings("error:Dynamo detected a call to a .functools.lru_cache.-wrapped function")]


def _family(model_type):
    why = specs.unavailable(model_type)
    return pytest.param(model_type, marks=pytest.mark.skipif(why is not None, reason=str(why)), id=model_type)


@pytest.fixture(autouse=True)
def _clean():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    for model_type in list(core._CLASS_RECORDS):
        core.unpatch(model_type)
    if _swaps.LEDGER:           # a failed test's models hold module-wide swaps (rope) until they die
        gc.collect()
    assert not _swaps.LEDGER


def _ops(model_type: str, flags, keep_logits: bool = False) -> set[str]:
    """The ops the flags route through (every one of them must run a Triton kernel)."""
    spec = specs.SPECS[model_type]
    rows = specs.rows(spec) + specs.function_rows(spec)
    ops = {row.op for _, _, row in rows if row.op and flags.get(row.flag)}
    ops |= {op for flag, op in specs.LOSS_OPS.items() if flags.get(flag)}
    if keep_logits:                            # the host forward runs, the fused heads stay idle
        ops -= {"fused_linear_cross_entropy", "fused_linear_logprobs"}
    return ops


def _preset(model_type):
    """The family's tiny preset cut to the fewest decoder layers that still hold one of each kind of
    layer: LFM2's conv and attention layers (LFM2-MoE: a dense and a sparse one), Qwen3.5's linear
    and full attention; one layer elsewhere (Gemma 3: a sliding-window one)."""
    p = get_preset("tiny", model_type)
    if p.model_type == "qwen3_5_moe_text":
        return p                                                    # linear attention, then full attention
    if p.attention_layers:                                          # the LFM2 families
        return dataclasses.replace(p, layers=2, vision_layers=min(p.vision_layers, 1))
    config = dict(p.config)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:1]
    return dataclasses.replace(p, layers=1, config=config)


def _inputs(model, seed):
    inputs = make_inputs(model, seed=seed)
    inputs["labels"] = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    return inputs


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _every_flag(model_type: str) -> dict[str, bool]:
    """specs.parity_flags (the defaults, rope where the family has a rope row, the fused loss) plus
    the layer flags that are off by default (LFM2-VL's vision LayerNorm)."""
    spec = specs.SPECS[model_type]
    layers = [f for f in specs.flags(spec) if f not in specs.COMMON_FLAGS]
    return {**dict.fromkeys(layers, True), **specs.parity_flags(model_type)}


def _hf_loss(model, inputs):
    return model(**inputs).loss


def _rl_loss(logprobs, entropy, labels):
    return -(logprobs.sum() + 0.1 * entropy.sum()) / (labels[:, 1:] != -100).sum()


def _patched_rl_loss(model, inputs):
    out = model(**inputs)
    return _rl_loss(out.logprobs, out.entropy, inputs["labels"])


def _hf_rl_loss(model, inputs):
    """The same scalar from the host's logits (log-softmax at the next token)."""
    labels = inputs["labels"]
    lp = torch.log_softmax(model(**{k: v for k, v in inputs.items() if k != "labels"}).logits[:, :-1].float(), -1)
    target = labels[:, 1:]
    valid = target != -100
    logprobs = lp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    entropy = -(lp.exp() * lp).sum(-1) * valid
    return _rl_loss(logprobs, entropy, labels)


def _skip_if_the_host_breaks(base, inputs, reference, exc):
    """Skip when the unpatched Hugging Face model does not compile with fullgraph=True either (then no
    patched one can): e.g. transformers 5.17's LFM2-VL image features loop over the images with
    data-dependent sizes (5.24's do not), which torch 2.11's dynamo refuses.  Returns when the host
    compiles: the failure `exc` is ours."""
    torch._dynamo.reset()
    try:
        reference(torch.compile(base, backend=BACKEND, fullgraph=True), inputs)
    except torch._dynamo.exc.TorchDynamoException as host:
        import transformers
        why = (str(host).strip().splitlines() or [type(host).__name__])[0]
        pytest.skip(f"the unpatched {type(base).__name__} does not compile with fullgraph=True under transformers "
                    f"{transformers.__version__}, torch {torch.__version__}: {why}")


def _check_compiled_step(model_type, flags, loss_of, reference, monkeypatch, policy="fuse"):
    """Patch with `flags`; the model compiled under LIGER_RT_COMPILE_POLICY=`policy`: one graph (fullgraph),
    every op the patch routes through ran its Triton kernel (under `fuse` the ops the compiler fuses: their
    torch implementation), the loss and gradients of the eager model, a second call of the same shapes
    reuses the graph, and both losses match `reference` on HF's model."""
    monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", policy)
    dispatch.reset()
    fusable = {name for name in REGISTRY.names() if REGISTRY.get(name).compiler_fuses}
    assert {"rms_norm", "swiglu", "rope"} <= fusable and "fused_linear_cross_entropy" not in fusable
    to_compiler = fusable if policy == "fuse" else set()
    preset = _preset(model_type)
    base = build_model(preset)
    model = build_model(preset)                                 # same seed: the same weights
    liger_rt.patch(model, **flags)
    patched = liger_rt.patch.describe(model)["patched"]
    on = {flag for flag, value in flags.items() if value and flag != "keep_logits"}    # keep_logits replaces nothing
    assert set(patched) == on - NO_MODULE.get(model_type, set()), patched
    inputs = _inputs(model, seed=0)

    # another model patched with rope holds a module-wide swap in the ledger during the trace, and lets
    # go before the second call: a compiled model must not read (and guard on) the ledger
    other = build_model(get_preset("tiny", "llama" if model_type != "llama" else "qwen3"))
    liger_rt.patch(other, rope=True)

    routed = _ops(model_type, patched, keep_logits=flags.get("keep_logits", False))
    ran = {name: record_impls(monkeypatch, REGISTRY.get(name)) for name in routed - to_compiler}
    kernel_runs = []       # the compiler's ops: their Triton forward must never run (their torch one is
    for name in routed & to_compiler:       # traced, and a recording wrapper there would be traced too)
        triton_impl = REGISTRY.get(name).impl("triton")
        monkeypatch.setattr(triton_impl, "forward", lambda *a, _real=triton_impl.forward, _name=name:
                            kernel_runs.append(_name) or _real(*a))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(BACKEND)(gm, example_inputs)

    # compiled first: every dispatch decision is taken cold, at trace time
    compiled = torch.compile(model, backend=backend, fullgraph=True)     # fullgraph: a break raises
    try:
        loss = loss_of(compiled, inputs)
    except torch._dynamo.exc.TorchDynamoException as exc:
        _skip_if_the_host_breaks(base, inputs, reference, exc)
        raise
    loss.backward()
    assert len(graphs) == 1
    assert {name: "triton" in impls for name, impls in ran.items()} == dict.fromkeys(ran, True), ran
    assert not kernel_runs, kernel_runs
    got = _grads(model)
    model.zero_grad(set_to_none=True)

    eager = loss_of(model, inputs)
    eager.backward()
    want = _grads(model)
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    liger_rt.unpatch(other)
    second = _inputs(model, seed=1)                             # same shapes, other tokens: no recompile
    loss2 = loss_of(compiled, second)
    assert len(graphs) == 1
    with torch.no_grad():                                       # independent reference: Hugging Face's model
        torch.testing.assert_close(loss.detach(), reference(base, inputs), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss2.detach(), reference(base, second), rtol=1e-5, atol=1e-5)
    liger_rt.unpatch(model)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [_family(m) for m in specs.ALLOWLIST])
def test_compiled_training_step_matches_eager(model_type, monkeypatch):
    flags = _every_flag(model_type)
    _check_compiled_step(model_type, flags, _hf_loss, _hf_loss, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("loss_flags,loss_of,reference", [
    # logits kept (keep_logits): the host forward runs and its loss goes through ops.cross_entropy
    (dict(fused_linear_cross_entropy=True, keep_logits=True, cross_entropy=True), _hf_loss, _hf_loss),
    (dict(fused_linear_cross_entropy=False, logprobs=True), _patched_rl_loss, _hf_rl_loss),   # RL: log-probs, entropy
], ids=["cross_entropy-keep_logits", "logprobs"])
def test_compiled_loss_heads_match_eager(loss_flags, loss_of, reference, monkeypatch):
    """The other loss flags, on Qwen3 with its layer flags and rope."""
    flags = {**specs.parity_flags("qwen3"), **loss_flags}
    _check_compiled_step("qwen3", flags, loss_of, reference, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3", "lfm2", "lfm2_moe"])
def test_compile_policy_kernels_keeps_every_op_on_its_kernel(model_type, monkeypatch):
    """LIGER_RT_COMPILE_POLICY=kernels with every flag: the norms, SwiGLU and RoPE stay on their Triton
    kernels as custom ops too (the default, fuse, traces them as torch code); same checks otherwise."""
    _check_compiled_step(model_type, _every_flag(model_type), _hf_loss, _hf_loss, monkeypatch, policy="kernels")


@pytest.mark.slow
def test_token_count_changes_do_not_recompile():
    """A patched model compiled once, the token dim marked dynamic as a user marks it for variable-length
    batches (torch._dynamo.mark_dynamic), runs training steps at token counts in three power-of-two buckets
    without a recompile: neither the patched layers nor liger_rt's traced op calls guard on the token count.
    (Unmarked, dynamo's default recompiles once, to a dynamic graph, on the first new count.)"""
    model = build_model(_preset("qwen3"))
    liger_rt.patch(model, **specs.parity_flags("qwen3"))                 # norms, SwiGLU, rope, the fused loss
    compiled = torch.compile(model, backend=BACKEND, fullgraph=True)

    def step(tokens):
        ids = torch.randint(1, model.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(tokens))
        mask = torch.ones_like(ids)
        mask[1, tokens - 3:] = 0                                            # the second sample padded
        labels = ids.masked_fill(mask == 0, -100)
        for t in (ids, mask, labels):
            torch._dynamo.mark_dynamic(t, 1)
        compiled(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    try:
        step(6)                                                             # the one compile
        with torch._dynamo.config.patch(error_on_recompile=True):
            step(11)
            step(20)
    finally:
        liger_rt.unpatch(model)             # a recompile's traceback keeps the model, and its rope swap, alive
