"""What holds a training step's memory peak at long context, by category: parameters, optimizer state,
gradients, saved activations by module type, the loss chunk, and the rest by the frame that allocated it.

    python benchmarks/profile/peak_memory.py --model qwen3-1.7b --arm liger_rt --seq 32768
    python benchmarks/profile/peak_memory.py --model gemma3-4b --arm baseline+ckpt --seq 16384 --top 10
    python benchmarks/profile/peak_memory.py --model qwen3-1.7b --arm liger_rt --census      # CPU or GPU

Builds the arm as a probe of `liger-tune bench model --max-seq` does (liger_rt: the fused loss and rope over the
family defaults, AdamW state created first, a short warm-up step), then records the CUDA allocator's history over
one forward and backward at --seq (batch 1) while a saved-tensor hook notes, for each tensor autograd keeps for the
backward, the module type running when it was saved.  Replaying the history finds the peak; each block live then
is charged to the gradients (live at the end of the backward at a parameter's .grad), the saved activations of a
module type, the loss chunk (allocated in liger_rt's loss kernels or transformers' loss), or else the innermost
liger_rt, transformers or benchmarks frame that allocated it.  Parameters and optimizer state are what was
allocated before the step.  Tensors saved inside a checkpointed layer are recomputed in the backward and counted
by frame.  Needs a CUDA GPU.

--census runs anywhere (CPU: fp32 through the Triton interpreter, whose kernels cannot do bf16 arithmetic): the
bytes autograd saves for the backward per token, per decoder layer and module type, from the difference between two
lengths (--seq and twice it) on the model cut to --layers (default 1), so what does not grow with the sequence (a
weight gradient the fused loss computes in the forward) drops out; then what the whole model saves at --at tokens.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import sys

import torch

from liger_rt.tools.bench import max_seq as S, model as B

OURS = ("liger_rt", "transformers", "benchmarks")
_LINEAR_FORWARD = torch.nn.Linear.forward.__code__
LOSS_FILES = ("fused_linear_cross_entropy", "fused_linear_logprobs", "cross_entropy", "layers/loss.py",
              "transformers/loss/")
ARMS = tuple(a for a in S.ARMS if "+compile" not in a)     # compiled graphs save outside the hooks


def _frame(frames) -> str:
    """The frame a block is charged to: the innermost in OURS, else the innermost outside torch."""
    frames = frames or []
    pick = next((f for f in frames if any(k in f["filename"] for k in OURS)), None)
    pick = pick or next((f for f in frames if "/torch/" not in f["filename"]), None)
    if pick is None:
        return "(torch internals) " + " < ".join(f"{f['filename'].split('/')[-1]}:{f['name']}" for f in frames[:2])
    return f"{'/'.join(pick['filename'].split('/')[-2:])}:{pick['line']} {pick['name']}"


def _is_loss(frames) -> bool:
    return any(k in f["filename"] for f in frames or [] for k in LOSS_FILES)


@dataclasses.dataclass
class Breakdown:
    peak: int                    # bytes allocated during the trace and live at its peak
    bytes: dict[str, int]        # category -> bytes live at the peak
    blocks: dict[str, int]       # category -> blocks live at the peak
    at: int                      # the peak's event index
    allocs_at: int               # allocations before the peak (compare with the forward's end)


def peak_breakdown(events: list[dict], grads: set[int], saved) -> Breakdown:
    """The blocks live at the peak of allocator `events` (alloc adds a block, free_completed removes it), by
    category.  `grads`: addresses of the parameters' gradients at the end of the trace (a block there that lives to
    the end is a gradient).  `saved`: {address: module type}, or [(address, allocations before it was saved,
    module type)] to match the block that address held then."""
    by_addr = saved if isinstance(saved, dict) else {}
    ordinals: dict[int, list[int]] = collections.defaultdict(list)      # address -> ordinals of its allocations
    live: dict[int, tuple[int, int, list]] = {}                          # address -> (size, ordinal, frames)
    total = peak = n = at = allocs_at = 0
    at_peak: dict[int, tuple[int, int, list]] = {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            n += 1
            ordinals[e["addr"]].append(n)
            live[e["addr"]] = (e["size"], n, e.get("frames"))
            total += e["size"]
            if total > peak:
                peak, at_peak, at, allocs_at = total, dict(live), i, n
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    owner: dict[tuple[int, int], str] = {}          # (address, ordinal of the block saved) -> module type
    for addr, when, module in ([] if isinstance(saved, dict) else saved):
        k = bisect.bisect_right(ordinals.get(addr, []), when)
        if k:
            owner.setdefault((addr, ordinals[addr][k - 1]), module)
    nbytes, blocks = collections.Counter(), collections.Counter()
    for addr, (size, ordinal, frames) in at_peak.items():
        if addr in grads and live.get(addr, (0, None))[1] == ordinal:
            cat = "gradients"
        elif (addr, ordinal) in owner or addr in by_addr:
            cat = f"saved activations: {owner.get((addr, ordinal)) or by_addr[addr]}"
        elif _is_loss(frames):
            cat = "loss (fused linear cross-entropy)" if any("liger_rt" in f["filename"] for f in frames) \
                else "loss (logits, cross-entropy)"
        else:
            cat = f"other: {_frame(frames)}"
        nbytes[cat] += size
        blocks[cat] += 1
    return Breakdown(peak, dict(nbytes), dict(blocks), at, allocs_at)


def _allocations() -> int:
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


def saved_by_module(model, forward, device_type: str = "cuda", allocations=_allocations, label=None):
    """Run `forward()` (it returns the loss) and the loss's backward under a saved-tensor hook: ({storage address:
    (allocations before it was saved, the module type running then, bytes)} of every tensor autograd keeps for the
    backward that is no parameter, allocations at the forward's end, the loss).  A saved block lives through the
    forward, so an address names one tensor there.  `label(stack)` names the module from the stack of module
    types running (default: the innermost)."""
    params = {t.untyped_storage().data_ptr() for t in model.parameters()}
    stack, saved = [], {}

    def push(module, args):
        stack.append(type(module).__name__)

    def pop(module, args, output):          # returns None: the module's output stays as it is
        if stack:
            stack.pop()
    # plain nn.Linear leaves get no hooks (a hooked down projection keeps liger_rt's MLP on its plain path,
    # LIGER_RT_RECOMPUTE_SWIGLU): a tensor saved inside Linear.forward is named by that frame instead
    handles = [h for m in model.modules() if type(m) is not torch.nn.Linear
               for h in (m.register_forward_pre_hook(push), m.register_forward_hook(pop))]
    base = allocations()

    def in_linear() -> bool:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code is _LINEAR_FORWARD:
                return True
            f = f.f_back
        return False

    def pack(t):
        if t.device.type == device_type:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in saved:
                st = [*stack, "Linear"] if in_linear() else stack
                name = (label or (lambda s: s[-1]))(st) if st else "(outside modules)"
                saved[ptr] = (allocations() - base, name, t.untyped_storage().nbytes())
        return t
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
            fwd_allocs = allocations() - base
            stack.clear()
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return saved, fwd_allocs, loss


def profile(args) -> None:
    model_type, preset = B.resolve_model(args.model, args.preset)
    p = B.bench_preset(model_type, preset, args.layers, None)
    flags = {**S.DEFAULT_FLAGS, **B.parse_flags(args.flags)}
    spec = S.ProbeSpec(model_type=model_type, preset=dataclasses.asdict(p), arm=args.arm,
                       flags=flags if args.arm.startswith("liger_rt") else {},
                       overrides=B.config_overrides(model_type, None), device="cuda", limit_gib=args.limit_gib)
    S.limit_memory(args.limit_gib)
    model, step_model, opt, undo = S.build_arm(spec)
    S.train_step(step_model, opt, B.random_ids(model, 1, min(256, args.seq), 0, "cuda"))     # kernels compiled
    ids = B.random_ids(model, 1, args.seq, 0, "cuda")
    params = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.parameters()}
    state = sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.is_cuda)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()

    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    base = _allocations()
    saved, fwd_allocs, _ = saved_by_module(
        model, lambda: step_model(input_ids=ids, labels=ids, use_cache=False).loss)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    grads = {q.grad.untyped_storage().data_ptr() for q in model.parameters() if q.grad is not None}
    grad_bytes = sum(q.grad.untyped_storage().nbytes() for q in model.parameters() if q.grad is not None)
    peak_all = torch.cuda.max_memory_allocated()
    events = snap["device_traces"][torch.cuda.current_device()]
    n_allocs = sum(e["action"] == "alloc" for e in events)
    if n_allocs == _allocations() - base:
        b = peak_breakdown(events, grads, [(a, when, m) for a, (when, m, _) in saved.items()])
    else:
        print(f"(the trace holds {n_allocs} allocations, the allocator counted {_allocations() - base}: saved "
              f"tensors are matched by address alone)")
        b = peak_breakdown(events, grads, {a: m for a, (_, m, _) in saved.items()})
    gb = 1e9
    print(f"\n== {p.name} {args.arm} at {args.seq} tokens (batch 1), {torch.cuda.get_device_name()}; liger_rt flags "
          f"{flags if args.arm.startswith('liger_rt') else '-'}")
    print(f"max allocated over the forward and backward: {peak_all / gb:.2f} GB; the replayed peak falls "
          f"{'in the forward' if b.allocs_at <= fwd_allocs else 'in the backward'} (allocation {b.allocs_at} of "
          f"{n_allocs}; the forward ends at allocation {fwd_allocs})")
    rows = [("parameters", sum(params.values())), ("optimizer state", state),
            ("other, allocated before the step", start - sum(params.values()) - state)]
    for what, size in rows:
        print(f"  {size / gb:9.3f} GB             {what}")
    print(f"  -- allocated during the step and live at its peak: {b.peak / gb:.3f} GB (with the above: "
          f"{(start + b.peak) / gb:.2f} GB) --")
    cats = sorted(b.bytes.items(), key=lambda kv: -kv[1])
    shown = [c for c in cats if not c[0].startswith("other: ")] + \
        [c for c in cats if c[0].startswith("other: ")][:args.top]
    for cat, size in shown:
        print(f"  {size / gb:9.3f} GB {b.blocks[cat]:6d} blocks  {cat}")
    rest = sum(size for cat, size in cats if (cat, size) not in shown)
    if rest:
        print(f"  {rest / gb:9.3f} GB                other frames")
    by_module = collections.Counter()
    for _, module, size in saved.values():
        by_module[module] += size
    print(f"gradients at the end of the backward: {grad_bytes / gb:.3f} GB; saved for the backward during the "
          f"forward, by module type (live at the peak or not): "
          + ", ".join(f"{m} {v / gb:.2f} GB" for m, v in by_module.most_common(8)))
    undo()


LAYER = "layer: "


def in_layer(stack: list[str]) -> str:
    """'layer: <innermost module type>' inside a decoder layer, else the innermost module type."""
    return (LAYER if any(t.endswith("DecoderLayer") for t in stack) else "") + stack[-1]


def census(args) -> dict:
    """Saved-for-backward bytes per token and decoder layer by module type, the slope between two lengths:
    {"layer": {module type: bytes per token and layer}, "outside": bytes per token, "per_token": the whole
    model's bytes per token}, printed."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bf16") if cuda else ("cpu", "fp32")
    model_type, preset = B.resolve_model(args.model, args.preset)
    full = B.bench_preset(model_type, preset, None, None)
    layers = args.layers or 1
    p = B.bench_preset(model_type, preset, layers, None)
    flags = {**S.DEFAULT_FLAGS, **B.parse_flags(args.flags)}
    spec = S.ProbeSpec(model_type=model_type, preset=dataclasses.asdict(p), arm=args.arm, dtype=dtype,
                       flags=flags if args.arm.startswith("liger_rt") else {},
                       overrides=B.config_overrides(model_type, None), device=device)
    model, step_model, _, undo = S.build_arm(spec)
    counter = iter(range(1, 1 << 62))
    per_module = []
    try:
        for seq in (args.seq, 2 * args.seq):
            ids = B.random_ids(model, 1, seq, 0, device)
            saved, _, _ = saved_by_module(model, lambda: step_model(input_ids=ids, labels=ids, use_cache=False).loss,
                                          device, (lambda: next(counter)) if not cuda else _allocations, in_layer)
            by = collections.Counter()
            for _, module, size in saved.values():
                by[module] += size
            per_module.append(by)
            model.zero_grad(set_to_none=True)
    finally:
        undo()
    slope = {m: (per_module[1][m] - per_module[0][m]) / args.seq for m in per_module[0] | per_module[1]}
    layer = {m[len(LAYER):]: v / layers for m, v in slope.items() if m.startswith(LAYER) and v > 0}
    outside = sum(v for m, v in slope.items() if not m.startswith(LAYER) and v > 0)
    per_token = sum(layer.values()) * full.layers + outside
    where = torch.cuda.get_device_name() if cuda else "CPU, fp32"
    print(f"== {p.name} {args.arm}: bytes saved for the backward per token ({where}; {dtype}, lengths {args.seq} "
          f"and {2 * args.seq}, {layers} layer(s)); liger_rt flags {flags if args.arm.startswith('liger_rt') else '-'}")
    for m, v in sorted(layer.items(), key=lambda kv: -kv[1]):
        print(f"  {v:10.0f} B per token and layer  {m}")
    print(f"  {sum(layer.values()):10.0f} B per token and layer  (all)")
    print(f"  {outside:10.0f} B per token            outside the decoder layers (embedding, final norm, loss)")
    print(f"{full.name}, {full.layers} layers: {per_token / 1e6:.3f} MB per token, {per_token * args.at / 1e9:.1f} GB "
          f"saved at {args.at} tokens" + ("" if cuda else " (fp32; bf16 halves all but the fp32 statistics)"))
    return {"layer": layer, "outside": outside, "per_token": per_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-1.7b", help="a preset name, or a model type with --preset")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--arm", default="liger_rt", help=f"one of {', '.join(ARMS)}")
    ap.add_argument("--seq", type=int, default=32768, help="tokens (batch 1)")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    ap.add_argument("--flags", default=None, help="liger_rt.patch flags over fused_linear_cross_entropy=1,rope=1")
    ap.add_argument("--limit-gib", type=float, default=None, help="cap the GPU memory (a smaller card)")
    ap.add_argument("--top", type=int, default=12, help="frames shown outside the named categories")
    ap.add_argument("--census", action="store_true", help="only the saved bytes per token and layer (CPU or GPU; "
                    "--seq default 256 there)")
    ap.add_argument("--at", type=int, default=65536, help="--census: the length whose saved bytes it projects")
    args = ap.parse_args()
    if args.arm not in ARMS:
        raise SystemExit(f"peak_memory.py: unknown arm {args.arm!r}; valid: {', '.join(ARMS)}")
    if args.census:
        args.seq = args.seq if args.seq != ap.get_default("seq") else 256
        try:
            census(args)
            return
        except ValueError as exc:
            raise SystemExit(f"peak_memory.py: {exc}") from None
    if not torch.cuda.is_available():
        raise SystemExit("peak_memory.py needs a CUDA GPU (the allocator history is CUDA's)")
    try:
        profile(args)
    except ValueError as exc:
        raise SystemExit(f"peak_memory.py: {exc}") from None
    except torch.OutOfMemoryError:
        raise SystemExit(f"peak_memory.py: {args.arm} runs out of memory at {args.seq} tokens: give a shorter --seq "
                         f"(at most its longest trainable sequence)") from None


if __name__ == "__main__":
    main()
