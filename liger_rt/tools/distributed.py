"""liger_rt under torch.distributed: rank-consistent decisions, parity of wrapped models
(docs/integrations.md, "FSDP2 and DDP") and the sharded `liger-tune sweep` under torchrun.

    model = wrap(liger_rt.patch(build_model("qwen3-tiny")), "fsdp2")   # or "ddp"
    ...train...
    check_decisions_agree()       # all-gathers the decisions; raises naming those that differ
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

DIGEST_FIELDS = ("op", "dims", "dtype", "impl", "config")


def decisions() -> list[dict]:
    """Every registered op's memoised decisions, as sorted dicts of DIGEST_FIELDS."""
    from liger_rt import dispatch
    memo = [d.to_dict() for d in dispatch.decisions()]
    return sorted(({k: d[k] for k in DIGEST_FIELDS} for d in memo), key=lambda d: json.dumps(d, sort_keys=True))


def decisions_digest(found: list[dict] | None = None) -> str:
    """sha256 (hex) of `decisions()`: equal on two processes iff they decided the same for the same calls."""
    text = json.dumps(decisions() if found is None else found, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_decisions_agree(group=None) -> list[str]:
    """All-gather every rank's decisions (a collective); raise naming those that differ from rank 0's,
    else return the digests."""
    import torch.distributed as dist
    mine = decisions()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    digests = [decisions_digest(g) for g in gathered]
    keys = [{json.dumps(d, sort_keys=True) for d in g} for g in gathered]
    diffs = [f"rank {r}: only on rank 0 {sorted(keys[0] - keys[r])[:3]}, only here {sorted(keys[r] - keys[0])[:3]}"
             for r, d in enumerate(digests) if d != digests[0]]
    if diffs:
        raise RuntimeError("liger_rt decisions differ across ranks: " + "; ".join(diffs))
    return digests


def launched() -> bool:
    """Whether this process is one rank of several started by torchrun."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def init_from_env(device_type: str) -> tuple[int, int]:
    """(rank, world size) of the torchrun job, joined if not yet; on CUDA one GPU per rank (LOCAL_RANK)."""
    from datetime import timedelta

    import torch.distributed as dist
    count = torch.cuda.device_count()
    if device_type == "cuda" and count:    # none: the sweep's arch check says so
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= count:
            raise ValueError(f"LOCAL_RANK={local} but this machine has {count} GPUs: --nproc-per-node at most {count}")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        # gloo whatever the device: a sweep exchanges only Python objects, a gloo wait is bounded by its
        # 30-minute timeout rather than NCCL's 10-minute watchdog, and it holds no GPU memory being measured
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(minutes=30))
    return dist.get_rank(), dist.get_world_size()

WRAPPERS = ("ddp", "fsdp2")


def wrap(model, how: str, *, device_type: str | None = None):
    """`model` under DDP, or FSDP2 (``fully_shard`` on each decoder layer then the root, in place, as
    torch recommends) over the default process group.  Patch before wrapping."""
    import torch.distributed as dist
    if how not in WRAPPERS:
        raise ValueError(f"unknown wrapper {how!r}; valid: {', '.join(WRAPPERS)}")
    device_type = device_type or next(model.parameters()).device.type
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    layers = next((m for name, m in model.named_modules()
                   if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"), None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no ModuleList named 'layers' to shard")
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrapped(model):
    """The module inside DDP (FSDP2 wraps in place)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded DTensor gathered whole (a collective: every rank calls it), else `t`."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_step(model, inputs: dict, lr: float) -> dict[str, Any]:
    """The parity tool's step without its label-free forwards: loss with labels, backward, AdamW(lr)."""
    from .parity import adamw_step
    model.train()
    model.zero_grad(set_to_none=True)
    return adamw_step(model, model(**inputs).loss, lr)


def compare_wrapped(base, new, inputs: dict | None = None, *, lr: float = 1e-3, seed: int = 0,
                    all_rows: bool = True, tolerances: dict[str, float] | None = None) -> dict:
    """`parity.compare` for a (baseline, patched) pair already wrapped by `wrap`, called on every rank
    with the same inputs (the averaged gradients are then those of one process).  all_rows=False
    measures only the optimisation loss, gradients and AdamW update (`train_step`)."""
    from . import parity
    inputs = inputs if inputs is not None else parity.make_inputs(unwrapped(base), seed=seed)
    return parity.build_report(base, new, inputs, lr=lr, seed=seed, run=None if all_rows else train_step,
                               tolerances=tolerances, full=full, inner=unwrapped(new))
