"""Reading configs: bounded YAML (size, values after aliases, nesting; YAML 1.2 floats such as ``1e-3``), the
``--set dotted.key=value`` overrides, and the small files a user names (configs, search spaces), each problem one
ConfigError naming the file or key."""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from raysim.errors import ConfigError
from raysim.config.registry import algorithm_class


# PyYAML follows YAML 1.1, whose float pattern needs a dot and a signed exponent: ``1e-3`` and ``1E6`` load as
# strings. This loader adds YAML 1.2's float syntax, so every float field accepts them (files and --set alike).
_YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping that gives one key twice (YAML forbids it; PyYAML would silently keep the last value)."""


class YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-3``, ``5E-4``, ``1e6`` as floats (YAML 1.2) and refuses a key given
    twice in one mapping (:class:`DuplicateKeyError`; keys merged in with ``<<`` may be overridden, as YAML says)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: PyYAML reports it itself
                    continue
                if first is not key_node.start_mark:
                    raise DuplicateKeyError(None, None, f"the key {key!r} is given twice in one mapping (first on "
                                                        f"line {first.line + 1}); YAML allows a key once — keep the "
                                                        f"value you mean", key_node.start_mark)
        return super().construct_mapping(node, deep)


YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))


MAX_YAML_BYTES = 1 << 20  # config and search-space files (a config is a few KB)
MAX_YAML_VALUES = 100_000  # values in the document once aliases are expanded (a 'billion laughs' stays far below)
MAX_YAML_DEPTH = 32  # nesting of mappings and lists


class YamlBoundsError(yaml.YAMLError):
    """A YAML document that is too large once expanded, or nested too deeply."""


def _check_bounds(data, source: str) -> None:
    """Walk the loaded document as the tree it stands for (aliases expanded), giving up after MAX_YAML_VALUES values
    or below MAX_YAML_DEPTH levels: a document of nested aliases is refused in O(limit) time and memory, before
    anything copies or serialises it."""
    count = 0
    stack = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise YamlBoundsError(f"{source}: expands to more than {MAX_YAML_VALUES:,} values (nested YAML aliases, "
                                  f"a 'billion laughs' document?); raysim refuses it — write the values out")
        if isinstance(node, dict):
            children = list(node.keys()) + list(node.values())
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth >= MAX_YAML_DEPTH:
            raise YamlBoundsError(f"{source}: nested more than {MAX_YAML_DEPTH} levels deep; raysim refuses it")
        stack.extend((c, depth + 1) for c in children)


def yaml_load(text: str, source: str = "<string>"):
    """Parse YAML text with :class:`YamlLoader`; ``source`` names the file in error messages. The document is
    bounded: at most MAX_YAML_BYTES of text, MAX_YAML_VALUES values with aliases expanded, MAX_YAML_DEPTH levels."""
    import io

    if len(text) > MAX_YAML_BYTES:
        raise YamlBoundsError(f"{source}: {len(text):,} characters, more than the {MAX_YAML_BYTES:,} a config may hold")
    stream = io.StringIO(text)
    stream.name = source  # PyYAML's marks name the stream's ``name``
    depth = 0  # the parser is iterative (the composer recurses): refuse deep nesting before composing
    for event in yaml.parse(stream, Loader=YamlLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise YamlBoundsError(f"{source}: nested more than {MAX_YAML_DEPTH} levels deep; raysim refuses it")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    stream = io.StringIO(text)
    stream.name = source
    try:
        data = yaml.load(stream, Loader=YamlLoader)
    except RecursionError:
        raise YamlBoundsError(f"{source}: nested too deeply to parse; raysim refuses it") from None
    _check_bounds(data, source)
    return data


def yaml_error_text(e: yaml.YAMLError, source: str) -> str:
    """A YAML error in one line: where (file, line, column) and what."""
    if isinstance(e, YamlBoundsError):
        return str(e)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else source
    what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
    return f"{where}: {what}".replace("\n", " ")


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(text, "an override must look like dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(text, "an override needs a key before '='")
    try:
        value = yaml_load(raw, "--set") if raw.strip() else ""
    except YamlBoundsError as e:
        raise ConfigError(key, str(e)) from None
    except DuplicateKeyError as e:
        raise ConfigError(key, f"--set: {e.problem}") from None
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict, key: str, value) -> dict:
    """A copy of the config dict ``data`` with ``key`` (dotted) set to ``value``; sections are created as needed."""
    data = copy.deepcopy(data or {})
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(parts[: i + 1]), f"is a value, not a section; cannot set {key}")
        node = nxt
    node[parts[-1]] = value
    return data


RESET_PARAMS = "reset_params"  # algorithm.reset_params: true -> a switched method starts from its own defaults


def apply_overrides(data: dict, overrides: list[str] | None, notify=None) -> dict:
    """``data`` with every ``dotted.key=value`` override applied. When an override changes ``algorithm.name``, the
    method's parameters are reconciled (:func:`switch_method`): the file's parameters were written for the file's
    method, so the new method keeps only those it shares, and ``notify`` (default: one line on stderr) names each kept
    value beside the new method's default; ``--set algorithm.reset_params=true`` takes the new method's defaults."""
    data = json.loads(json.dumps(data or {}))
    before = copy.deepcopy(data)
    for text in overrides or []:
        data = set_dotted(data, *parse_override(text))
    return switch_method(before, data, explicit_params(overrides), notify)


def explicit_params(overrides) -> set:
    """The ``algorithm.params`` names the overrides set one by one (``algorithm.params.NAME=...``) or as a whole
    mapping (``algorithm.params={...}``): the user's own choices for the new method, never 'carried over'."""
    out: set = set()
    for k, v in map(parse_override, overrides or []):
        if k.startswith("algorithm.params.") and k.count(".") >= 2:
            out.add(k.split(".", 2)[2])
        elif k == "algorithm.params" and isinstance(v, dict):
            out |= set(v)
    return out


def _algorithm_section(data) -> dict | None:
    return data.get("algorithm") if isinstance(data, dict) and isinstance(data.get("algorithm"), dict) else None


def switch_method(before: dict, after: dict, explicit: set = frozenset(), notify=None) -> dict:
    """``after`` (a config dict made from ``before`` by overrides or a sweep's values) with its method's parameters
    reconciled when ``algorithm.name`` changed: parameters the new method lacks are dropped, shared ones are kept and
    the notice names each beside the new method's default (``kept lam=1.0; fedtgp's default is 10.0``);
    ``algorithm.reset_params: true`` keeps only ``explicit`` (the parameters the user set for the new method) so the
    rest take the new method's defaults. ``reset_params`` is a directive, never part of the config it returns."""
    algo = _algorithm_section(after)
    if algo is None:
        return after
    reset = algo.pop(RESET_PARAMS, False)
    if not isinstance(reset, bool):
        raise ConfigError(f"algorithm.{RESET_PARAMS}", f"must be true or false, got {reset!r}")
    old = (_algorithm_section(before) or {}).get("name") or "the default method"
    new = algo.get("name") or "the default method"
    if new == old:
        if reset:
            (notify or _stderr_notice)(f"algorithm.{RESET_PARAMS}=true does nothing: algorithm.name is unchanged "
                                       f"({new})")
        return after
    if isinstance(algo.get("params"), dict):
        algo["params"] = _switch_params(old, new, algo["params"], set(explicit), notify, reset)
    return after


def _show(v) -> str:
    """A parameter value as the user writes it in YAML (true, 1.0, fedavg, [1, 2])."""
    return v if isinstance(v, str) else json.dumps(v)


def _switch_params(old: str, new: str, params: dict, explicit: set, notify, reset: bool) -> dict:
    try:
        fields = {f.name: f for f in dataclasses.fields(algorithm_class(new).Params)}
    except Exception:  # an unknown name is reported, naming algorithm.name, when the config is built
        return params
    carried = [k for k in params if k not in explicit]
    if reset:
        if carried:
            (notify or _stderr_notice)(
                f"algorithm.name changed from {old} to {new}: algorithm.{RESET_PARAMS}=true, so {new} runs with its "
                f"own defaults; not carried over: {', '.join(f'{k}={_show(params[k])}' for k in carried)}")
        return {k: v for k, v in params.items() if k in explicit}
    dropped = [k for k in carried if k not in fields]
    kept = [k for k in carried if k in fields]
    if dropped or kept:
        parts = []
        if dropped:
            parts.append(f"dropped algorithm.params {', '.join(dropped)} ({new} has no such parameters)")
        for k in kept:
            d = _default(fields[k])
            same = d is not dataclasses.MISSING and _show(d) == _show(params[k])
            parts.append(f"kept {k}={_show(params[k])}; " + (f"{new}'s default too" if same else
                                                            f"{new}'s default is {_show(d)}"
                                                            if d is not dataclasses.MISSING else f"{new} has no default"))
        if any("default is" in p for p in parts):
            parts.append(f"--set algorithm.{RESET_PARAMS}=true takes {new}'s defaults instead")
        (notify or _stderr_notice)(f"algorithm.name changed from {old} to {new}: " + "; ".join(parts))
    return {k: v for k, v in params.items() if k not in dropped}


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _stderr_notice(message: str) -> None:
    from raysim.errors import printable

    print(f"raysim: note: {printable(message)}", file=sys.stderr)


def read_text_file(path: str | Path, field_name: str, max_bytes: int = MAX_YAML_BYTES, what: str = "file") -> str:
    """The text of a small file the user named (config, search space): one ConfigError naming ``field_name`` and the
    file when it is missing, a directory or not a regular file, unreadable, too large, or not UTF-8 text."""
    import os
    import stat

    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(field_name, f"file not found: {path}") from None
    except OSError as e:
        raise ConfigError(field_name, f"cannot read {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(field_name, f"{path} is a directory; give the {what} inside it")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(field_name, f"{path} is not a regular file; give a YAML {what}")
    if st.st_size > max_bytes:
        raise ConfigError(field_name, f"{path} is {st.st_size:,} bytes, more than the {max_bytes:,} a {what} may "
                                      f"hold; is it the right file?")
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(field_name, f"cannot read {path}: {e.strerror or e}; check its permissions") from None
    if b"\0" in raw:
        raise ConfigError(field_name, f"{path} is a binary file, not a YAML {what} (damaged or the wrong file)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(field_name, f"{path} is not UTF-8 text (byte {e.start}); damaged or the wrong file") from None


def load_yaml_mapping(path: str | Path, field_name: str = "CONFIG", what: str = "config") -> dict:
    """A YAML file holding a mapping; errors name ``field_name`` (the argument that gave the path) and the file."""
    path = Path(path)
    text = read_text_file(path, field_name, what=what)
    try:
        data = yaml_load(text, str(path))
    except YamlBoundsError as e:
        raise ConfigError(field_name, str(e)) from None
    except yaml.YAMLError as e:
        raise ConfigError(field_name, f"not valid YAML: {yaml_error_text(e, str(path))}") from None
    if data is None:
        raise ConfigError(field_name, f"{path} is empty (no settings); write the {what} into it"
                                      + (" (a config of defaults: name: experiment)" if what == "config" else ""))
    if not isinstance(data, dict):
        raise ConfigError(field_name, f"{path} must hold a mapping at the top level, got {type(data).__name__} "
                                      f"(damaged or the wrong file?)")
    return data


def load_config_dict(path: str | Path) -> dict:
    return load_yaml_mapping(path, "CONFIG")
