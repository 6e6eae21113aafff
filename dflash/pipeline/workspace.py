"""Where a workspace keeps each stage's outputs: the contracts in docs/design.md.

``dvc.yaml`` names the same paths, relative to the directory DVC runs the stages in. The
command line builds one ``Workspace`` per run and the stage hands its paths down; the
library packages never read one. File names inside an output that are a format's own (the
token store's files, checkpoint names, a Hugging Face model directory's files) live with the
code that writes that format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def _at(relative: str, doc: str = "") -> property:
    return property(lambda self: self.root / relative, doc=doc)


@dataclass(frozen=True)
class Workspace:
    root: Path = Path(".")

    raw = _at("data/raw", "User-supplied datasets (``data.source``), a dep of ``ingest``.")
    prompts = _at(
        "data/prompts",
        "User prompt sets ``evaluate`` scores (``evaluate.sets``); a dep of ``evaluate`` only, "
        "so adding a set reruns nothing else.",
    )
    dvc_cache = _at(
        ".dvc/cache", "Where ``dvc add`` with ``cache.type: symlink`` points ``data/raw/``."
    )

    ingested = _at("data/ingested")
    conversations = _at(
        "data/ingested/conversations.parquet",
        "Training split: ``conversation_id`` (string), ``messages`` (list of {role, content}).",
    )
    heldout = _at(
        "data/ingested/heldout.parquet",
        "Held-out split, same schema; evaluation prompts come from here.",
    )
    ingest_report = _at("data/ingested/ingest_report.json")

    tokenizer = _at("models/tokenizer")
    target = _at("models/target")
    target_metrics = _at(
        "metrics/target.json",
        "The headline figures (:mod:`dflash.metrics.headline`); ``target_details`` holds them all.",
    )
    target_details = _at("metrics/target_details.json")

    regenerated = _at("data/regenerated")
    regenerated_conversations = _at("data/regenerated/conversations.parquet")
    regenerated_shards = _at(
        "data/regenerated/shards",
        "Resume state, kept between runs so an interrupted regeneration resumes; no DVC output.",
    )
    regenerate_report = _at(
        "data/regenerated/report.json",
        "Every figure of the run; ``regenerate_metrics`` holds its headline data counts.",
    )
    regenerate_metrics = _at("metrics/regenerate.json")

    tokenized = _at("data/tokenized", "A token store (:mod:`dflash.data.store`).")
    tokenize_report = _at("data/tokenized/tokenize_report.json")

    stats = _at("data/stats", "Length statistics (:mod:`dflash.batching.length_stats`).")
    stats_buckets = _at(
        "data/stats/buckets.json", "Bucket edges by every method; training's length classes."
    )
    features = _at(
        "data/features",
        "The target's features per sample, in hs-connectors' file format (:mod:`dflash.train."
        "capture`), or only its manifest.",
    )
    hidden_states = _at(
        "data/hidden_states",
        "Where engines' connectors write hidden states (their ``shared_storage_path``, or a link "
        "to it): the one directory whose files the engine client reads and deletes.",
    )
    plans = _at("data/plans", "Every epoch's plan (:mod:`dflash.batching.io`).")
    plan_metrics = _at(
        "metrics/plan.json",
        "The flat overall figures of the plans' summary, for ``dvc exp show``.",
    )

    drafter = _at(
        "models/drafter", "A Hugging Face model directory (:mod:`dflash.model.hf_files`)."
    )
    init_drafters = _at(
        "models/init",
        "Checkpoints ``drafter.init_from`` names, a dep of ``train``: a changed one retrains.",
    )
    checkpoints = _at(
        "checkpoints", "Training checkpoints (:mod:`dflash.train.checkpointing.checkpoint`)."
    )
    provenance = _at(
        ".dflash/provenance",
        "What made each stage's outputs (:mod:`dflash.pipeline.provenance`): a stage run by hand "
        "refuses inputs made from other params.",
    )
    lock = _at(
        ".dflash/lock",
        "Held (``flock``) by the one stage writing the workspace (:mod:`dflash.pipeline.lock`); "
        "holds its PID and command.",
    )
    train_failures = _at(
        ".dflash/train-failures.log",
        "torchrun's log records and, for a failed train job, its report and the ranks' "
        "tracebacks: the terminal shows one line naming it "
        "(:mod:`dflash.train.distributed.agent`).",
    )
    train_metrics = _at(
        "metrics/train.json",
        "The headline figures (:mod:`dflash.metrics.headline`), written last; "
        "``train_details`` holds all.",
    )
    train_details = _at("metrics/train_details.json")
    train_log = _at("plots/train/log.csv")
    train_steps = _at(
        "plots/train/steps.csv", "Each finite step's loss beside its mean sample length."
    )
    train_live = _at(
        "dvclive/train",
        "DVCLive's copy of the training curves and summary, written at every log row (rank 0).",
    )

    eval_metrics = _at(
        "metrics/eval.json",
        "The headline figures (:mod:`dflash.metrics.headline`), written last; "
        "``eval_details`` holds all.",
    )
    eval_details = _at("metrics/eval_details.json")
    eval_acceptance = _at("plots/eval/acceptance.csv")
    eval_strata = _at(
        "plots/eval/strata.csv",
        "τ per prompt set and stratum (``all`` first), with the interval and the n-gram baseline.",
    )
    eval_prompts = _at(
        "metrics/eval_prompts.csv",
        "τ of each scored prompt, its set, strata and token digest (:mod:`dflash.eval.records`).",
    )
    eval_live = _at("dvclive/evaluate")


RELATIVE = Workspace()
"""The paths as ``params.yaml``, ``dvc.yaml`` and a git revision name them: relative to the
workspace root that stages run in."""
