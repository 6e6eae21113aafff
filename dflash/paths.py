"""Fixed output paths of the pipeline stages, relative to the working directory.

These are the contracts in docs/design.md; ``dvc.yaml`` names the same paths.
"""

from pathlib import Path

RAW = Path("data/raw")
"""User-supplied datasets (``data.source``), tracked by ``dvc add``; a dep of ``ingest``."""
PROMPTS = Path("data/prompts")
"""User prompt sets ``evaluate`` scores (``evaluate.sets``); a dep of ``evaluate`` only, so
adding a set reruns nothing else."""
DVC_CACHE = Path(".dvc/cache")
"""Where ``dvc add`` with ``cache.type: symlink`` points the files of ``data/raw/``."""

INGESTED = Path("data/ingested")
CONVERSATIONS = INGESTED / "conversations.parquet"
"""Training split: ``conversation_id`` (string), ``messages`` (list of {role, content})."""
HELDOUT = INGESTED / "heldout.parquet"
"""Held-out split, same schema; evaluation prompts come from here."""
INGEST_REPORT = INGESTED / "ingest_report.json"
INGEST_UNCAPPED = "uncapped.parquet"
"""Scratch file of the ingest stage's output directory while ``data.max_conversations`` cuts."""

TOKENIZER = Path("models/tokenizer")
TOKENIZER_INFO = "dflash_tokenizer.json"
"""In a tokenizer directory: where it came from, its mask token and its hash."""
TARGET = Path("models/target")
TARGET_REFERENCE = "dflash_target.json"
WEIGHTS_INDEX = "model.safetensors.index.json"
"""A Hugging Face model's map from tensor name to safetensors file, when it has several."""
WEIGHTS_FILE = "model.safetensors"
"""A Hugging Face model's weights, when they fit in one safetensors file."""
"""In a target directory: the reference to a model that is not copied (``target.path``)."""
TARGET_METRICS = Path("metrics/target.json")
"""The headline figures (:mod:`dflash.headline`); ``TARGET_DETAILS`` holds them all."""
TARGET_DETAILS = Path("metrics/target_details.json")

REGENERATED = Path("data/regenerated")
REGENERATED_CONVERSATIONS = REGENERATED / "conversations.parquet"
REGENERATED_SHARDS = REGENERATED / "shards"
"""Persisted between runs (``persist: true``) so an interrupted regeneration resumes."""
REGENERATE_REPORT = REGENERATED / "report.json"
"""Every figure of the run; ``REGENERATE_METRICS`` holds its headline data counts."""
REGENERATE_METRICS = Path("metrics/regenerate.json")
REGENERATED_SHARD = "shard_{index:05d}"
"""A shard's stem: ``.parquet`` holds its conversations, ``.json`` commits it (written last)."""
REGENERATED_SHARD_COMMITS = "shard_*.json"

TOKENIZED = Path("data/tokenized")
STORE_TOKENS = "tokens.bin"
STORE_LOSS_MASK = "loss_mask.bin"
STORE_INDEX = "index.parquet"
STORE_MANIFEST = "manifest.json"
"""The four files of a token store directory (``dflash.data.store``)."""
TOKEN_INDEX = TOKENIZED / STORE_INDEX
TOKENIZE_REPORT = TOKENIZED / "tokenize_report.json"
TOKEN_MANIFEST = TOKENIZED / STORE_MANIFEST

STATS = Path("data/stats")
STATS_LENGTHS = STATS / "lengths.json"
STATS_BUCKETS = STATS / "buckets.json"
"""Bucket edges by every method, with predicted and simulated padding efficiency."""
STATS_HISTOGRAM = STATS / "histogram.csv"
STATS_PLOT = STATS / "lengths.png"
PLANS = Path("data/plans")
PLAN_EPOCH = "epoch_{epoch:03d}.parquet"
PLAN_EPOCH_GLOB = "epoch_*.parquet"
PLAN_SUMMARY = "summary.json"
PLAN_METRICS = Path("metrics/plan.json")
"""The flat overall figures of ``data/plans/summary.json``, for ``dvc exp show``."""

HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
"""A Hugging Face model directory's weights: one file, or an index of shards."""

DRAFTER = Path("models/drafter")
DRAFTER_CONFIG = "config.json"
DRAFTER_WEIGHTS = "model.safetensors"
"""The Hugging Face names serving stacks look for in a drafter directory."""
DRAFTER_CODE = "dflash.py"
"""The remote-code modelling file ``auto_map`` names (``trust_remote_code=True``)."""
DRAFTER_CARD = "README.md"
"""The model card: serving commands, training params, figures."""
CHECKPOINTS = Path("checkpoints")
CHECKPOINT_NAME = "step_{step:08d}"
"""A checkpoint directory: ``torch.distributed.checkpoint`` shards and index, and CHECKPOINT_RUN."""
CHECKPOINT_GLOB = "step_" + "[0-9]" * 8
CHECKPOINT_RUN = "run.json"
"""In a checkpoint directory: the run fingerprint and step, read before any shard."""
TRAIN_LOCK = CHECKPOINTS / "train.lock"
"""Held (``flock``) by the one training run of a workspace; holds its PID."""
TRAIN_METRICS = Path("metrics/train.json")
"""The headline figures (:mod:`dflash.headline`), written last; ``TRAIN_DETAILS`` holds all."""
TRAIN_DETAILS = Path("metrics/train_details.json")
TRAIN_PLOTS = Path("plots/train")
TRAIN_LOG = TRAIN_PLOTS / "log.csv"
EVAL_METRICS = Path("metrics/eval.json")
"""The headline figures (:mod:`dflash.headline`), written last; ``EVAL_DETAILS`` holds all."""
EVAL_DETAILS = Path("metrics/eval_details.json")
EVAL_PLOTS = Path("plots/eval")
EVAL_ACCEPTANCE = EVAL_PLOTS / "acceptance.csv"
EVAL_STRATA = EVAL_PLOTS / "strata.csv"
"""τ per prompt set and stratum (``all`` first), with the interval and the n-gram baseline."""
TRAIN_LIVE = Path("dvclive/train")
"""DVCLive's copy of the training curves and summary, written at every log row (rank 0)."""
EVAL_LIVE = Path("dvclive/evaluate")

SCHEMAS = Path("docs/schemas")
"""The JSON Schema of every metrics file and stage report (:mod:`dflash.metrics_schema`)."""
SCHEMA_FILE = "{name}.schema.json"
