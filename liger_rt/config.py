"""Launch configs as data: a frozen dataclass per op whose fields declare the values they may take.

    @dataclasses.dataclass(frozen=True)
    class ToyConfig(Config):
        BLOCK: int = knob(64, pow2(16, 1024))       # the values a candidate or a DB row may hold
        num_warps: int = knob(4, WARPS)

    ToyConfig(BLOCK=48)                             # ConfigError: ToyConfig.BLOCK=48 is not one of 16, 32, ...
    ToyConfig.parse('{"BLOCK": 32, "num_warps": 4}')
"""
from __future__ import annotations

import dataclasses
import functools
import json
import typing
from typing import Mapping


class ConfigError(ValueError):
    """A config (from a DB row, a file or code) that the op does not declare."""


def knob(default, choices):
    """A config field and the values it may take (what candidates and DB rows must stay within)."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def pow2(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo to hi inclusive."""
    return tuple(1 << k for k in range(lo.bit_length() - 1, hi.bit_length()))


WARPS = pow2(1, 32)
STAGES = (1, 2, 3, 4, 5, 6)


@dataclasses.dataclass(frozen=True)
class Config:
    """Base of every op's launch config: frozen, typed, each field declared with :func:`knob` (or a nested
    Config).  Construction validates, so a config outside the declared space can neither be generated nor read
    back from a DB row."""

    def __post_init__(self) -> None:
        for f, typ in _fields(type(self)):
            value = getattr(self, f.name)
            if isinstance(typ, type) and issubclass(typ, Config):
                if not isinstance(value, typ):
                    raise ConfigError(f"{type(self).__name__}.{f.name} must be a {typ.__name__}, got {value!r}")
                continue
            if type(value) is not typ and not (typ is float and type(value) is int):
                raise ConfigError(f"{type(self).__name__}.{f.name} must be {typ.__name__}, got {value!r}")
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ConfigError(f"{type(self).__name__}.{f.name}={value!r} is not one of "
                                  f"{', '.join(map(str, choices))}")

    @classmethod
    def parse(cls, data: Mapping | str) -> "Config":
        """The config a DB row or an export holds; every field must be present and declared."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except ValueError as exc:
                raise ConfigError(f"{cls.__name__}: config is not JSON ({exc})") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"{cls.__name__}: config must be a JSON object, got {type(data).__name__}")
        fields = dict((f.name, typ) for f, typ in _fields(cls))
        unknown = sorted(set(data) - set(fields))
        missing = sorted(set(fields) - set(data))
        if unknown or missing:
            raise ConfigError(f"{cls.__name__}: fields are {', '.join(fields) or 'none'}; "
                              f"unknown {unknown or 'none'}, missing {missing or 'none'}")
        return cls(**{k: (typ.parse(data[k]) if isinstance(typ, type) and issubclass(typ, Config) else data[k])
                      for k, typ in fields.items()})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def keys(self):                 # dict(config) gives the JSON form's top level
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, name: str):
        return getattr(self, name)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def limits(self) -> tuple[int, int]:
        """(most warps, most stages) of any launch this config makes: what an arch prunes on."""
        warps, stages = 1, 1
        for f, typ in _fields(type(self)):
            v = getattr(self, f.name)
            if isinstance(v, Config):
                w, s = v.limits()
                warps, stages = max(warps, w), max(stages, s)
            elif f.name.endswith("num_warps"):
                warps = max(warps, v)
            elif f.name.endswith("num_stages"):
                stages = max(stages, v)
        return warps, stages


@dataclasses.dataclass(frozen=True)
class NoConfig(Config):
    """Implementations without launch knobs (torch, grouped MM)."""


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> tuple:
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def config_dict(config) -> dict:
    """A config (dataclass or mapping) as a JSON-able dict."""
    return config.to_dict() if isinstance(config, Config) else dict(config)
