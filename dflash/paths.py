"""Fixed output paths of the pipeline stages, relative to the working directory.

These are the contracts in DESIGN.md; ``dvc.yaml`` names the same paths.
"""

from pathlib import Path

INGESTED = Path("data/ingested")
CONVERSATIONS = INGESTED / "conversations.parquet"
"""Training split: ``conversation_id`` (string), ``messages`` (list of {role, content})."""
HELDOUT = INGESTED / "heldout.parquet"
"""Held-out split, same schema; evaluation prompts come from here."""
INGEST_REPORT = INGESTED / "ingest_report.json"

TOKENIZER = Path("models/tokenizer")
TARGET = Path("models/target")
TARGET_METRICS = Path("metrics/target.json")

REGENERATED = Path("data/regenerated")
REGENERATED_CONVERSATIONS = REGENERATED / "conversations.parquet"
REGENERATED_SHARDS = REGENERATED / "shards"
"""Persisted between runs (``persist: true``) so an interrupted regeneration resumes."""
REGENERATE_REPORT = REGENERATED / "report.json"

TOKENIZED = Path("data/tokenized")
TOKEN_INDEX = TOKENIZED / "index.parquet"
TOKENIZE_REPORT = TOKENIZED / "tokenize_report.json"
TOKEN_MANIFEST = TOKENIZED / "manifest.json"

STATS = Path("data/stats")
PLANS = Path("data/plans")
PLAN_METRICS = Path("metrics/plan.json")
"""The flat overall figures of ``data/plans/summary.json``, for ``dvc exp show``."""

DRAFTER = Path("models/drafter")
CHECKPOINTS = Path("checkpoints")
TRAIN_METRICS = Path("metrics/train.json")
TRAIN_PLOTS = Path("plots/train")
EVAL_METRICS = Path("metrics/eval.json")
EVAL_PLOTS = Path("plots/eval")
TRAIN_LIVE = Path("dvclive/train")
"""DVCLive's copy of the training curves and summary, written at every log row (rank 0)."""
EVAL_LIVE = Path("dvclive/evaluate")
