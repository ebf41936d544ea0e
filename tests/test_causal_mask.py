"""The ``causal_mask`` flag (liger_rt/layers/attention.py): under torch.compile a patched model given no
padding mask runs SDPA on ``is_causal`` with no mask, as transformers does eagerly.  transformers 5.17
(the H200 image's) never skips the mask while compiling; the compile tests simulate that release by
making its rule answer False under dynamo, so they fail here too if the swap stops working."""
from __future__ import annotations

import gc
import itertools

import pytest
import torch
from transformers import masking_utils

import liger_rt
from liger_rt import _swaps
from liger_rt.layers import attention
from liger_rt.patch import specs
from liger_rt.tools.models import build_model


@pytest.fixture(autouse=True)
def _clean():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()
    assert not _swaps.LEDGER


def test_rule_answers_as_transformers_does_eagerly():
    """Against transformers' own rule, called eagerly: no padding mask, every size, offset and window;
    with a padding mask (none, some padded) ours hands the question to it."""
    hf = attention._HF_RULE
    for q, kv, q_off, kv_off, local in itertools.product((1, 5, 16), (1, 5, 16, 24), (0, 3), (0, 2), (None, 4, 64)):
        ours = attention.ignore_causal_mask_sdpa(None, q, kv, q_off, kv_off, local)
        assert ours == hf(None, q, kv, q_off, kv_off, local), (q, kv, q_off, kv_off, local)
    padded = torch.ones(2, 16, dtype=torch.bool)
    padded[1, :3] = False
    for mask in (torch.ones(2, 16, dtype=torch.bool), padded):
        assert attention.ignore_causal_mask_sdpa(mask, 16, 16, 0, 0) == hf(mask, 16, 16, 0, 0)


def _old_transformers_rule(monkeypatch):
    """transformers 5.17 under torch.compile: never skip the mask."""
    real = masking_utils._ignore_causal_mask_sdpa
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa",
                        lambda *a, **k: False if torch.compiler.is_compiling() else real(*a, **k))


def _compiled_step(model, ids, mask=None):
    """(loss, grads, [(sdpa got a mask, is_causal)]) of a compiled forward+backward (graphs run eagerly)."""
    seen = []

    def backend(gm, _inputs):
        for node in gm.graph.nodes:
            if "scaled_dot_product_attention" in str(node.target):
                has_mask = node.kwargs.get("attn_mask") is not None or (len(node.args) > 3 and node.args[3] is not None)
                seen.append((has_mask, node.kwargs.get("is_causal")))
        return gm.forward

    model.zero_grad()
    loss = torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], seen


def _eager_step(model, ids, mask=None):
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("preset", ["qwen3-tiny", "lfm2-tiny"])
def test_compiled_model_without_padding_keeps_sdpa_on_is_causal(preset, monkeypatch):
    _old_transformers_rule(monkeypatch)
    torch.manual_seed(0)
    model = build_model(preset, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    ref_loss, ref_grads = _eager_step(model, ids)
    *_, seen = _compiled_step(model, ids)
    assert seen and all(has_mask for has_mask, _ in seen), seen          # the old rule: a mask while compiling
    torch._dynamo.reset()
    layer_flags = [f for f in specs.flags(specs.SPECS[model.config.model_type]) if f not in specs.COMMON_FLAGS]
    liger_rt.patch(model, **dict.fromkeys(layer_flags, False))          # only the mask rule (on by default)
    assert liger_rt.patch.describe(model)["flags"]["causal_mask"]
    loss, grads, seen = _compiled_step(model, ids)
    assert seen and all(not has_mask and causal for has_mask, causal in seen), seen
    torch.testing.assert_close(loss, ref_loss)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)
    liger_rt.unpatch(model)
    assert masking_utils._ignore_causal_mask_sdpa is not attention.ignore_causal_mask_sdpa


def test_a_padding_mask_is_still_built_and_honoured(monkeypatch):
    _old_transformers_rule(monkeypatch)
    torch.manual_seed(1)
    model = build_model("qwen3-tiny", dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0                                                     # left padding in the first row
    ref_loss, ref_grads = _eager_step(model, ids, mask)
    liger_rt.patch(model, rms_norm=False, swiglu=False)
    loss, grads, seen = _compiled_step(model, ids, mask)
    assert seen and all(has_mask for has_mask, _ in seen), seen
    torch.testing.assert_close(loss, ref_loss)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)


def test_causal_mask_false_leaves_transformers_rule_alone():
    model = build_model("qwen3-tiny", dtype=torch.float32)
    host = masking_utils._ignore_causal_mask_sdpa
    liger_rt.patch(model, causal_mask=False)
    assert masking_utils._ignore_causal_mask_sdpa is host and not liger_rt.patch.describe(model)["flags"]["causal_mask"]
    liger_rt.patch(model)
    assert masking_utils._ignore_causal_mask_sdpa is attention.ignore_causal_mask_sdpa
    assert "causal_mask" not in liger_rt.patch.describe(model)["patched"]      # a rule, not a module on an op
    liger_rt.unpatch(model)
    assert masking_utils._ignore_causal_mask_sdpa is host


def test_fused_loss_without_a_cache_keeps_sdpa_on_is_causal(monkeypatch):
    """The fused loss asks for no KV cache; transformers then looks for packed sequences in the position
    ids, which it cannot read while compiling (a mask every step).  The flag answers "not packed" while the
    model runs on positions it made itself, and leaves positions the caller passed to transformers."""
    _old_transformers_rule(monkeypatch)
    monkeypatch.setenv("LIGER_RT_DISABLE", "1")             # every op on its torch reference: this is about masks
    from liger_rt import dispatch
    dispatch.reset()
    torch.manual_seed(2)
    model = build_model("qwen3-tiny", dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    ref_loss, ref_grads = _eager_step(model, ids)
    liger_rt.patch(model, rms_norm=False, swiglu=False, fused_linear_cross_entropy=True)
    asked = []
    monkeypatch.setattr(attention, "_HF_PACKED", lambda p: asked.append(p))
    out = model(input_ids=ids, labels=ids)
    assert out.past_key_values is None and asked == []             # eager: no cache, the positions not read
    loss, grads, seen = _compiled_step(model, ids)
    assert seen and all(not has_mask and causal for has_mask, causal in seen), seen
    assert asked == [] and attention._OWN_POSITIONS.depth == 0
    torch.testing.assert_close(loss, ref_loss)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)
    positions = torch.arange(12).expand(2, 12)
    model(input_ids=ids, labels=ids, position_ids=positions)      # the caller's positions: a cache, as before
    assert asked == []
    model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False)
    assert len(asked) == 1 and asked[0] is positions      # no cache, the caller's positions: transformers reads them
    liger_rt.unpatch(model)
    assert masking_utils.find_packed_sequence_indices is not attention.find_packed_sequence_indices


def test_own_positions_answer_only_the_thread_that_made_them():
    """One thread's fused forward (on positions it made) never answers for another thread's call, which
    passed packed positions."""
    import threading
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    want = attention._HF_PACKED(packed)
    assert want is not None                                           # transformers finds two sequences
    seen = {}
    attention.enter_own_positions()
    try:
        other = attention.find_packed_sequence_indices
        worker = threading.Thread(target=lambda: seen.setdefault("other", other(packed)))
        worker.start()
        worker.join()
        assert attention.find_packed_sequence_indices(packed) is None
    finally:
        attention.leave_own_positions()
    torch.testing.assert_close(seen["other"], want)
    torch.testing.assert_close(attention.find_packed_sequence_indices(packed), want)


def test_own_positions_state_costs_no_recompile_in_a_fresh_thread():
    """A thread's first compiled call, before any eager call set the state, and its later ones see the
    same state: one graph for compiled, eager, compiled (a missing attribute once made dynamo guard on
    its absence and recompile after the first eager call)."""
    import threading
    graphs, out = [], {}

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x):
        attention.enter_own_positions()
        y = x * 2 if attention.find_packed_sequence_indices(x) is None else x
        attention.leave_own_positions()
        return y

    def run():
        torch._dynamo.reset()
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        x = torch.arange(6.0)
        out["first"] = compiled(x)
        step(x)                                 # eager, in between
        out["second"] = compiled(x + 1)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert len(graphs) == 1
    torch.testing.assert_close(out["second"], (torch.arange(6.0) + 1) * 2)


def test_leaving_own_positions_without_entering_raises():
    with pytest.raises(RuntimeError, match="without a matching enter_own_positions"):
        attention.leave_own_positions()
    assert attention._OWN_POSITIONS.depth == 0
