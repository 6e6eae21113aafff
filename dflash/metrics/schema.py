"""The metrics and stage reports as typed models: the contract between the stages that write
them and ``dflash report``, ``publish`` and ``dvc exp show`` that read them back.

Each model describes one file exactly, its fields in the order the file holds its keys, so a
writer that builds the model and dumps it writes the bytes it always did. A field with a
default is a key the file holds only sometimes. Readers of a finished run validate the file;
``dflash report`` also shows what a partial or hand-edited file holds (:func:`partial`).
``python -m dflash.metrics.schema docs/schemas`` writes their JSON Schemas.

Only pydantic and the standard library are imported: the report starts without torch.
"""

from __future__ import annotations

import functools
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model

from dflash.metrics import names

NULL_REASONS = "null_reasons"
"""The key of a file's reasons for its null figures (a file holds no NaN: JSON has none)."""
SCHEMA_FILE = "{name}.schema.json"
"""A schema's file name in the directory ``write_schemas`` fills (``docs/schemas``)."""


class Metrics(BaseModel):
    """A JSON object with fixed keys: strict, so a value is written as it was given."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    def dump(self) -> dict[str, Any]:
        """The file's object: the keys that were given (a key the writer left out stays out)."""
        return self.model_dump(exclude_unset=True)

    def present(self) -> dict[str, Any]:
        """The keys the file had, with their values as read (nested models stay models)."""
        return {k: getattr(self, k) for k in type(self).model_fields if k in self.model_fields_set}


# ------------------------------------------------------------------ stage reports
class Lines(Metrics):
    """A count, with the first line numbers that had it."""

    count: int
    first_lines: list[int]


class Kept(Metrics):
    train: int
    heldout: int


class IngestReport(Metrics):
    """``data/ingested/ingest_report.json``."""

    source: str
    records_read: int
    kept: Kept
    skipped: dict[str, Lines]
    skipped_total: int
    duplicates_removed: Lines
    duplicate_ids_renamed: Lines
    eval_fraction: float
    max_conversations: int | None
    left_out_by_max_conversations: int
    blank_messages_ignored: int | None = None
    """Only with ``data.source: chitchat``: the corpus's empty messages."""


class RegenerateReport(Metrics):
    """``data/regenerated/report.json`` (keys sorted); with ``data.regenerate: false`` only
    ``conversations`` and ``skipped``."""

    conversations: int
    conversations_per_s: float | None = None
    cut_at_stop_string: int | None = None
    empty_responses: int | None = None
    endpoint_turns: dict[str, int] | None = None
    engine: dict[str, Any] | None = None
    failed_conversations: dict[str, int] | None = None
    failed_requests: dict[str, int] | None = None
    fingerprint: str | None = None
    seconds: float | None = None
    shards: int | None = None
    shards_made: int | None = None
    shards_not_committed: list[int] | None = None
    skipped: bool
    tokens_generated: int | None = None
    tokens_per_s: float | None = None
    turns_outside_window: int | None = None
    turns_regenerated: int | None = None
    unterminated_responses: int | None = None


class SpecialTokens(Metrics):
    policy: str
    conversations: int


class Dtypes(Metrics):
    tokens: str
    loss_mask: str


class TokenManifest(Metrics):
    """``data/tokenized/manifest.json``: what the token store was made from, and its counts."""

    source: str
    tokenizer_hash: str
    vocab_size: int
    mask_token_id: int | None
    pad_token_id: int | None
    eos_token_id: int | None
    max_seq_len: int
    overlength: str
    min_loss_tokens: int
    chat_template_kwargs: dict[str, Any]
    conversations_read: int
    turns: str
    assistant_turns: dict[str, int]
    special_tokens_in_content: SpecialTokens
    truncated: int
    dropped: dict[str, int]
    n_samples: int
    n_tokens: int
    n_loss_tokens: int
    dtypes: Dtypes


class Lengths(Metrics):
    mean: float
    p50: float
    p90: float
    p99: float
    max: int


class TokenizeReport(TokenManifest):
    """``data/tokenized/tokenize_report.json``: the manifest and the sample lengths."""

    length: Lengths


class TargetDetails(Metrics):
    """``metrics/target_details.json`` (keys sorted): a pretrained or a referenced target."""

    first_loss: float | None = None
    heldout_loss: float | None = None
    heldout_perplexity: float | None = None
    heldout_tokens: int | None = None
    mode: str
    parameters: int
    steps: int | None = None
    tokens_beyond_max_seq_len: int | None = None
    train_loss: float | None = None
    train_seconds: float | None = None
    train_tokens: int | None = None


# ------------------------------------------------------------------ batching plan
class PlanFigures(Metrics):
    """Padding, rank balance and randomness of a plan (:mod:`dflash.batching.metrics`)."""

    n_steps: int
    n_micro_batches: int
    real_tokens: int
    padded_tokens: int
    padding_efficiency: float
    rank_imbalance: float
    cost_imbalance: float
    frozen_batch_fraction: float | None
    pair_overlap: float | None
    window_ks: float | None


class EpochFigures(Metrics):
    epoch: int
    n_steps: int
    n_micro_batches: int
    n_rows: int
    real_tokens: int
    padded_tokens: int
    padding_efficiency: float
    rank_imbalance: float
    cost_imbalance: float
    frozen_batch_fraction: float | None
    pair_overlap: float | None
    window_ks: float


class PlanMetrics(PlanFigures):
    """``metrics/plan.json``: the overall figures, then each epoch's."""

    epochs: list[EpochFigures]


class CostMeta(Metrics):
    anchors_per_document: int
    block_size: int
    slot_cost: float


class PlanMeta(Metrics):
    """What a plan was made from; a trainer compares it with its own run."""

    lengths_sha256: str
    n_samples: int
    strategy: str
    token_budget: int
    max_seq_len: int
    max_batch_size: int
    world_size: int
    grad_accum: int
    seed: int
    boundaries: list[int] | None
    cost: CostMeta
    epochs: int


class PlanSummary(PlanMetrics):
    """``data/plans/summary.json``: ``metrics/plan.json`` and the plan's ``meta``."""

    meta: PlanMeta


# ------------------------------------------------------------------ training
def _train_model(name: str, doc: str, metrics: tuple[names.Metric, ...]) -> type[Metrics]:
    """A model of the training metrics ``metrics``, built from their rows
    (:mod:`dflash.metrics.names`), in their order."""
    fields: dict[str, Any] = {
        m.name: (m.type, Field(m.default, description=m.doc)) for m in metrics
    }  # a default of ``...`` (names.REQUIRED): a key the file always holds
    return create_model(name, __base__=Metrics, __doc__=doc, __module__=__name__, **fields)


TrainDetails = _train_model(
    "TrainDetails", "``metrics/train_details.json`` (keys sorted).", names.details()
)
TrainHeadline = _train_model(
    "TrainHeadline",
    "``metrics/train.json``: written last, so its presence says the run finished.",
    names.shown(names.HEADLINE),
)


# ------------------------------------------------------------------ evaluation
class Baseline(Metrics):
    acceptance_length: float
    acceptance_length_pooled: float
    lossless_mismatches: int
    speedup: float | None


class Baselines(Metrics):
    ngram: Baseline
    untrained: Baseline


class LossByLength(Metrics):
    short: float | None
    medium: float | None
    long: float | None


class Records(Metrics):
    """How a prompt set was read: records, prompts taken, skipped by reason."""

    duplicates_removed: int | None = None
    prompts: int
    records_read: int
    skipped: dict[str, int]


class Stratum(Metrics):
    """τ of one group of prompts (``None`` where the group is empty)."""

    acceptance_length: float | None
    acceptance_length_ci95: list[float] | None
    acceptance_length_zlab: float | None
    n_prompts: int
    ngram_acceptance_length: float | None
    per_position_acceptance: list[float] | None
    prompt_tokens: list[int] | None = None
    """Only in a length tercile with prompts: its shortest and longest prompt."""


class EvalSet(Metrics):
    """Every figure of one prompt set (:mod:`dflash.eval.evaluate`), keys sorted."""

    acceptance_length: float
    acceptance_length_ci95: list[float]
    acceptance_length_pooled: float
    acceptance_length_zlab: float
    answer_cap_fraction: float
    answer_loop_fraction: float
    baselines: Baselines
    dflash_tokens_per_s: float
    divergence_margins: list[float]
    full_block_steps: int
    generated_tokens: int
    greedy_tokens_per_s: float
    heldout_loss: float | None = None
    heldout_loss_by_length: LossByLength | None = None
    length_tercile_edges: list[float] | None = None
    lossless_mismatches: int
    modes: list[str]
    n_prompts: int
    near_tie_divergences: int
    per_position_acceptance: list[float]
    records: Records
    speedup: float | None
    speedup_wall: float
    strata: dict[str, dict[str, Stratum]]
    target_forwards: int


class EvalDetails(EvalSet):
    """``metrics/eval_details.json``: the held-out split at the top, each prompt set of
    ``evaluate.sets`` under ``sets``, and the drafter that was scored."""

    drafter_sha256: str
    sets: dict[str, EvalSet]


# ------------------------------------------------------------------ headlines
class TargetHeadline(Metrics):
    """``metrics/target.json``."""

    heldout_perplexity: float | None = None


class RegenerateHeadline(Metrics):
    """``metrics/regenerate.json``."""

    conversations: int
    turns_regenerated: int | None = None
    tokens_generated: int | None = None
    unterminated_responses: int | None = None


class BaselineHeadline(Metrics):
    acceptance_length: float


class BaselinesHeadline(Metrics):
    ngram: BaselineHeadline
    untrained: BaselineHeadline


class LossByLengthHeadline(Metrics):
    short: float | None = None
    medium: float | None = None
    long: float | None = None


class EvalHeadline(Metrics):
    """``metrics/eval.json``: τ and its interval (also as two numbers: DVC shows no list), the
    baselines' τ, the lossless check and the per-length losses ``bench/sweep_table.py`` reads."""

    acceptance_length: float
    acceptance_length_ci95: list[float]
    acceptance_length_ci95_low: float | None = None
    acceptance_length_ci95_high: float | None = None
    acceptance_length_pooled: float
    acceptance_length_zlab: float
    per_position_acceptance: list[float]
    baselines: BaselinesHeadline
    lossless_mismatches: int
    n_prompts: int
    heldout_loss_by_length: LossByLengthHeadline | None = None


FILES: dict[str, type[Metrics]] = {
    "ingest_report": IngestReport,
    "regenerate_report": RegenerateReport,
    "regenerate": RegenerateHeadline,
    "token_manifest": TokenManifest,
    "tokenize_report": TokenizeReport,
    "target_details": TargetDetails,
    "target": TargetHeadline,
    "plan_summary": PlanSummary,
    "plan": PlanMetrics,
    "train_details": TrainDetails,
    "train": TrainHeadline,
    "eval_details": EvalDetails,
    "eval": EvalHeadline,
}
"""Every file's model by the name of its schema under ``docs/schemas``."""


def leaves(model: type[Metrics]) -> tuple[str, ...]:
    """The dotted keys of ``model``'s values, through nested models: a headline's keys."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        nested = _model_in(field.annotation)
        out += [f"{name}.{k}" for k in leaves(nested)] if nested else [name]
    return tuple(out)


# ------------------------------------------------------------------ reading back
M = TypeVar("M", bound=Metrics)


def read(model: type[M], path: Path) -> M | str:
    """The file at ``path`` as ``model``; a partial or hand-edited file keeps what fits
    (:func:`partial`); a file that is no JSON object gives why, as a phrase."""
    try:
        text = path.read_text()
        try:
            return model.model_validate_json(text)
        except ValidationError:
            data = json.loads(text)
    except (OSError, ValueError) as err:
        return type(err).__name__
    return partial(model, data) if isinstance(data, dict) else "not a JSON object"


def flaw(model: type[Metrics], path: Path, partial_ok: bool = False) -> str | None:
    """Why the file at ``path`` is no file of ``model``, as a phrase; None when it is one.

    With ``partial_ok`` a missing or unknown key is no flaw (a partial file, or one of another
    version, shows what it holds), but a file cut short or a value of the wrong type is.
    """
    try:
        model.model_validate_json(path.read_bytes())
    except OSError as err:
        return err.strerror or type(err).__name__
    except ValidationError as err:
        benign = ("missing", "extra_forbidden") if partial_ok else ()
        errors = [e for e in err.errors() if e["type"] not in benign]
        return _phrase(errors[0]) if errors else None
    return None


def _phrase(error: Any) -> str:
    if error["type"] == "json_invalid":
        return "not JSON"
    where = ".".join(map(str, error["loc"]))
    return f"{where}: {error['msg']}" if where else "not a JSON object"


def partial(model: type[M], data: dict) -> M:
    """``model`` of what ``data`` holds that fits: a value of the wrong shape and an absent key
    read None, a nested model either way as one whose values are all None, so a chain of
    attributes never fails; unknown keys are dropped. ``model_fields_set`` names the keys
    ``data`` had."""
    values = {
        name: _fit(field.annotation, data[name]) if name in data else _empty(field.annotation)
        for name, field in model.model_fields.items()
    }
    return model.model_construct(_fields_set=set(data) & set(values), **values)


def _fit(annotation: Any, value: Any) -> Any:
    """``value`` if it fits ``annotation``; nested models fitted field by field, a mapping
    entry by entry (None if one entry does not fit); else None."""
    nested = _model_in(annotation)
    if nested is not None:
        return partial(nested, value if isinstance(value, dict) else {})
    if value is None:
        return None
    if typing.get_origin(annotation) is dict and isinstance(value, dict):
        _, inner = typing.get_args(annotation)
        fitted = {k: _fit(inner, v) for k, v in value.items()}
        lost = [k for k, v in fitted.items() if v is None and value[k] is not None]
        return None if lost else fitted
    try:
        return _adapter(annotation).validate_python(value, strict=True)
    except ValidationError:
        return None


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter:
    return TypeAdapter(annotation)


def _empty(annotation: Any) -> Any:
    nested = _model_in(annotation)
    return partial(nested, {}) if nested is not None else None


def _model_in(annotation: Any) -> type[Metrics] | None:
    """The model class ``annotation`` names, alone or with None; else None."""
    if isinstance(annotation, type) and issubclass(annotation, Metrics):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if _model_in(a)]
        return models[0] if len(models) == 1 else None
    return None


# ------------------------------------------------------------------ JSON Schema
def schema_text(model: type[Metrics]) -> str:
    return json.dumps(model.model_json_schema(), indent=2) + "\n"


def write_schemas(directory: Path) -> None:
    """One schema per file of :data:`FILES` under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, model in FILES.items():
        (directory / SCHEMA_FILE.format(name=name)).write_text(schema_text(model))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dflash.metrics.schema DIR   (the project's: docs/schemas)")
    write_schemas(Path(sys.argv[1]))
