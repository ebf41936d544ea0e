"""The implementation-parity contract on CUDA: tests/test_impl_parity.py's table of bad and edge inputs through
every implementation available on this GPU (Triton compiled for it, torch, grouped MM where it runs), each input
with one outcome whatever the dispatcher picks.

    python -m pytest -m gpu tests/gpu/test_impl_parity_gpu.py -q

A row whose GPU outcome is a device-side assertion (an expert id outside [0, E): checking on the host would cost
a sync per call) runs once per implementation in a child process, since the CUDA context is unusable after one.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from liger_rt.backend import interpreter_on

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))
from test_impl_parity import ROWS, check_row, impls_here  # noqa: E402  (tests/ is not a package)

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_mem(gib=2),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

if torch.cuda.is_available() and interpreter_on():
    pytest.skip("TRITON_INTERPRET=1 is set: unset it to run the GPU tests", allow_module_level=True)

IN_PROCESS = [p for p in ROWS if not p.values[1].gpu_assert]
ASSERTING = [p for p in ROWS if p.values[1].gpu_assert]
CHILD_TIMEOUT_S = 180     # a child imports torch and compiles one kernel: seconds, not minutes


@pytest.mark.parametrize("op_name,row", IN_PROCESS)
def test_one_outcome_whatever_the_implementation_gpu(op_name, row, monkeypatch):
    check_row(op_name, row, "cuda", monkeypatch)


# the child: build the row on the GPU, call the op with the forced implementation, wait for the GPU
_CHILD = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import liger_rt.ops
from test_impl_parity import TABLE
row = next(r for r in TABLE[{op!r}] if r.name == {name!r})
torch.manual_seed(0)
args, kwargs = row.build("cuda")
try:
    getattr(liger_rt.ops, {op!r})(*args, **kwargs)
    torch.cuda.synchronize()
except Exception as exc:   # leave at once: tearing down a CUDA context after a device assertion can hang
    print(type(exc).__name__, exc, file=sys.stderr, flush=True)
    os._exit(3)
print("finished without an error")
"""


@pytest.mark.parametrize("op_name,row", ASSERTING)
def test_device_assertion_whatever_the_implementation_gpu(op_name, row, tmp_path):
    impls = impls_here(op_name, "cuda")
    assert len(impls) > 1, impls
    for impl in impls:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_")}
        env.update({f"LIGER_RT_IMPL_{op_name.upper()}": impl, "LIGER_RT_TUNING_DB": str(tmp_path / "tuning.db")})
        try:
            child = subprocess.run([sys.executable, "-c", _CHILD.format(tests=str(TESTS), op=op_name, name=row.name)],
                                   env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=TESTS.parent)
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stderr or b"")[-2000:]
            pytest.fail(f"{op_name} {row.name} with {impl}: no answer within {CHILD_TIMEOUT_S} s (a hang is neither "
                        f"an error nor a result); stderr tail: {tail!r}")
        if "cannot run here" in child.stderr:     # never picked for this input
            continue
        assert child.returncode != 0 and "finished without an error" not in child.stdout, (impl, child.stdout)
        assert row.gpu_assert in child.stderr or "device-side assert" in child.stderr, (impl, child.stderr[-2000:])
