"""Arch detection from faked device properties, forcing, and env validation."""
import warnings

import pytest
import torch

from liger_rt import backend, env


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
])
def test_bad_env_values_name_the_variable_and_accepted_values(monkeypatch, var, value, fn):
    monkeypatch.setenv(var, value)
    with pytest.raises(env.EnvError) as info:
        fn()
    assert var in str(info.value) and "accepted values" in str(info.value)


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
