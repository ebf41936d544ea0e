"""Arch detection from faked device properties, forcing, and env validation."""
import warnings

import pytest
import torch

from liger_rt import backend, env
from liger_rt.registry import OP_MODULES, REGISTRY


@pytest.mark.parametrize("cap,name,expected", [
    ((9, 0), "NVIDIA H200", "hopper"),
    ((9, 0), "NVIDIA H100 80GB HBM3", "hopper"),
    ((10, 0), "NVIDIA B200", "blackwell"),
    ((8, 0), "NVIDIA A100-SXM4-80GB", "ampere"),
    ((8, 6), "NVIDIA GeForce RTX 3090", "ampere"),
])
def test_cuda_capability(cap, name, expected):
    arch = backend.arch_from_properties(name, capability=cap, sm_count=132)
    assert arch.name == expected and arch.vendor == "nvidia" and arch.warp_size == 32
    assert arch.sm_count == 132 and arch.device_name == name
    if cap == (8, 6):
        assert arch.smem_bytes == 101376 and arch.capability == "sm86"


@pytest.mark.parametrize("gcn,name,expected", [
    ("gfx942:sramecc+:xnack-", "AMD Instinct MI325X", "mi325x"),
    ("gfx942:sramecc+:xnack-", "AMD Instinct MI300X", "mi300x"),
    ("gfx950", "AMD Instinct MI355X", "mi355x"),
])
def test_rocm_gcn_arch(gcn, name, expected):
    arch = backend.arch_from_properties(name, gcn_arch=gcn, sm_count=304)
    assert arch.name == expected and arch.is_hip
    assert arch.warp_size == 64 and arch.max_num_warps == 16 and arch.max_num_stages <= 2


def test_mi300x_and_mi325x_told_apart_by_name_not_cu_count():
    a = backend.arch_from_properties("AMD Instinct MI300X", gcn_arch="gfx942", sm_count=304)
    b = backend.arch_from_properties("AMD Instinct MI325X", gcn_arch="gfx942", sm_count=304)
    assert (a.name, b.name) == ("mi300x", "mi325x")


@pytest.mark.parametrize("kw", [dict(capability=(7, 5)), dict(gcn_arch="gfx1100")])
def test_unknown_gpu_gets_generic_profile_and_one_warning(kw):
    backend.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a1 = backend.arch_from_properties("Mystery GPU 9000", **kw)
        a2 = backend.arch_from_properties("Mystery GPU 9000", **kw)
    assert a1 == a2 and a1.name.startswith("generic-")
    assert a1.max_num_warps <= 8 and a1.max_num_stages <= 2
    assert len([w for w in caught if "Mystery GPU 9000" in str(w.message)]) == 1


def test_detect_with_faked_cuda_device(monkeypatch):
    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H200", 9, 0, 132
    backend.reset()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    arch = backend.detect()
    assert arch.name == "hopper" and arch.sm_count == 132
    backend.reset()


def test_detect_with_faked_rocm_device(monkeypatch):
    class Props:
        name, gcnArchName, multi_processor_count, major, minor = "AMD Instinct MI325X", "gfx942:sramecc+:xnack-", 304, 9, 4
    backend.reset()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.version, "hip", "6.3", raising=False)
    assert backend.detect().name == "mi325x"
    backend.reset()


def test_cpu_and_forced_arch(monkeypatch):
    assert backend.detect("cpu").name == "cpu"
    monkeypatch.setenv("LIGER_RT_ARCH", "mi325x")
    arch = backend.detect("cpu")
    assert arch.name == "mi325x" and arch.forced and arch.max_num_stages == 2


def test_profile_unknown_name_lists_valid():
    with pytest.raises(ValueError, match="hopper.*mi325x"):
        backend.profile("voodoo")


@pytest.mark.parametrize("var,value,fn", [
    ("LIGER_RT_AUTOTUNE", "maybe", env.autotune),
    ("LIGER_RT_DISABLE", "2", env.disabled),
    ("LIGER_FUSED_MOE_AUTOTUNE", "nah", env.fused_moe_autotune),
    ("LIGER_RT_LOG", "everything", env.log_decisions),
    ("LIGER_RT_ARCH", "pentium", env.arch_override),
    ("LIGER_RT_DB_TIMEOUT", "-3", env.db_timeout),
    ("LIGER_RT_DB_TIMEOUT", "abc", env.db_timeout),
    ("LIGER_RT_DB_TIMEOUT", "nan", env.db_timeout),
    ("LIGER_RT_DB_TIMEOUT", "inf", env.db_timeout),
    ("LIGER_RT_DB_TIMEOUT", "1e308", env.db_timeout),
    ("LIGER_RT_COMPILE_POLICY", "inductor", env.compile_policy),
    ("LIGER_RT_RECOMPUTE_SWIGLU", "sometimes", env.recompute_swiglu),
])
def test_bad_env_values_name_the_variable_and_accepted_values(monkeypatch, var, value, fn):
    monkeypatch.setenv(var, value)
    with pytest.raises(env.EnvError) as info:
        fn()
    assert var in str(info.value) and "accepted values" in str(info.value)


def test_compile_policy_defaults_to_fuse(monkeypatch):
    assert env.compile_policy() == "fuse"
    monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", " Kernels ")
    assert env.compile_policy() == "kernels"


def test_env_read_at_call_time(monkeypatch):
    assert env.autotune() is False
    monkeypatch.setenv("LIGER_RT_AUTOTUNE", "1")
    assert env.autotune() is True
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "0")
    assert env.fused_moe_autotune() is False
    monkeypatch.setenv("LIGER_RT_IMPL_RMS_NORM", "Torch")
    assert env.impl_override("rms_norm", ("triton", "torch")) == "torch"
    monkeypatch.setenv("LIGER_RT_IMPL_RMS_NORM", "cuda")
    with pytest.raises(env.EnvError, match="LIGER_RT_IMPL_RMS_NORM.*triton, torch"):
        env.impl_override("rms_norm", ("triton", "torch"))


def test_default_db_path_under_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("LIGER_RT_TUNING_DB")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert env.tuning_db_path() == tmp_path / "liger_rt" / "tuning.db"


def test_every_accessor_validates_every_variable(monkeypatch):
    monkeypatch.setenv("LIGER_RT_AUTOTUNE", "maybe")
    for fn in (env.disabled, env.db_timeout, env.tuning_db_path, env.arch_override, env.log_decisions,
               env.fused_moe_autotune, lambda: env.impl_override("rms_norm")):
        with pytest.raises(env.EnvError, match="LIGER_RT_AUTOTUNE='maybe'"):
            fn()
    monkeypatch.setenv("LIGER_RT_AUTOTUNE", "1")
    monkeypatch.setenv("LIGER_RT_DB_TIMEOUT", "0")
    env.check()
    assert env.db_timeout() == 0.0


def test_unknown_variable_warns_once_with_the_nearest_name(monkeypatch):
    REGISTRY.get("rms_norm")
    monkeypatch.setenv("LIGER_RT_IMPL_RMSNORM", "torch")
    monkeypatch.setenv("LIGER_RT_AUTOTUNES", "1")
    monkeypatch.setattr(env, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env.disabled()
        env.disabled()
        monkeypatch.setenv("LIGER_RT_DISABLE", "0")          # a changed environment is checked again
        env.disabled()
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 2, msgs
    assert any("LIGER_RT_IMPL_RMSNORM" in m and "did you mean LIGER_RT_IMPL_RMS_NORM?" in m for m in msgs)
    assert any("LIGER_RT_AUTOTUNES" in m and "did you mean LIGER_RT_AUTOTUNE?" in m for m in msgs)
    assert "LIGER_RT_AUTOTUNES" in env.snapshot()["unknown"]


def test_tilde_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGER_RT_TUNING_DB", "~no_such_user_here_1234/tuning.db")
    with pytest.raises(env.EnvError, match="LIGER_RT_TUNING_DB=.*cannot expand '~'"):
        env.tuning_db_path()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LIGER_RT_TUNING_DB", "~/t.db")
    assert env.tuning_db_path() == tmp_path / "t.db"


def test_env_imports_nothing_from_liger_rt():
    import ast
    tree = ast.parse(open(env.__file__).read())
    imported = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.level or "liger_rt" in (n.module or ""))]
    assert not imported
    assert backend.ARCH_NAMES == env.ARCH_CHOICES


def test_sm_count_is_the_device_s_and_cached(monkeypatch):
    calls = []

    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H200", 9, 0, 132

    def props(i):
        calls.append(i)
        return Props()
    backend.reset()
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert backend.sm_count("cpu") == 2 and backend.sm_count(torch.device("cpu")) == 2
    assert backend.sm_count(torch.device("cuda", 1)) == 132 and backend.sm_count(1) == 132
    assert backend.sm_count("cuda") == 132 and calls == [1, 0]
    backend.reset()


def test_detect_hardware_ignores_the_forced_arch_and_sweeps_refuse_with_a_library_error(monkeypatch):
    from liger_rt import autotune
    monkeypatch.setenv("LIGER_RT_ARCH", "hopper")
    assert backend.detect("cpu").name == "hopper" and backend.detect_hardware().name == "cpu"
    with pytest.raises(autotune.ArchMismatchError, match="refusing to measure for --arch hopper: this machine is cpu"):
        autotune.check_arch_matches("hopper")
    assert autotune.check_arch_matches("cpu").name == "cpu"


def test_impl_override_of_an_op_not_yet_imported_fails_the_first_decision_of_any_op(tmp_path):
    """LIGER_RT_IMPL_SWIGLU=garbage is reported at the first decision (an rms_norm call, a planning `select`), not
    only when swiglu is called: the decision imports swiglu to learn its implementations.  A fresh process, so that
    swiglu's module is not imported yet."""
    import os
    import subprocess
    import sys
    script = (
        "import sys, torch\n"
        "from liger_rt import dispatch, env\n"
        "from liger_rt.kernels import rms_norm\n"
        "assert 'liger_rt.kernels.swiglu' not in sys.modules\n"
        "for decide in (lambda: rms_norm.rms_norm(torch.randn(2, 8), torch.ones(8)),\n"
        "               lambda: dispatch.select('rms_norm', dtype='fp32', arch='cpu', rows=2, hidden=8)):\n"
        "    try:\n"
        "        decide()\n"
        "    except env.EnvError as exc:\n"
        "        print(exc)\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_")}
    environ.update(LIGER_RT_IMPL_SWIGLU="garbage", LIGER_RT_TUNING_DB=str(tmp_path / "t.db"), TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == ["LIGER_RT_IMPL_SWIGLU='garbage' is not an implementation of swiglu; accepted values: triton, "
                     "torch"] * 2, out.stdout


def test_env_doc_lists_every_ops_impl_variable():
    from pathlib import Path
    doc = (Path(__file__).parent.parent / "docs" / "env.md").read_text()
    missing = [name for name in OP_MODULES if f"LIGER_RT_IMPL_{name.upper()}" not in doc]
    assert not missing, missing
