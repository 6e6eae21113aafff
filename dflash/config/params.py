"""Loading params: the YAML file, ``--set key=value`` overrides, validation against the schema
in ``dflash.config.schema`` with errors in the params file's own words, and integer flags.

Strict where YAML is lax: a key given twice at any level (which YAML lets the last one win,
so a second ``batching:`` section silently drops the first's keys) and a file that is not
UTF-8 are errors naming where, never a run on half the params or a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from dflash.config.schema import SET_NAME, Config
from dflash.config.types import Located, SubkeyError
from dflash.errors import ConfigError
from dflash.fileio import not_a_file
from dflash.pipeline.workspace import RELATIVE


class _UniqueKeyLoader(yaml.SafeLoader):
    """A ``SafeLoader`` that refuses a mapping holding one key twice, and aliases.

    An alias (``*name``) repeats a node wherever it is used: a few lines of aliases of
    aliases expand to billions of values, so params and prompt files spell every value out.
    """

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            mark = event.start_mark
            raise ConfigError(
                f"{mark.name}: line {mark.line + 1}, column {mark.column + 1}: YAML alias "
                f"*{event.anchor} is not allowed; write the value out"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise ConfigError(
                    f"{mark.name}: line {mark.line + 1}: key {key!r} is given twice; keep one"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, where: str) -> Any:
    """``text`` as YAML (duplicate keys refused); errors name ``where`` and the line."""
    try:
        loader = _UniqueKeyLoader(text)
        loader.name = where
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}:{line} not valid YAML ({problem})") from None


def read_params_file(path: str | Path) -> dict[str, Any]:
    """The sections of a params file. Missing, empty or not a mapping is an error: a run on
    the code's defaults (which differ from the committed ``params.yaml``) is never silent."""
    path = Path(path)
    why = not_a_file(path)
    if why:
        raise ConfigError(f"params file {path} {why} (see the committed params.yaml)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"params file {path} is not UTF-8 text (byte {err.start}: {err.reason})"
        ) from None
    raw = parse_yaml(text, str(path))
    if not raw:
        raise ConfigError(f"params file {path} is empty: it must hold the param sections")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {raw!r}")
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` (value parsed as YAML, as ``dvc exp run -S`` does)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected dotted.key=value")
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part} is not a section")
    node[leaf] = parse_yaml(value, f"--set {item!r}")


def set_option(key: str, value: Any) -> str:
    """The ``--set`` giving the dotted ``key`` this ``value`` (JSON types) as
    :func:`apply_override` reads it back, quoted for a shell: for a message to name the param
    a command must run with."""
    text = json.dumps(value)
    if isinstance(value, str):
        with contextlib.suppress(ConfigError):
            text = value if parse_yaml(value, key) == value else text
    return f"--set {shlex.quote(f'{key}={text}')}"


def at_least(low: int):
    """An argparse type for integers >= ``low``: a bad value exits 2 naming flag and bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= {low}")
        return value

    return parse


def outside_message(root: Path, what: str = "a file") -> str:
    """The one wording of the rule, for the path as written (here) and links resolved."""
    return (
        f"{what} must lie under {root}/ (relative path), where dvc.yaml tracks it: copy it "
        "there and `dvc add` it, or `dvc import-url` it there"
    )


def check_location(
    source: str, key: str = "data.source", root: Path = RELATIVE.raw, what: str = "a file"
) -> None:
    """A file source must lie under ``root``, which ``dvc.yaml`` tracks: elsewhere it could
    change unnoticed. Checked where params load from a file, not in the schema, so code and
    tests may point a ``DataConfig`` at any file."""
    if source == "chitchat":
        return
    inside = Path(os.path.normpath(source)).parts[: len(root.parts) + 1]
    if Path(source).is_absolute() or Path(*inside[: len(root.parts)]) != root:
        raise ConfigError(f"{key} = {source!r}: {outside_message(root, what)}")
    if len(inside) == len(root.parts):
        raise ConfigError(f"{key} = {source!r}: name an entry inside {root}/, not {root}/ itself")


def load_config(path: str | Path | None = "params.yaml", overrides: list[str] = ()) -> Config:
    """Read ``path``, apply ``key=value`` overrides, validate; ``path=None`` = code defaults."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_params_file(path)
    for item in overrides:
        apply_override(raw, item)
    config = from_dict(raw)
    check_location(config.data.source)
    for name, spec in config.evaluate.sets.items():
        if spec.path is not None:
            check_location(spec.path, f"evaluate.sets.{name}.path", RELATIVE.prompts)
    if config.drafter.init_from is not None:
        what = "a checkpoint directory"
        check_location(config.drafter.init_from, "drafter.init_from", RELATIVE.init_drafters, what)
    return config


def from_dict(raw: dict[str, Any]) -> Config:
    """Validate plain params; the first problem becomes a ``ConfigError`` naming its key."""
    # An empty section (every key commented out) reads as None in YAML: all defaults.
    raw = {name: {} if section is None else section for name, section in raw.items()}
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err.errors()[0])) from None


_RULES = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "finite_number": "expected a finite number",
    "string_type": "expected a string",
    "string_too_short": "must not be empty: name a token, or null",
    "model_type": "expected a mapping",
    "dict_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "tuple_type": "expected a list",
    "too_short": "expected a list of 2 values",
    "too_long": "expected a list of 2 values",
    "list_type": "expected a list",
    "string_pattern_mismatch": "expected an http:// or https:// URL",
}


def _describe(error: Any) -> str:
    """One pydantic error as ``key = value: rule``, in the words of the params file."""
    key, allowed = _key_of(error["loc"])
    kind, ctx, value = error["type"], error.get("ctx", {}), error.get("input")
    if kind == "value_error" and isinstance(ctx.get("error"), Located):
        return str(ctx["error"])
    if kind == "value_error" and isinstance(ctx.get("error"), SubkeyError):
        return f"{key}.{ctx['error'].subkey} = {value[ctx['error'].subkey]!r}: {ctx['error'].rule}"
    if kind == "string_pattern_mismatch" and ctx.get("pattern") == SET_NAME:
        return f"{key} = {value!r}: a name holds letters, digits, '_', '.' and '-' only"
    if kind == "extra_forbidden":
        where = key.rpartition(".")[0] or "top level"
        return f"unknown key {key} in {where}; allowed: {', '.join(allowed)}"
    if kind == "literal_error":
        rule = f"allowed values are {ctx['expected']}"
    elif kind in ("greater_than_equal", "less_than_equal", "greater_than"):
        bound = next(k for k in ("ge", "le", "gt") if k in ctx)
        rule = f"must be {dict(ge='>=', le='<=', gt='>')[bound]} {ctx[bound]}"
    elif kind == "value_error":
        rule = str(ctx["error"])
    else:
        rule = _RULES.get(kind, error["msg"])
    return f"{key or 'params'} = {value!r}: {rule}"


def _key_of(loc: tuple) -> tuple[str, list[str]]:
    """The dotted key of a pydantic location (union tags dropped), and the names allowed
    beside its last part (for an unknown key)."""
    key, model, allowed, values = "", Config, sorted(Config.model_fields), None
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif part == "[key]":  # the mapping's name itself broke a rule
            continue
        elif values is not None:  # a name in a mapping param, e.g. evaluate.sets.<name>
            key, model, values = f"{key}.{part}", _model(values), None
        elif model is not None and (part in model.model_fields or part == loc[-1]):
            allowed = sorted(model.model_fields)
            key = f"{key}.{part}" if key else str(part)
            field = model.model_fields.get(part)
            kind = field.annotation if field else None
            model, values = _model(kind), _mapping_values(kind)
    return key, allowed


def _model(kind: Any) -> type[BaseModel] | None:
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def _mapping_values(kind: Any) -> Any:
    """The value type of a mapping annotation (``dict[str, X]``, or one in a union), else None."""
    for option in (kind, *typing.get_args(kind)):
        if typing.get_origin(option) is dict:
            return typing.get_args(option)[1]
    return None
