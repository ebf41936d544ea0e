"""Which device this is: an arch name plus the profile used to prune launch configs.

`detect()` maps the current device to an :class:`Arch`. ``LIGER_RT_ARCH`` forces one (planning, tests of the AMD
paths on a machine without AMD hardware). An unknown GPU never crashes: it gets a conservative generic profile
and a one-time warning.

Sources for the AMD figures (not measured here: no AMD hardware was available): AMD CDNA3 ISA and Instinct
MI300X/MI325X data sheets (304 CUs, 64 KiB LDS per CU, wave64) and the CDNA4 (MI355X, gfx950: 256 CUs, 160 KiB
LDS) whitepaper. HIP-safe stage count (<= 2) from Liger-Kernel PR #1317.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings

import torch

from . import env


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str                 # hopper, blackwell, ampere, mi300x, mi325x, mi355x, cpu, generic-*
    vendor: str               # nvidia, amd, cpu
    capability: str           # "sm90", "gfx942", "" for cpu
    device_name: str
    sm_count: int             # SMs (NVIDIA) or CUs (AMD); 0 when unknown
    warp_size: int            # 32 on NVIDIA, 64 (wavefront) on AMD CDNA
    max_num_warps: int        # ceiling for triton num_warps (1024 threads / warp size on AMD)
    max_num_stages: int       # safe software-pipelining depth
    smem_bytes: int           # shared memory / LDS budget per block
    forced: bool = False      # came from LIGER_RT_ARCH

    @property
    def is_hip(self) -> bool:
        return self.vendor == "amd"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# What we know of each arch without touching a device, in Arch's field order.  The device name and sm_count
# are the reference part's (H100 SXM, B200, A100, MI300X/MI325X, MI355X), replaced by the device's own when one
# is present: planning for an arch without naming a device plans for its reference part.
_PROFILES = {a.name: a for a in (
    Arch("hopper",    "nvidia", "sm90",    "NVIDIA H100",              132, 32, 32, 5, 232448),
    Arch("blackwell", "nvidia", "sm100",   "NVIDIA B200",              148, 32, 32, 5, 232448),
    Arch("ampere",    "nvidia", "sm80",    "NVIDIA A100",              108, 32, 32, 4, 166912),
    Arch("mi300x",    "amd",    "gfx942",  "AMD Instinct MI300X",      304, 64, 16, 2, 65536),
    Arch("mi325x",    "amd",    "gfx942",  "AMD Instinct MI325X",      304, 64, 16, 2, 65536),
    Arch("mi355x",    "amd",    "gfx950",  "AMD Instinct MI355X",      256, 64, 16, 2, 163840),
    # The Triton interpreter ignores warps and stages; keep the candidate space tiny.
    Arch("cpu",       "cpu",    "",        "cpu (Triton interpreter)",   2, 32, 4, 1, 1 << 30),
)}
_GENERIC = {
    "nvidia": dict(vendor="nvidia", warp_size=32, max_num_warps=8, max_num_stages=2, smem_bytes=49152),
    "amd": dict(vendor="amd", warp_size=64, max_num_warps=8, max_num_stages=1, smem_bytes=32768),
}

ARCH_NAMES = tuple(_PROFILES)
if ARCH_NAMES != env.ARCH_CHOICES:   # env is a leaf: it keeps its own copy of the accepted names
    raise ImportError(f"liger_rt.env.ARCH_CHOICES {env.ARCH_CHOICES} != backend profiles {ARCH_NAMES}")


def profile(name: str, *, forced: bool = False, **overrides) -> Arch:
    """The stored profile of an arch by name (no device needed)."""
    if name not in _PROFILES:
        raise ValueError(f"unknown arch {name!r}; valid arches: {', '.join(ARCH_NAMES)}")
    return dataclasses.replace(_PROFILES[name], forced=forced, **overrides)


# Device classes: tuning rows are keyed on one beside the arch, since devices of one arch differ in speed
# (H100 SXM and H200 share sm90 and 132 SMs but not memory bandwidth: 3.35 vs 4.8 TB/s, NVIDIA data sheets).
# (class, pattern in the lower-cased device name), first match wins; each class maps to itself.
_DEVICE_CLASSES = tuple((cls, re.compile(pattern)) for cls, pattern in (
    ("gh200", r"\bgh200\b"), ("gb200", r"\bgb200\b"), ("h200", r"\bh200\b"),
    ("h100-pcie", r"\bh100\b.*\bpcie\b"), ("h100-nvl", r"\bh100\b.*\bnvl\b"), ("h100", r"\bh100\b"),
    ("h800", r"\bh800\b"), ("h20", r"\bh20\b"), ("b200", r"\bb200\b"), ("b100", r"\bb100\b"),
    ("a100", r"\ba100\b"), ("a800", r"\ba800\b"), ("l40s", r"\bl40s\b"), ("l40", r"\bl40\b"), ("l4", r"\bl4\b"),
    ("a10g", r"\ba10g\b"), ("a10", r"\ba10\b"), ("mi300x", r"\bmi300x?\b"), ("mi300a", r"\bmi300a\b"),
    ("mi325x", r"\bmi325x?\b"), ("mi355x", r"\bmi355x?\b"), ("mi250x", r"\bmi250x?\b"), ("cpu", r"^cpu\b"),
))
# the arch of each known class that one arch profile serves (planning for a device on a machine without it)
DEVICE_ARCH = {**dict.fromkeys(("h100", "h100-pcie", "h100-nvl", "h200", "gh200", "h800", "h20"), "hopper"),
               **dict.fromkeys(("b200", "b100", "gb200"), "blackwell"), **dict.fromkeys(("a100", "a800"), "ampere"),
               "mi300x": "mi300x", "mi325x": "mi325x", "mi355x": "mi355x", "cpu": "cpu"}
_VENDOR_WORDS = {"nvidia", "amd", "geforce", "tesla", "instinct", "quadro"}


@functools.lru_cache(maxsize=256)
def device_class(name: str | None) -> str:
    """The normalised device class of a device name, "" for none.

    "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200", "NVIDIA GH200 480GB" -> "gh200",
    "AMD Instinct MI325X" -> "mi325x", "cpu (Triton interpreter)" -> "cpu"; an unknown device -> a slug of
    its name ("NVIDIA GeForce RTX 4090" -> "rtx-4090"); a class maps to itself ("h100" -> "h100").
    """
    low = (name or "").strip().lower()
    for cls, pattern in _DEVICE_CLASSES:
        if pattern.search(low):
            return cls
    words = re.findall(r"[a-z0-9]+", low)
    return "-".join([w for w in words if w not in _VENDOR_WORDS] or words)[:64].strip("-")


_warned_unknown: set[str] = set()


def arch_from_properties(device_name: str, *, capability: tuple[int, int] | None = None,
                         gcn_arch: str | None = None, sm_count: int = 0,
                         smem_bytes: int | None = None) -> Arch:
    """Map raw device properties (CUDA capability or ROCm gcnArchName, plus the name) to an Arch."""
    extra: dict = {"device_name": device_name}
    if sm_count:
        extra["sm_count"] = sm_count
    if gcn_arch is not None:
        vendor, chip = "amd", gcn_arch
        upper = device_name.upper()
        # MI300X and MI325X share gfx942 and the CU count: only the marketing name differs.
        gfx942 = "mi325x" if "MI325" in upper else ("mi300x" if "MI300" in upper else None)
        name = {"gfx942": gfx942, "gfx950": "mi355x"}.get(gcn_arch.split(":")[0].strip().lower())
    elif capability is not None:
        major, minor = capability
        vendor, chip = "nvidia", f"sm{major}{minor}"
        name = {9: "hopper", 10: "blackwell", 8: "ampere"}.get(major)
        if name == "ampere":
            extra["capability"] = chip
            if minor != 0:  # sm86/sm89 have 99 KiB of shared memory per block, not 163
                extra["smem_bytes"] = 101376
    else:
        return profile("cpu")
    if name is None:
        return _generic(vendor, device_name, chip, sm_count)
    if smem_bytes:
        extra["smem_bytes"] = smem_bytes
    return profile(name, **extra)


def _generic(vendor: str, device_name: str, capability: str, sm_count: int) -> Arch:
    if device_name not in _warned_unknown:
        _warned_unknown.add(device_name)
        warnings.warn(
            f"liger_rt: unknown GPU {device_name!r} ({capability}); using a conservative generic "
            f"{vendor} profile. Set LIGER_RT_ARCH to one of {', '.join(ARCH_NAMES)} to override.",
            RuntimeWarning, stacklevel=3)
    return Arch(name=f"generic-{vendor}", capability=capability, device_name=device_name,
                sm_count=sm_count, **_GENERIC[vendor])


def generic_profile(name: str) -> Arch:
    """The conservative profile of "generic-nvidia" or "generic-amd" (what an unknown GPU of that vendor gets)."""
    vendor = name.removeprefix("generic-")
    if not name.startswith("generic-") or vendor not in _GENERIC:
        raise ValueError(f"unknown arch {name!r}; valid arches: {', '.join(ARCH_NAMES)}, "
                         f"{', '.join('generic-' + v for v in _GENERIC)}")
    return Arch(name=name, capability="", device_name="", sm_count=0, **_GENERIC[vendor])


@functools.lru_cache(maxsize=16)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


@functools.lru_cache(maxsize=16)
def _detect_device(index: int | None) -> Arch:
    if index is None:
        return profile("cpu")
    props = _properties(index)
    name = getattr(props, "name", "unknown")
    sms = int(getattr(props, "multi_processor_count", 0) or 0)
    if getattr(torch.version, "hip", None):
        return arch_from_properties(name, gcn_arch=getattr(props, "gcnArchName", ""), sm_count=sms)
    return arch_from_properties(name, capability=(props.major, props.minor), sm_count=sms)


def gpu_present() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # a broken driver must not crash planning
        return False


def _index(device: torch.device | str | int | None) -> int | None:
    """The CUDA/ROCm device index of `device` (None: the current GPU); None for a cpu device or none."""
    if device is None:
        return torch.cuda.current_device() if gpu_present() else None
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type == "cpu":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def detect(device: torch.device | str | int | None = None) -> Arch:
    """The Arch of `device` (default: the current CUDA/ROCm device, else cpu); ``LIGER_RT_ARCH`` forces one."""
    forced = env.arch_override()
    index = _index(device)
    return profile(forced, forced=True) if forced else _detect_device(index)


def detect_hardware() -> Arch:
    """The Arch of the device present (the current GPU, else cpu) whatever ``LIGER_RT_ARCH`` says: what we measure."""
    return _detect_device(_index(None))


# The interpreter runs a grid's programs one after another: the cpu profile's "SM" count only sizes
# persistent grids there.
_CPU_SM_COUNT = _PROFILES["cpu"].sm_count


# sm_count repeats _index on purpose: the rms_norm, layer_norm and short_conv launchers reach it, so
# its code is part of their freshness hash; fold it into _index when their shipped rows are re-swept.
def sm_count(device: torch.device | str | int | None = None) -> int:
    """SMs (NVIDIA) or CUs (AMD) of `device` (default: the current GPU, else cpu): the one source
    of this count for grid sizing.  Cached per device; a cpu device gives the cpu profile's 2."""
    if device is None:
        if not gpu_present():
            return _CPU_SM_COUNT
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type == "cpu":
            return _CPU_SM_COUNT
        index = device.index if device.index is not None else torch.cuda.current_device()
    return int(getattr(_properties(index), "multi_processor_count", 0) or 0)


def interpreter_on() -> bool:
    """Whether Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1), read per call: tests switch it."""
    return os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def runtime_version() -> str:
    """The GPU runtime this torch was built for: "cuda 12.4", "rocm 6.3", or "" (a CPU build)."""
    if hip := getattr(torch.version, "hip", None):
        return f"rocm {hip}"
    return f"cuda {torch.version.cuda}" if torch.version.cuda else ""


def reset() -> None:
    """Forget cached device properties (tests, device changes)."""
    _properties.cache_clear()
    _detect_device.cache_clear()
    _warned_unknown.clear()
