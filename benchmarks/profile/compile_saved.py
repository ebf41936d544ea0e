"""What a compiled training step's forward saves for its backward, per LIGER_RT_COMPILE_POLICY (any machine).

    TRITON_INTERPRET=1 python benchmarks/profile/compile_saved.py [--seq 512] [--layers 2]

Qwen3-1.7B's layer widths (vocab cut to 8192), bf16, batch 1: the unpatched model, then liger_rt-patched
(rope and the fused loss) under each policy. AOTAutograd's min-cut partition, with inductor's decomposition
table, runs on fake tensors and the forward compiler stops there, so nothing executes: the figure is the bytes
of the forward graph's outputs that are activations (graph inputs such as the weights excluded; each storage
once), and the largest of them. For comparison, the eager step's saved storages (saved-tensor hooks) of the
unpatched and the patched model.
"""
import argparse
import contextlib
import dataclasses
import os

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor.decomposition import select_decomp_table
from torch._functorch.partitioners import min_cut_rematerialization_partition

import liger_rt
from liger_rt.tools.models import build_model
from liger_rt.tools.presets import get_preset


class _Stop(Exception):
    pass


@contextlib.contextmanager
def _model(flags: dict | None, seq: int, layers: int):
    """Qwen3-1.7B's widths (vocab cut to 8192) in bf16, patched with `flags` (None: unpatched) for the block,
    and input ids for it."""
    preset = dataclasses.replace(get_preset("qwen3-1.7b"), layers=layers, vocab=8192)
    model = build_model(preset, dtype=torch.bfloat16)
    if flags is not None:
        liger_rt.patch(model, **flags)
    try:
        yield model, torch.randint(0, preset.vocab, (1, seq))
    finally:
        if flags is not None:
            liger_rt.unpatch(model)


def saved_activations(flags: dict | None, seq: int, layers: int) -> dict:
    out = {}

    def forward_compiler(gm, example_inputs):
        saved = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][1:]   # [0] is the loss
        sizes, storages = [], set()
        for n in saved:                 # one entry per storage: views of one buffer count once, as in eager
            v = n.meta.get("val")
            if n.op != "placeholder" and isinstance(v, torch.Tensor) and v.untyped_storage()._cdata not in storages:
                storages.add(v.untyped_storage()._cdata)
                sizes.append((v.untyped_storage().nbytes() / 2**20, str(n.target), tuple(v.shape)))
        out.update(saved_MB=round(sum(s for s, *_ in sizes), 2), tensors=len(sizes), largest=sorted(sizes)[-3:])
        raise _Stop

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler, bw_compiler=forward_compiler,
                                     partition_fn=min_cut_rematerialization_partition,
                                     decompositions=select_decomp_table())

    torch._dynamo.reset()
    with _model(flags, seq, layers) as (model, ids):
        try:
            torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids, labels=ids)
        except Exception as exc:            # dynamo wraps the forward compiler's _Stop
            if "_Stop" not in repr(exc) and not isinstance(exc, _Stop):
                raise
    return out


def eager_saved(flags: dict | None, seq: int, layers: int) -> dict:
    """The same model's eager step: the distinct storages autograd saves (saved-tensor hooks), weights excluded."""
    saved = {}
    with _model(flags, seq, layers) as (model, ids):
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights and storage.nbytes():
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
    return {"saved_MB": round(sum(saved.values()) / 2**20, 2), "tensors": len(saved)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    flags = {"rope": True, "fused_linear_cross_entropy": True}
    print("unpatched, eager", eager_saved(None, a.seq, a.layers))
    print("liger_rt, eager", eager_saved(flags, a.seq, a.layers))
    print("unpatched, compiled", saved_activations(None, a.seq, a.layers))
    for policy in ("kernels", "fuse"):
        os.environ["LIGER_RT_COMPILE_POLICY"] = policy
        liger_rt.dispatch.reset()
        print(f"liger_rt, compiled, policy {policy}",
              saved_activations(flags, a.seq, a.layers))


if __name__ == "__main__":
    main()
