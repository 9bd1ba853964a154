"""Typed dicts: a nested dict becomes a tree of (frozen) dataclasses with every value checked against its annotation
(:func:`from_dict`, :func:`to_dict`), plus the small validators the config sections and the methods' Params use
(:func:`choice`, :func:`positive`, :func:`check_path_component`). A bad value is one ConfigError naming its dotted
path, with the allowed values or a did-you-mean for a misspelt key. NaN and infinity are refused wherever a number
goes (float fields, and free-form parameter mappings)."""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from typing import Any


from raysim.errors import ConfigError

# a float written as text (YAML 1.2 syntax: 1e-3, .inf): accepted by every float field
_FLOAT_RE = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$"
                       r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        check_finite(value, path)
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, args, path)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}")
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        check_finite(value, path)  # free-form parameters (partition_params, model.params, ...): no NaN or inf
        return dict(value)
    return _coerce_scalar(value, tp, path)


def _coerce_union(value: Any, args: tuple, path: str) -> Any:
    """``value`` as the first member of the union ``args`` that takes it (None for an Optional's None)."""
    if value is None and type(None) in args:
        return None
    real = [a for a in args if a is not type(None)]
    if len(real) == 1:  # Optional[X]: X's own error names the exact field (e.g. 'model.per_client[0].bogus')
        return _coerce(value, real[0], path)
    for a in real:
        try:
            return _coerce(value, a, path)
        except ConfigError:
            pass
    allowed = " or ".join(_type_name(a) for a in args)
    raise ConfigError(path, f"expected {allowed}, got {value!r}")


def _coerce_scalar(value: Any, tp: Any, path: str) -> Any:
    """``value`` as a bool, int, float (also from YAML 1.2 float text) or str; any other type passes unchanged."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            text = value.strip().replace("_", "")
            value = float(text.replace(".", "", 1) if text.lower().lstrip("+-") in (".inf", ".nan") else text)  # "1e-3"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return _finite(float(value), path)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    return value


def _finite(value: float, path: str) -> float:
    if not math.isfinite(value):
        raise ConfigError(path, f"must be a finite number, got {value} (NaN and infinity are never a setting)")
    return value


def check_finite(value: Any, path: str) -> None:
    """ConfigError naming the dotted path of the first NaN or infinite float inside ``value`` (mappings and lists
    walked; a YAML ``.nan`` or ``.inf`` is never a setting)."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, float):
            _finite(v, p)
        elif isinstance(v, dict):
            stack.extend((x, f"{p}.{k}" if p else str(k)) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))


def from_dict(cls, data: dict, path: str = ""):
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise :class:`ConfigError`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path or cls.__name__, f"expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(where, f"unknown key{hint}; allowed keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(where, "is required")
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(path)
    return obj


def to_dict(obj) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(obj), default=str))


def choice(path: str, value: Any, allowed) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(path, f"{value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def positive(path: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, float):
        _finite(value, path)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(path, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


# a config value that becomes part of a file or directory name (the run name, a study name): letters, digits and
# . _ + - : = only, starting with a letter or digit (no separators, no hidden names, no '..'), at most 100 characters
_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+:=-]{0,99}$")


def check_path_component(field_path: str, value) -> str:
    """``value`` may become part of a path: refuse separators, ``..``, hidden names, control characters and anything
    outside a portable character set (ConfigError naming ``field_path``)."""
    if not isinstance(value, str) or not _SAFE_COMPONENT.match(value) or ".." in value:
        raise ConfigError(field_path, f"{value!r} is not a safe name: it becomes part of a directory name, so use "
                                      f"1-100 letters, digits and . _ + - : = (starting with a letter or digit; no path "
                                      f"separators, no '..')")
    return value


def _p(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
