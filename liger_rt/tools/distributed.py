"""liger_rt under torch.distributed: rank-consistent decisions and parity of wrapped models.

    from liger_rt.tools.distributed import decisions_digest, check_decisions_agree, wrap, compare_wrapped
    model = wrap(liger_rt.patch(build_model("qwen3-tiny")), "fsdp2")   # or "ddp"
    ...train...
    decisions_digest()            # sha256 of every memoised decision (op, dims, dtype, impl, config)
    check_decisions_agree()       # all-gathers the digests; raises if any rank decided differently

`compare_wrapped(baseline, patched, inputs)` is `liger_rt.tools.parity.compare` for models wrapped
in DDP or FSDP2 (``torch.distributed.fsdp.fully_shard``): every rank runs the same input through
both, sharded gradients and parameters are gathered whole (``DTensor.full_tensor``), and the rows
are gated by the parity tool's table (``parity.TOLERANCES``).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

DIGEST_FIELDS = ("op", "dims", "dtype", "impl", "config")


# -- decisions ------------------------------------------------------------------------------------

def decisions() -> list[dict]:
    """Every registered op's memoised decisions, as sorted dicts of DIGEST_FIELDS."""
    from liger_rt import dispatch
    out = []
    for op in list(dispatch._REGISTRY.values()):
        for decision in list(op._memo.values()):
            d = decision.to_dict()
            out.append({k: d[k] for k in DIGEST_FIELDS})
    out.sort(key=lambda d: json.dumps(d, sort_keys=True))
    return out


def decisions_digest() -> str:
    """sha256 (hex) of `decisions()`: equal on two processes iff they decided the same for the same calls."""
    text = json.dumps(decisions(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_decisions_agree(group=None) -> list[str]:
    """All-gather every rank's digest (a collective: call it on every rank); raise RuntimeError
    naming the ranks and the decisions that differ from rank 0's, else return the digests."""
    import torch.distributed as dist
    mine = decisions()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    digests = [hashlib.sha256(json.dumps(g, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
               for g in gathered]
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        ref = {json.dumps(d, sort_keys=True) for d in gathered[0]}
        diffs = []
        for r in bad:
            other = {json.dumps(d, sort_keys=True) for d in gathered[r]}
            diffs.append(f"rank {r}: only on rank 0 {sorted(ref - other)[:3]}, only here {sorted(other - ref)[:3]}")
        raise RuntimeError("liger_rt decisions differ across ranks: " + "; ".join(diffs))
    return digests
