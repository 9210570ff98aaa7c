"""Loading a config: strict YAML, dotted overrides, type coercion, and the way back out.

``load_config(path, overrides)`` goes ``read_yaml`` -> ``apply_overrides`` -> ``from_dict``
(types, unknown keys, choices) -> ``jgrpo.config.rules.validate``. ``to_dict`` is the plain
form saved with every run; ``field_docs`` and ``format_config`` print the tree with each
field's one-line doc (``--show-config``); ``read_json`` reads the small JSON files of model and
dataset folders for the pre-flight checks. Every failure raises ``ConfigError`` with one line
naming the dotted key or file and what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import textwrap
import types
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from jgrpo.config.rules import validate
from jgrpo.config.sections import Config, ConfigError


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _closest(key: str, allowed: list[str]) -> str:
    match = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
    return f"did you mean `{match[0]}`?" if match else f"allowed: {', '.join(sorted(allowed))}"


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`, converting YAML scalars where lossless."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: invalid value {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}"
            )
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(tp, type) and isinstance(value, tp):
            return value
        if isinstance(value, str) and getattr(tp, "STRING_FORM", None):
            value = {tp.STRING_FORM: value}  # e.g. a reward term given as `module:function`
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin is tuple and _named_entries(tp) is not None:
        return _coerce_named(value, _named_entries(tp), key)
    if origin is tuple and isinstance(value, dict) and _is_pairs(tp):
        value = [[k, v] for k, v in value.items()]  # {a: b} where pairs [[a, b]] are expected
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is Any:  # free-form (data.environment_args: the environment's own config)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is Callable or origin is Callable:
        if not callable(value):
            raise ConfigError(f"{key}: expected a function, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")


def _named_entries(tp: Any) -> Any:
    """The dataclass of tuple[X, ...] when X has a `name` field and a SHORT_FORM (e.g.
    ValSetConfig); None otherwise."""
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]):
        if hasattr(args[0], "SHORT_FORM") and "name" in _hints(args[0]):
            return args[0]
    return None


def _coerce_named(value: Any, cls: Any, key: str) -> tuple:
    """Named entries: a mapping {name: fields or a bare SHORT_FORM value}, or a list of field
    mappings with `name` (what `to_dict` writes) or of [name, value] pairs."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = []
        for i, entry in enumerate(value):
            if isinstance(entry, cls):
                items.append((entry.name, entry))
            elif isinstance(entry, dict) and "name" in entry:
                items.append((entry["name"], {k: v for k, v in entry.items() if k != "name"}))
            elif isinstance(entry, (list, tuple)) and len(entry) == 2:
                items.append(tuple(entry))
            else:
                raise ConfigError(
                    f"{key}[{i}]: expected a mapping with `name`, or [name, {cls.SHORT_FORM}]"
                )
    else:
        raise ConfigError(f"{key}: expected a mapping {{name: {cls.SHORT_FORM} or {{...}}}}")
    out = []
    for name, entry in items:
        if not isinstance(name, str):
            raise ConfigError(f"{key}: name {name!r} must be a string")
        if isinstance(entry, cls):
            out.append(entry)
            continue
        fields = dict(entry) if isinstance(entry, dict) else {cls.SHORT_FORM: entry}
        if "name" in fields:
            raise ConfigError(f"{key}.{name}.name: the mapping key names the entry")
        out.append(from_dict(cls, {"name": name, **fields}, prefix=f"{key}.{name}"))
    return tuple(out)


def _is_pairs(tp: Any) -> bool:
    """`tp` is tuple[tuple[K, V], ...]: a mapping is accepted for it."""
    args = typing.get_args(tp)
    return (
        len(args) == 2
        and args[1] is Ellipsis
        and typing.get_origin(args[0]) is tuple
        and len(typing.get_args(args[0])) == 2
    )


def upgrade_legacy_keys(data: dict) -> dict:
    """A copy of a whole config dict with removed keys mapped to their successors (warned):
    `grpo.val_pass_k: k` is `grpo.val_num_generations: k` + `grpo.val_pass_at: [k]`
    (val/pass@k; val/accuracy is greedy), dropped when 1 (every config.yaml saved before
    carries it); a ConfigError when the new keys are also set to something else."""
    grpo = data.get("grpo")
    if not isinstance(grpo, dict) or "val_pass_k" not in grpo:
        return data
    grpo = dict(grpo)
    k = grpo.pop("val_pass_k")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"grpo.val_pass_k: expected an integer >= 1, got {k!r}")
    if k > 1:
        if grpo.get("val_num_generations", 1) != 1 or list(grpo.get("val_pass_at", [1])) != [1]:
            raise ConfigError(
                "grpo.val_pass_k: replaced by grpo.val_num_generations and grpo.val_pass_at; "
                "give only those"
            )
        grpo |= {"val_num_generations": k, "val_pass_at": [k]}
        warnings.warn(
            f"grpo.val_pass_k: {k} is now grpo.val_num_generations: {k} with "
            f"grpo.val_pass_at: [{k}] (logged as val/pass@{k}; val/accuracy is greedy)",
            stacklevel=3,
        )
    return {**data, "grpo": grpo}


def from_dict(cls, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types (a
    whole `Config` first goes through `upgrade_legacy_keys`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    if cls is Config:
        data = upgrade_legacy_keys(data)
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key `{dotted}`; {_closest(str(key), names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and f.default is dataclasses.MISSING:
            if f.default_factory is dataclasses.MISSING:
                dotted = f"{prefix}.{f.name}" if prefix else f.name
                raise ConfigError(f"{dotted}: required key is missing")
    return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
    """Plain nested dict/list form of a config (what is saved with every run)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    if callable(cfg):  # a reward function given from Python: saved as its import path
        return f"{getattr(cfg, '__module__', '?')}:{getattr(cfg, '__qualname__', repr(cfg))}"
    return cfg


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override `{item}`: expected dotted.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override `{item}`: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"override `{key}`: cannot parse value {raw!r}") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set `a.b.c=value` items (values parsed as YAML) into a nested dict copy."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override `{item}`: `{'.'.join(parts[: i + 1])}` is not a section"
                )
            node = child
        node[parts[-1]] = value
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key repeated in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the base class reports it
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """Parse YAML file `path` strictly: UTF-8, no duplicate keys; ConfigError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a folder, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} {str(path)!r} is not UTF-8 text (byte {e.start}); is it a binary file?"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None)
        detail = f": {problem}" if problem and "duplicate key" in problem else ""
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML{where}{detail}") from None


def read_json(path: str | Path, key: str, kind: type | None = dict) -> Any:
    """Parse the small JSON file `path` (a model or dataset metadata file); ConfigError
    `key: 'path' ...` when it is unreadable, not UTF-8, not JSON or (with `kind`) not a `kind`."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{key}: {str(path)!r} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {str(path)!r} is not UTF-8 text (a binary file?)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{key}: {str(path)!r} is not valid JSON (line {e.lineno}: {e.msg})"
        ) from None
    if kind is not None and not isinstance(data, kind):
        what = {dict: "a JSON object", list: "a JSON list"}.get(kind, kind.__name__)
        raise ConfigError(f"{key}: {str(path)!r} must hold {what}, got {type(data).__name__}")
    return data


def read_config(path: Optional[str | Path] = None, overrides: list[str] = ()) -> dict:
    """The plain dict of YAML `path` (None = defaults) with dotted overrides applied; not yet
    typed or validated (the Python API adds functions and classes first)."""
    data: dict = {}
    if path is not None:
        data = read_yaml(path)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r}: expected a mapping at the top level")
    return apply_overrides(data, list(overrides))


def load_config(path: Optional[str | Path] = None, overrides: list[str] = ()) -> Config:
    """Read YAML `path` (None = defaults), apply dotted overrides, build and validate."""
    cfg = from_dict(Config, read_config(path, overrides))
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- docs


def field_docs(cls) -> dict[str, str]:
    """The one-line docstrings under each field of dataclass `cls`, by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = nxt.value.value.strip()
    return docs


def format_config(cfg: Any, indent: int = 0) -> str:
    """YAML-like text of the resolved tree with each field's doc as a comment."""
    lines = []
    docs = field_docs(type(cfg))
    pad = "  " * indent
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        doc = docs.get(f.name, "")
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:  # {doc}")
            lines.append(format_config(value, indent + 1))
        else:
            text = yaml.safe_dump(to_dict(value), default_flow_style=True).strip()
            text = text.removesuffix("...").strip()
            lines.append(f"{pad}{f.name}: {text}  # {doc}")
    return "\n".join(lines)
