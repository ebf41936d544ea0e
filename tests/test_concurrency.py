"""Several processes writing one tuning DB at once lose nothing; distributed tuning agrees."""
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from liger_rt.tuning_db import open_store

HERE = Path(__file__).resolve().parent

WRITER = textwrap.dedent("""
    import sys, json
    import toy_op
    from liger_rt import autotune, dispatch
    from liger_rt.freshness import source_hash
    from liger_rt.tuning_db import open_store
    import torch
    worker, path = int(sys.argv[1]), sys.argv[2]
    op = toy_op.OP
    store = open_store(path)
    # a real tuning run per worker (its own shape) ...
    result = autotune.tune(op, dispatch.current_target("cpu"), torch.float32, {"rows": 2 + worker, "cols": 40 + worker},
                           quick=True)
    autotune.persist(op, result, store)
    # ... and a burst of upserts, one key shared by every worker
    config = toy_op.ToyConfig().to_dict()
    for i in range(40):
        base = dict(op="toy", variant="fwdbwd", arch="cpu", dtype="fp32", impl="triton", config=config,
                    source_hash=source_hash(op), config_schema=op.schema_version, method="cpu-wall")
        store.put_tuning({**base, "static_key": json.dumps({"cols": 1000 + worker}), "bucket": json.dumps({"rows": 1 << i}),
                          "median_ms": 1.0})
        store.put_tuning({**base, "static_key": '{"cols":7}', "bucket": '{"rows":1}', "median_ms": 10.0 - worker - i / 100})
        store.put_measurements([{**{k: v for k, v in base.items() if k != "config_schema"}, "static_key": '{"cols":9}', "dims": json.dumps({"cols": 9, "rows": 1000 * worker + i + 1}),
                                 "median_ms": 1.0, "ok": 1}])
    print("done", worker)
""")


def test_four_processes_sweeping_one_db_lose_nothing(tmp_path):
    path = tmp_path / "shared.db"
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "TRITON_INTERPRET": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), str(path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(4)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    store = open_store(path)
    assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = store.all_rows("tuning")
    assert len([r for r in rows if r["static_key"].startswith('{"cols":10')]) == 4 * 40
    shared = [r for r in rows if r["static_key"] == '{"cols":7}']
    assert len(shared) == 1 and shared[0]["median_ms"] == pytest.approx(10.0 - 3 - 39 / 100)
    assert len([r for r in rows if r["static_key"].startswith('{"cols":4')]) == 4 * 2   # triton + torch per worker
    assert len([m for m in store.all_rows("measurements") if m["static_key"] == '{"cols":9}']) == 4 * 40


DIST = textwrap.dedent("""
    import os, sys, json
    import torch, torch.distributed as dist
    import toy_op
    from liger_rt import autotune, dispatch
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method="tcp://127.0.0.1:" + sys.argv[2])
    calls = []
    real = autotune.tuning.tune
    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    autotune.tuning.tune = counting
    d = dispatch.decision(toy_op.OP, torch.randn(4, 40), rows=4, cols=40)
    print(json.dumps({"rank": rank, "impl": d.impl, "config": dict(d.config), "origin": d.origin, "tuned": len(calls)}))
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_distributed_only_rank0_tunes_and_all_ranks_agree(tmp_path):
    import json
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "TRITON_INTERPRET": "1",
           "LIGER_RT_AUTOTUNE": "1", "LIGER_RT_TUNING_DB": str(tmp_path / "dist.db")}
    procs = [subprocess.Popen([sys.executable, "-c", DIST, str(r), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    res = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["tuned"] for r in res] == [1, 0]
    assert res[0]["impl"] == res[1]["impl"] and res[0]["config"] == res[1]["config"]
    assert {r["origin"] for r in res} == {"online"}
