"""The building blocks of the params schema (``dflash.config.schema``): bounded numbers, template
options, the section base class and the error a rule raises with its key already named."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from dflash.errors import UndeclaredParamError

INT_MAX = 2**31 - 1
"""The largest integer param: plans, token stores and tensors hold counts in 32 bits."""

Int = Annotated[int, Field(strict=True, le=INT_MAX)]


def int_at_most(limit: int) -> Any:
    """An ``Int`` bounded tighter than ``INT_MAX`` (a ``Field(le=...)`` beside ``Int`` would
    lose to the bound inside it)."""
    return Annotated[int, Field(strict=True, le=limit)]


Float = Annotated[float, Field(strict=False, allow_inf_nan=False)]
"""Lax, because YAML 1.1 reads ``1e-3`` (no dot) as a string; ``nan`` and ``inf`` refused."""


TEMPLATE_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
"""Names the pipeline itself hands every chat template."""


class SubkeyError(ValueError):
    """A rule broken by one key inside a mapping param: the message names ``param.subkey``."""

    def __init__(self, subkey: str, rule: str) -> None:
        super().__init__(rule)
        self.subkey, self.rule = subkey, rule


def _template_options(value: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(set(value) & set(TEMPLATE_RESERVED))
    if taken:
        raise SubkeyError(taken[0], "set by the pipeline for every chat, not an option")
    return value


TemplateOptions = Annotated[dict[str, Any], AfterValidator(_template_options)]


@dataclass(frozen=True)
class Choices:
    """The names a string param may take, listed when params are validated, not when this
    module is imported: plug-ins installed or added later count (``dflash.config.doc`` lists
    them too)."""

    names: Callable[[], tuple[str, ...]]

    def __call__(self, value: str) -> str:
        allowed = self.names()
        if value not in allowed:
            raise ValueError(f"allowed values are {', '.join(map(repr, allowed))}")
        return value


def one_of(names: Callable[[], tuple[str, ...]]) -> Any:
    """A string param type that must be one of ``names()``."""
    choices = Choices(names)
    return Annotated[str, AfterValidator(choices), choices]


class Located(ValueError):
    """A rule's error that already names its key (a cross-field or per-item rule)."""


def require(ok: bool, key: str, rule: str, value: Any = None) -> None:
    """Raise a ``Located`` error for ``key`` unless ``ok``."""
    if not ok:
        raise Located(f"{key} = {value!r}: {rule}")


class Section(BaseModel):
    """A section of params: frozen, strict, unknown keys refused.

    ``dflash.pipeline.declaration.restrict`` removes the params a stage does not declare; reading
    one
    of those lands in ``__getattr__`` and raises ``UndeclaredParamError``.
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True
    )

    def __getattr__(self, name: str) -> Any:
        if name in type(self).model_fields:
            section = type(self).__name__.removesuffix("Config").lower()
            raise UndeclaredParamError(
                f"read param {section}.{name}, which dvc.yaml does not declare for this stage: "
                "add it to the stage's params (or meta.knobs when it changes no output)"
            )
        return super().__getattr__(name)
