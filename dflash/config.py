"""Typed configuration loaded from ``params.yaml``.

One dataclass per top-level section. Loading rejects unknown keys and bad values at once,
naming the dotted key, the value and what is allowed, so a typo in ``params.yaml`` or in
``dvc exp run -S`` never trains the wrong thing silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from dflash import paths


class ConfigError(ValueError):
    """A parameter is unknown or has a value outside what is allowed."""


@dataclass(frozen=True)
class DataConfig:
    source: str = "chitchat"
    """``chitchat`` (the PyPI package) or a path to a ``.jsonl`` / ``.parquet`` file."""
    eval_fraction: float = 0.05
    max_seq_len: int = 1024
    overlength: Literal["truncate", "drop"] = "truncate"
    regenerate: bool = True
    max_conversations: int | None = None
    """Keep only the first N conversations after ingest (None = all); for quick runs."""
    chunk_size: int = 1024
    """Records tokenized per chunk: bounds memory of the tokenize stage."""
    num_workers: int | None = None
    """Processes that tokenize; None = every core. The output is the same for any count."""
    turns: Literal["per_conversation", "per_turn"] = "per_conversation"
    """One sample per conversation, or one per assistant turn (see dflash.data.chat)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options every chat rendering passes to the template, e.g. {enable_thinking: false}."""

    def validate(self) -> None:
        _check_template_kwargs("data.chat_template_kwargs", self.chat_template_kwargs)
        _check_range("data.eval_fraction", self.eval_fraction, 0.0, 0.5)
        _check_min("data.max_seq_len", self.max_seq_len, 8)
        _check_min("data.chunk_size", self.chunk_size, 1)
        if self.num_workers is not None:
            _check_min("data.num_workers", self.num_workers, 1)
        if self.max_conversations is not None:
            _check_min("data.max_conversations", self.max_conversations, 1)
        if self.source == "chitchat":
            return
        if not self.source.endswith((".jsonl", ".parquet")):
            raise ConfigError(
                f"data.source = {self.source!r}: allowed are 'chitchat' or a path ending in "
                "'.jsonl' or '.parquet'"
            )
        # ingest depends on paths.RAW in dvc.yaml: a file elsewhere could change unnoticed.
        inside = Path(os.path.normpath(self.source)).parts[: len(paths.RAW.parts)]
        if Path(self.source).is_absolute() or Path(*inside) != paths.RAW:
            raise ConfigError(
                f"data.source = {self.source!r}: a file must lie under {paths.RAW}/ (relative "
                "path), where dvc.yaml tracks it: copy it there and `dvc add` it, or "
                "`dvc import-url` it there"
            )


@dataclass(frozen=True)
class TokenizerConfig:
    path: str | None = None
    """An existing Hugging Face tokenizer directory; None trains a byte-level BPE."""
    vocab_size: int = 4096

    def validate(self) -> None:
        _check_min("tokenizer.vocab_size", self.vocab_size, 300)


@dataclass(frozen=True)
class TargetConfig:
    path: str | None = None
    """A Hugging Face causal-LM directory; None builds and pretrains the tiny default."""
    num_hidden_layers: int = 6
    hidden_size: int = 128
    intermediate_size: int = 384
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    pretrain_epochs: int = 2
    pretrain_lr: float = 1.0e-2
    pretrain_batch_tokens: int = 4096
    end_token_weight: float = 1.0
    """Loss weight of the end-of-turn token in pretraining; w > 1 makes turns end sooner."""
    seed: int = 0

    def validate(self) -> None:
        _check_min("target.num_hidden_layers", self.num_hidden_layers, 4)
        _check_min("target.hidden_size", self.hidden_size, 16)
        _check_min("target.intermediate_size", self.intermediate_size, 1)
        _check_min("target.num_attention_heads", self.num_attention_heads, 1)
        _check_min("target.num_key_value_heads", self.num_key_value_heads, 1)
        _check_min("target.pretrain_lr", self.pretrain_lr, 0.0)
        _check_min("target.pretrain_batch_tokens", self.pretrain_batch_tokens, 1)
        _check_min("target.seed", self.seed, 0)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"target.hidden_size = {self.hidden_size}: must be a multiple of "
                f"target.num_attention_heads = {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"target.num_key_value_heads = {self.num_key_value_heads}: must divide "
                f"target.num_attention_heads = {self.num_attention_heads}"
            )
        _check_min("target.pretrain_epochs", self.pretrain_epochs, 0)
        _check_min("target.end_token_weight", self.end_token_weight, 1.0)


@dataclass(frozen=True)
class RegenerateConfig:
    temperature: float = 0.0
    """0 = greedy, as DFlash trains on the target's own greedy outputs."""
    max_new_tokens: int = 48
    batch_size: int = 32
    shard_size: int = 256
    """Conversations per written shard; an interrupted run resumes at the next shard."""
    seed: int = 0

    def validate(self) -> None:
        _check_min("regenerate.temperature", self.temperature, 0.0)
        _check_min("regenerate.max_new_tokens", self.max_new_tokens, 1)
        _check_min("regenerate.batch_size", self.batch_size, 1)
        _check_min("regenerate.shard_size", self.shard_size, 1)
        _check_min("regenerate.seed", self.seed, 0)


@dataclass(frozen=True)
class DrafterConfig:
    block_size: int = 16
    num_hidden_layers: int = 1
    num_target_features: int = 3
    """How many target layers' hidden states are fused (paper: 5)."""
    gamma: float = 7.0
    """Loss decay: slot k weighs exp(-(k-1)/gamma)."""
    anchors_per_sequence: int = 512
    mask_token: str | None = None
    """An existing token the drafter fills blocks with (a reserved special token of a target
    with no spare embedding rows); None adds ``<|MASK|>`` to the tokenizer when missing."""

    def validate(self) -> None:
        _check_min("drafter.block_size", self.block_size, 2)
        if self.mask_token is not None and not self.mask_token:
            raise ConfigError("drafter.mask_token = '': name a token, or null for <|MASK|>")
        _check_min("drafter.num_hidden_layers", self.num_hidden_layers, 1)
        _check_min("drafter.num_target_features", self.num_target_features, 1)
        _check_min("drafter.gamma", self.gamma, 1e-6)
        _check_min("drafter.anchors_per_sequence", self.anchors_per_sequence, 1)


@dataclass(frozen=True)
class BatchingConfig:
    strategy: Literal["sorted", "shuffle", "bucketed", "packed"] = "bucketed"
    token_budget: int = 16384
    max_batch_size: int = 64
    num_buckets: int = 6
    boundaries: Union[Literal["optimal", "quantile", "token_mass"], list[int]] = "optimal"  # noqa: UP007
    seed: int = 0

    def validate(self) -> None:
        _check_min("batching.token_budget", self.token_budget, 1)
        _check_min("batching.max_batch_size", self.max_batch_size, 1)
        _check_min("batching.num_buckets", self.num_buckets, 1)
        _check_min("batching.seed", self.seed, 0)
        if isinstance(self.boundaries, list) and (
            sorted(set(self.boundaries)) != self.boundaries or self.boundaries[:1] < [1]
        ):
            raise ConfigError(
                f"batching.boundaries = {self.boundaries!r}: an explicit list must be positive "
                "and strictly increasing"
            )


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 6
    world_size: int = 2
    grad_accum: int = 1
    lr: float = 6.0e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    clip_grad: float = 1.0
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    max_nonfinite_steps: int = 10
    """Consecutive non-finite losses tolerated (each skips its step) before the run stops."""
    num_workers: int = 1
    prefetch: int = 4
    seed: int = 0

    def validate(self) -> None:
        _check_min("train.epochs", self.epochs, 1)
        _check_min("train.world_size", self.world_size, 1)
        _check_min("train.grad_accum", self.grad_accum, 1)
        _check_min("train.lr", self.lr, 0.0)
        _check_range("train.warmup_ratio", self.warmup_ratio, 0.0, 1.0)
        _check_min("train.weight_decay", self.weight_decay, 0.0)
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"train.betas[{i}] = {beta!r}: must be in [0, 1)")
        _check_min("train.clip_grad", self.clip_grad, 0.0)
        _check_min("train.checkpoint_every", self.checkpoint_every, 1)
        _check_min("train.keep_checkpoints", self.keep_checkpoints, 1)
        _check_min("train.max_nonfinite_steps", self.max_nonfinite_steps, 1)
        _check_min("train.num_workers", self.num_workers, 0)
        _check_min("train.prefetch", self.prefetch, 1)
        _check_min("train.seed", self.seed, 0)


@dataclass(frozen=True)
class EvaluateConfig:
    num_prompts: int = 64
    max_new_tokens: int = 48
    near_tie_margin: float = 0.05
    """A divergence from greedy whose top-2 target logits are this close is a near-tie
    (rounding, e.g. bf16 on GPU), counted apart from real lossless mismatches."""
    seed: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    """Template options for the prompts scored; None = data.chat_template_kwargs."""

    def validate(self) -> None:
        if self.chat_template_kwargs is not None:
            _check_template_kwargs("evaluate.chat_template_kwargs", self.chat_template_kwargs)
        _check_min("evaluate.num_prompts", self.num_prompts, 1)
        _check_min("evaluate.max_new_tokens", self.max_new_tokens, 1)
        _check_min("evaluate.seed", self.seed, 0)
        _check_min("evaluate.near_tie_margin", self.near_tie_margin, 0.0)


@dataclass(frozen=True)
class LoggingConfig:
    wandb: Literal["offline", "online", "disabled"] = "offline"
    every: int = 10
    project: str = "dflash"

    def validate(self) -> None:
        _check_min("logging.every", self.every, 1)


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path | None = "params.yaml", overrides: list[str] = ()) -> Config:
    """Read ``path``, apply ``key=value`` overrides, validate; ``path=None`` = code defaults.

    A missing or empty params file is an error, not a silent run on the code's defaults
    (which differ from the committed ``params.yaml``).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"params file {path} does not exist (see the committed params.yaml)")
        raw = _parse_yaml(Path(path).read_text(), str(path))
        if not raw:
            raise ConfigError(f"params file {path} is empty: it must hold the param sections")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {raw!r}")
    for item in overrides:
        apply_override(raw, item)
    return from_dict(raw)


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}:{line} not valid YAML ({problem})") from None


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
    node[leaf] = _parse_yaml(value, f"--set {item!r}")


def from_dict(raw: dict[str, Any]) -> Config:
    config = _build(Config, raw, "")
    for section in dataclasses.fields(config):
        getattr(config, section.name).validate()
    _validate_across(config)
    return config


def _validate_across(config: Config) -> None:
    """Rules that tie two sections together."""
    seq = config.data.max_seq_len
    for key, new in (
        ("regenerate.max_new_tokens", config.regenerate.max_new_tokens),
        ("evaluate.max_new_tokens", config.evaluate.max_new_tokens),
    ):
        if new >= seq:
            raise ConfigError(
                f"{key} = {new}: must be below data.max_seq_len = {seq}, which must also hold "
                "the prompt"
            )
    min_loss = 2 * config.drafter.block_size
    if config.data.regenerate and config.regenerate.max_new_tokens < min_loss:
        raise ConfigError(
            f"regenerate.max_new_tokens = {config.regenerate.max_new_tokens}: a regenerated "
            f"answer could never reach the {min_loss} loss tokens (2 x drafter.block_size) a "
            "sample needs"
        )
    budget = config.batching.token_budget
    if budget < seq:
        raise ConfigError(
            f"batching.token_budget = {budget}: must be >= data.max_seq_len = {seq}, so a "
            "micro-batch can hold the longest sample"
        )
    if 2 * config.drafter.block_size > seq:
        raise ConfigError(
            f"drafter.block_size = {config.drafter.block_size}: two blocks must fit in "
            f"data.max_seq_len = {seq}"
        )


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'params'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]} in {where}; allowed: {', '.join(sorted(names))}"
        )
    kwargs = {}
    for name in names & set(raw):
        kwargs[name] = _coerce(hints[name], raw[name], f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it in the annotated type."""
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key} = {value!r}: allowed values are {', '.join(map(repr, args))}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for option in args:
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(option, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{key} = {value!r}: not any of the allowed forms ({'; '.join(errors)})")
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key} = {value!r}: expected a mapping with string keys")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r}: expected a list")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key} = {value!r}: expected a list of {len(args)} values")
        return tuple(
            _coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads ``1e-3`` (no dot) as a string; accept what float() reads.
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} = {value!r}: expected a number")
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {value!r}: expected a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r}: expected a string")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


TEMPLATE_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
"""Names the pipeline itself hands every chat template."""


def _check_template_kwargs(key: str, value: dict) -> None:
    taken = sorted(set(value) & set(TEMPLATE_RESERVED))
    if taken:
        raise ConfigError(f"{key}.{taken[0]}: set by the pipeline for every chat, not an option")


def _check_min(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{key} = {value!r}: must be >= {low}")


def _check_range(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{key} = {value!r}: must be between {low} and {high}")


class UndeclaredParamError(RuntimeError):
    """A stage read a param its declaration in ``dflash.cli.STAGES`` does not list."""


class ParamsView:
    """The params one stage may read; reading any other raises ``UndeclaredParamError``.

    ``dvc.yaml`` reruns a stage only when a param it declares changes, so a param read but not
    declared is a silent staleness bug: the view turns it into an error at the first read.
    ``allowed`` holds dotted keys; a section name allows the whole section.
    """

    def __init__(self, node: Any, allowed: frozenset[str], stage: str, prefix: str = "") -> None:
        self._node, self._allowed, self._stage, self._prefix = node, allowed, stage, prefix

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._node, name)
        key = self._prefix + name
        if _covered(key, self._allowed):
            return value
        if dataclasses.is_dataclass(value):
            return ParamsView(value, self._allowed, self._stage, key + ".")
        raise UndeclaredParamError(
            f"stage {self._stage!r} read param {key}, which its declaration in dflash.cli.STAGES "
            "does not list: declare it there and in dvc.yaml"
        )

    def to_dict(self) -> dict[str, Any]:
        """The readable params only, nested by section (what a run logs as its config)."""
        full = unwrap(self).to_dict()
        out: dict[str, Any] = {}
        for key in sorted(self._allowed):
            section, _, leaf = key.partition(".")
            value = full[section] if not leaf else {leaf: full[section][leaf]}
            out.setdefault(section, {}).update(value)
        return out


def restrict(config: Config, allowed: typing.Iterable[str], stage: str) -> Config:
    """``config`` seen through a ``ParamsView`` that allows only ``allowed``."""
    return typing.cast(Config, ParamsView(config, frozenset(allowed), stage))


def unwrap(config: Config) -> Config:
    """The whole ``Config`` behind a view: to hand params on to a child process, not to read."""
    while isinstance(config, ParamsView):
        config = config._node
    return config


def _covered(key: str, allowed: frozenset[str]) -> bool:
    return key in allowed or any(key.startswith(a + ".") for a in allowed)
