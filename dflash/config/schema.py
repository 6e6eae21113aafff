"""The typed params of the pipeline: one pydantic model per section of ``params.yaml``.

Unknown keys, wrong types and values out of range are rejected when params load, and the
error names the dotted key, the value and what is allowed, so a typo in ``params.yaml`` or
in ``dvc exp run -S`` never trains the wrong thing silently. Which params each stage may
read is declared in ``dvc.yaml`` only (``dflash.pipeline.declaration``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from dflash.batching.choices import BOUNDARY_METHODS, strategy_names
from dflash.config.plugins import choices
from dflash.config.types import Float, Int, Section, TemplateOptions, int_at_most, one_of, require
from dflash.features.choices import feature_choices, topologies


class DataConfig(Section):
    source: str = "chitchat"
    """``chitchat`` (the PyPI package) or a ``.jsonl`` / ``.parquet`` file under data/raw/."""
    eval_fraction: Float = Field(0.05, ge=0.0, le=0.5)
    """Share of conversations held out for evaluation, split deterministically by content."""
    max_seq_len: Int = Field(512, ge=8)
    """Longest sample in tokens; longer ones follow ``overlength``."""
    overlength: Literal["truncate", "drop"] = "truncate"
    """What a sample longer than ``max_seq_len`` becomes: cut to it, or left out (counted)."""
    regenerate: bool = True
    """Train on the target's own answers, as DFlash does; false keeps the corpus's answers."""
    max_conversations: Int | None = Field(1000, ge=1)
    """Keep only the first N conversations after ingest (None = all); for quick runs."""
    chunk_size: Int = Field(1024, ge=1)
    """Records tokenized per chunk: bounds memory of the tokenize stage."""
    num_workers: Int | None = Field(None, ge=1)
    """Processes that tokenize; None = every core. The output is the same for any count."""
    turns: Literal["auto", "per_conversation", "per_turn"] = "auto"
    """How a conversation becomes samples: ``auto`` learns every turn in the context it was
    served in, with as few samples as the template allows (see dflash.data.chat)."""
    special_tokens_in_content: Literal["drop", "escape", "keep"] = "drop"
    """A conversation whose text holds the tokenizer's special-token strings (a written
    ``<|im_end|>``) is left out, tokenized as plain text, or kept as control tokens (see
    dflash.data.specials)."""
    chat_template_kwargs: TemplateOptions = {}
    """Options every chat rendering passes to the template, e.g. {enable_thinking: false}."""

    @field_validator("source")
    @classmethod
    def _source(cls, source: str) -> str:
        if source != "chitchat" and not source.endswith((".jsonl", ".parquet")):
            raise ValueError("allowed are 'chitchat' or a path ending in '.jsonl' or '.parquet'")
        return source


class TokenizerConfig(Section):
    path: str | None = None
    """An existing Hugging Face tokenizer directory; None trains a byte-level BPE."""
    vocab_size: Int = Field(4096, ge=300)
    """Vocabulary of the trained BPE (ignored with ``path``)."""


class TargetConfig(Section):
    path: str | None = None
    """A Hugging Face causal-LM directory; None builds and pretrains the tiny default."""
    num_hidden_layers: Int = Field(6, ge=4)
    """Decoder layers of the tiny default target."""
    hidden_size: Int = Field(128, ge=16)
    """Hidden size of the tiny default target."""
    intermediate_size: Int = Field(384, ge=1)
    """MLP width of the tiny default target."""
    num_attention_heads: Int = Field(4, ge=1)
    """Attention heads of the tiny default target."""
    num_key_value_heads: Int = Field(2, ge=1)
    """Key/value heads of the tiny default target (grouped-query attention)."""
    pretrain_epochs: Int = Field(3, ge=0)
    """Epochs of the tiny default target's pretraining on the corpus."""
    pretrain_lr: Float = Field(5.0e-3, ge=0.0)
    """Peak learning rate of that pretraining."""
    pretrain_batch_tokens: Int = Field(1024, ge=1)
    """Tokens per pretraining batch: small batches, many steps."""
    end_token_weight: Float = Field(2.0, ge=1.0)
    """Loss weight of the end-of-turn token in pretraining; w > 1 makes turns end sooner."""
    seed: Int = Field(0, ge=0)
    """Seed of the tiny target's initialisation and pretraining order."""

    @model_validator(mode="after")
    def _heads(self) -> TargetConfig:
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        require(
            self.hidden_size % heads == 0,
            "target.hidden_size",
            f"must be a multiple of target.num_attention_heads = {heads}",
            self.hidden_size,
        )
        require(
            heads % kv == 0,
            "target.num_key_value_heads",
            f"must divide target.num_attention_heads = {heads}",
            kv,
        )
        return self


class RegenerateConfig(Section):
    temperature: Float = Field(0.0, ge=0.0)
    """0 = greedy, as DFlash trains on the target's own greedy outputs."""
    max_new_tokens: Int = Field(48, ge=1)
    """Longest regenerated answer; a longer one is cut and counted as unterminated."""
    batch_size: Int = Field(32, ge=1)
    """Prompts per ``generate`` call in process (transformers backend)."""
    shard_size: Int = Field(256, ge=1)
    """Conversations per written shard; an interrupted run resumes at the next shard."""
    seed: Int = Field(0, ge=0)
    """Seed of sampling when ``temperature`` > 0."""
    backend: Literal["transformers", "openai"] = "transformers"
    """``transformers`` generates in this process; ``openai`` asks serving engines (vLLM,
    SGLang, ``transformers serve``) through their OpenAI-compatible API."""
    model: str | None = None
    """The served model name (openai); None = the one model the endpoints list."""
    endpoints: list[Annotated[str, Field(pattern=r"^https?://")]] = []
    """Base URLs of the servers (openai), e.g. ``http://127.0.0.1:8000/v1``: a run knob."""
    concurrency: Int = Field(32, ge=1)
    """Conversations in flight at once over all endpoints (openai): a run knob."""
    timeout_s: Float = Field(600.0, gt=0.0)
    """Seconds one request may take in all, however slowly it answers, before it is retried
    (openai): a run knob."""
    max_retries: Int = Field(3, ge=0)
    """Retries of a request that failed transiently, on the least busy endpoint: a run knob."""
    max_failed_fraction: Float = Field(0.01, ge=0.0, le=1.0)
    """Share of conversations that may fail on the servers (left out) before the run fails,
    leaving the previous output in place: a run knob."""

    @model_validator(mode="after")
    def _endpoints(self) -> RegenerateConfig:
        require(self.backend != "openai" or bool(self.endpoints), "regenerate.endpoints",
                 "the openai backend needs at least one URL, e.g. [http://127.0.0.1:8000/v1]",
                 self.endpoints)  # fmt: skip
        return self


class DrafterConfig(Section):
    family: one_of(choices("dflash.drafters", "DRAFTER")) = "dflash"
    """The kind of drafter (listed below): a module of ``dflash.drafters`` or an installed
    plug-in."""
    init_from: str | None = None
    """A DFlash checkpoint directory under models/init/ (z-lab's, speculators' or this
    project's export) that training starts from; None starts from random weights. Its
    geometry is the drafter's: the keys below that are set must agree with it
    (docs/finetune.md)."""
    block_size: Int = Field(16, ge=2)
    """Tokens per drafted block, the anchor included (paper: 16); with ``init_from`` it must
    be the checkpoint's, since tokenize and plan use it too."""
    num_hidden_layers: Int | None = Field(1, ge=1)
    """Drafter layers (paper: 5); null follows ``init_from``'s checkpoint."""
    num_target_features: Int | None = Field(3, ge=1)
    """How many target layers' hidden states are fused (paper: 5); null follows
    ``init_from``'s checkpoint, whose layer ids are kept."""
    gamma: Float = Field(7.0, ge=1e-6)
    """Loss decay: slot k weighs exp(-(k-1)/gamma)."""
    anchors_per_sequence: Int = Field(32, ge=1)
    """Blocks trained per document per epoch, anchored at random answer positions (paper: 512)."""
    mask_token: str | None = Field(None, min_length=1)
    """An existing token the drafter fills blocks with (a reserved special token of a target
    with no spare embedding rows); None adds ``<|MASK|>`` to the tokenizer when missing."""
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    """Per drafter layer, full attention or attention within ``sliding_window`` positions
    (counted inside a document); null = all full. Exported as ``layer_types``, as vLLM and
    SGLang read it."""
    sliding_window: Int | None = Field(None, ge=1)
    """Positions a ``sliding_attention`` layer sees: key position > query position - window."""
    causal: bool = False
    """Block slots see only the slots at or before their own (exported as
    ``dflash_config.causal``); false is the paper's bidirectional block."""
    conv_kernel_size: Int = Field(2, ge=1)
    """``dflash2``: taps of each block-local convolution, slot t mixing with slots t-1 ..
    t-taps+1 of its own block; at most ``block_size``."""
    conv_group_size: Int = Field(16, ge=1)
    """``dflash2``: contiguous hidden channels that share one content-dependent kernel value;
    must divide the target's hidden size."""
    selector_rank: Int = Field(16, ge=1)
    """``dflash2``: rank of the selector's two codebooks over the vocabulary. 16 is an eighth
    of the tiny target's 128 hidden channels, so the codebooks (2 x 4,096 x 16 = 131K weights)
    stay about half the one-layer drafter (246K); z-lab's published config uses 256 of
    6,656."""
    selector_top_k: Int = Field(16, ge=1)
    """``dflash2``: candidates per slot, the head's top-K that the selector rescores; at most
    the vocabulary size."""

    @property
    def min_loss_tokens(self) -> int:
        """Loss tokens a sample needs, two blocks' worth: fewer leave no room for one anchored
        block plus its targets (the tokenize stage drops such a sample)."""
        return 2 * self.block_size

    @model_validator(mode="after")
    def _follows(self) -> DrafterConfig:
        for key in ("num_hidden_layers", "num_target_features"):
            require(self.init_from is not None or getattr(self, key) is not None,
                    f"drafter.{key}", "null follows drafter.init_from, which is null: "
                    "set a number", None)  # fmt: skip
        types = self.layer_types
        if types is not None:
            require(len(types) == self.num_hidden_layers, "drafter.layer_types",
                    f"needs one entry per layer: drafter.num_hidden_layers = "
                    f"{self.num_hidden_layers}", types)  # fmt: skip
        sliding = "sliding_attention" in (types or [])
        require(sliding == (self.sliding_window is not None), "drafter.sliding_window",
                "is set exactly when drafter.layer_types holds sliding_attention",
                self.sliding_window)  # fmt: skip
        for key, default in (("layer_types", None), ("causal", False)):
            require(self.init_from is None or getattr(self, key) == default, f"drafter.{key}",
                    f"must be {default} with drafter.init_from: the checkpoint's layers are "
                    "kept", getattr(self, key))  # fmt: skip
        require(self.conv_kernel_size <= self.block_size, "drafter.conv_kernel_size",
                f"reaches past a block: at most drafter.block_size = {self.block_size}",
                self.conv_kernel_size)  # fmt: skip
        return self


class ObjectiveConfig(Section):
    loss: one_of(choices("dflash.objectives", "OBJECTIVE")) = "ce"
    """What each block slot is trained on (listed below): a module of ``dflash.objectives`` or
    an installed plug-in."""
    position_weight: one_of(choices("dflash.objectives.weights", "POSITION_WEIGHT")) = "decay"
    """How block slots weigh (listed below): a module of ``dflash.objectives.weights`` or an
    installed plug-in."""
    dpace_alpha: Float = Field(0.5, ge=0.0, le=1.0)
    """D-PACE smoothing: a slot's confidence q counts as (1 - alpha) q + alpha."""
    selector_alpha: Float = Field(1.0, ge=0.0)
    """Weight of the selector's K-way cross-entropy beside the head's loss, for drafters with a
    candidate selector (``dflash2``); others have no such term."""


class BatchingConfig(Section):
    strategy: one_of(strategy_names) = "bucketed"
    """How samples become micro-batches (docs/batching.md): a module of
    ``dflash.batching.strategies`` or an installed plug-in."""
    token_budget: Int = Field(2048, ge=1)
    """Padded tokens (rows x longest row) per micro-batch; a packed row holds up to this many."""
    max_batch_size: Int = Field(64, ge=1)
    """Rows per micro-batch at most."""
    num_buckets: Int = Field(6, ge=1)
    """Length buckets of ``bucketed``."""
    boundaries: Literal[BOUNDARY_METHODS] | list[Int] = "optimal"
    """How ``bucketed`` draws its bucket edges: the exact optimum, equal counts, equal tokens,
    or the given edges."""
    seed: Int = Field(0, ge=0)
    """Seed of every plan's shuffles (with the epoch)."""
    slot_cost: Float = Field(1.5, ge=0.0)
    """One drafter block slot's training cost in target tokens, for dealing micro-batches to
    ranks by cost (``dflash.batching.cost``): 1.5 for the tiny default, about 0.5 for the
    paper's recipe (a 5-layer drafter with the LM head, forward and backward, against a
    36-layer target's forward); ``bench/step_time.py`` measures it. 0 deals by padded tokens
    alone."""

    @field_validator("boundaries")
    @classmethod
    def _edges(cls, edges: str | list[int]) -> str | list[int]:
        if isinstance(edges, list) and (sorted(set(edges)) != edges or edges[:1] < [1]):
            raise ValueError("an explicit list must be positive and strictly increasing")
        return edges


MAX_EPOCHS = 10_000
"""A plan file per epoch: past this, a typo (2147483647) would fill the disk with plans."""
MAX_RANKS = 65_536
"""Past this no launcher starts a job; what one machine runs is checked before launch."""


class TrainConfig(Section):
    epochs: int_at_most(MAX_EPOCHS) = Field(6, ge=1)
    """Passes over the training samples."""
    max_steps: Int | None = Field(None, ge=0)
    """Stop after this many optimizer steps of the run (null: every planned step): a pilot,
    the start of the full run with its learning-rate schedule, exported and measured as a
    finished run; 0 exports the drafter as initialised."""
    world_size: int_at_most(MAX_RANKS) = Field(2, ge=1)
    """Training processes; the plans are made for this many ranks."""
    grad_accum: Int = Field(1, ge=1)
    """Micro-batches per rank per optimizer step."""
    lr: Float = Field(3.0e-3, ge=0.0)
    """Peak learning rate, shaped by ``schedule``; Muon's steps are scaled to AdamW's update
    size, so one rate serves both."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw for every weight; muon: Muon for the 2-D weights of the drafter's layers, AdamW
    for the input projection ``fc`` and the norms (``dflash.train.optim``). Not with fsdp."""
    schedule: Literal["cosine", "wsd", "linear", "constant"] = "cosine"
    """The learning rate after warm-up: cosine to 0; wsd holds the peak, then falls linearly
    to 0 over the last ``decay_ratio`` of the steps; linear to 0; constant."""
    warmup_ratio: Float = Field(0.04, ge=0.0, le=1.0)
    """Share of the steps spent warming the learning rate up linearly."""
    warmup_steps: Int | None = Field(None, ge=0)
    """Warm-up in optimizer steps, in place of ``warmup_ratio``; null = use the ratio."""
    decay_ratio: Float = Field(0.2, ge=0.0, le=1.0)
    """wsd: share of the run's steps spent decaying, at its end (after the warm-up)."""
    weight_decay: Float = Field(0.0, ge=0.0)
    """Decoupled weight decay (AdamW's and Muon's)."""
    betas: tuple[Float, Float] = Field((0.9, 0.95), strict=False)
    """AdamW betas."""
    clip_grad: Float = Field(1.0, ge=0.0)
    """Total gradient norm each step is clipped to."""
    checkpoint_every: Int = Field(50, ge=1)
    """Optimizer steps between checkpoints: a run knob."""
    keep_checkpoints: Int = Field(3, ge=1)
    """Newest checkpoints of a run kept on disk: a run knob."""
    keep_runs: Int = Field(3, ge=1)
    """Runs (params, data, code) whose checkpoints are kept on disk, this one included; the
    least recently written past it are removed when a run starts, except one a live process
    trains (its ``run.lock`` is held): a run knob. ``dflash clean`` lists and removes them."""
    checkpoint_dir: str | None = None
    """Where checkpoints are kept, relative to the workspace or absolute (null: checkpoints/);
    across nodes a directory every node mounts at the same path, checked before training: a
    run knob."""
    max_restarts: Int = Field(0, ge=0)
    """Times torchrun restarts the job after a rank fails, each from the last checkpoint: a
    run knob."""
    rendezvous_timeout_s: Float = Field(300.0, gt=0.0)
    """Seconds the nodes of a job spanning several wait for each other to meet before giving
    up, the head naming those that never came: a run knob, each node's own."""
    max_nonfinite_steps: Int = Field(10, ge=1)
    """Non-finite losses in a row that stop the run; each one before skips its step."""
    num_workers: Int = Field(1, ge=0)
    """DataLoader worker processes per rank: a run knob."""
    prefetch: Int = Field(4, ge=1)
    """Micro-batches each loader worker prepares ahead: a run knob."""
    seed: Int = Field(0, ge=0)
    """Seed of the drafter's initialisation and of anchor draws."""
    recompute: bool = False
    """Recompute the drafter's layer activations in backward (same gradients, less memory):
    a run knob, for the token budgets that do not fit otherwise (bench/gpu_memory.py)."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every rank holds the whole target and drafter; fsdp: both sharded per layer
    (``dflash.train.distributed.parallel``), for targets larger than one device. Decoupled, fsdp
    shards
    the target over the target ranks and the drafter over the drafter ranks."""
    topology: one_of(topologies) = "colocated"
    """Where the target runs (listed below: a module of ``dflash.features.sources``):
    colocated, on every rank; decoupled, on ``target_ranks`` more ranks that send its features
    to the ``world_size`` drafter ranks; engine, on serving engines (the ``engine`` section).
    The same plan, the same losses up to float order."""
    features: one_of(feature_choices) = "target"
    """target: a target forward per micro-batch (where ``topology`` says); files: read the
    features the ``capture`` stage wrote once to ``data/features/``, so an experiment that
    changes only batching or training runs no target forward."""
    target_ranks: int_at_most(MAX_RANKS) = Field(1, ge=1)
    """Ranks that run the frozen target when decoupled; the job has world_size + target_ranks."""
    feature_prefetch: Int = Field(2, ge=1)
    """Micro-batches of features in flight per drafter rank when decoupled."""
    eval_every: Int = Field(0, ge=0)
    """Optimizer steps between validations of the drafter on the held-out batch that
    ``simulated_tau`` uses (``dflash.train.simulated``): its loss, top-1 accuracy and
    simulated τ, logged as ``val_loss``, ``val_accuracy`` and ``val_simulated_tau``, and once
    more at the run's last step; 0 = none. Not with engine or files features, which run no
    target to answer the held-out prompts."""
    keep_best: bool = False
    """Export the drafter of the validation with the highest ``val_simulated_tau`` instead of
    the last one, and report its step; needs ``eval_every`` > 0."""

    @model_validator(mode="after")
    def _features(self) -> TrainConfig:
        require(self.features != "files" or self.topology != "decoupled", "train.features",
                 "files needs no target ranks: use train.topology colocated or engine",
                 self.features)  # fmt: skip
        return self

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for i, beta in enumerate(betas):
            require(0.0 <= beta < 1.0, f"train.betas[{i}]", "must be in [0, 1)", float(beta))
        return betas

    @model_validator(mode="after")
    def _choices(self) -> TrainConfig:
        require(self.optimizer != "muon" or self.parallelism != "fsdp", "train.optimizer",
                "muon needs whole weight matrices; train.parallelism = 'fsdp' shards them: use "
                "'adamw' or train.parallelism = 'ddp'", self.optimizer)  # fmt: skip
        require(not self.keep_best or self.eval_every > 0, "train.keep_best",
                "true needs validations to pick from: set train.eval_every > 0, or false",
                self.keep_best)  # fmt: skip
        return self


class EngineConfig(Section):
    """Serving engines that compute the target's hidden states (``train.topology: engine``, or
    the ``capture`` stage's producer): vLLM started with the ``extract_hidden_states``
    speculative method and an hs-connectors connector (docs/engines.md)."""

    endpoints: list[Annotated[str, Field(pattern=r"^https?://")]] = []
    """Base URLs of the servers, e.g. ``http://127.0.0.1:8000/v1``: a run knob."""
    backend: Literal["file", "mooncake"] = "file"
    """How the states travel (the connector the servers run): file, safetensors files on a
    filesystem shared with the servers; mooncake, a Mooncake store (needs its package)."""
    model: str | None = None
    """The served model name sent with each request; None sends none (one served model)."""
    timeout_s: Float = Field(120.0, gt=0.0)
    """Seconds one document's request and its file may take before a retry: a run knob."""
    max_retries: Int = Field(3, ge=0)
    """Retries of a failed document, on the next endpoint, before the run stops: a run knob."""


SET_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
"""A prompt set's name: a metrics key and part of a file name."""


HELDOUT_SET = "heldout"
"""The name the held-out split is scored and reported under."""


class PromptSetConfig(Section):
    """One prompt set ``evaluate`` scores; a key left null takes ``evaluate``'s own."""

    path: str | None = None
    """A ``.jsonl`` / ``.parquet`` file of conversations under data/prompts/; null for
    ``heldout``."""
    num_prompts: Int | None = Field(None, ge=1)
    max_new_tokens: Int | None = Field(None, ge=1)
    modes: dict[Annotated[str, Field(pattern=SET_NAME)], TemplateOptions] | None = None
    """Template options per named mode, each prompt scored in every mode, e.g. {thinking:
    {enable_thinking: true}, plain: {enable_thinking: false}}; null = one mode, ``default``,
    with evaluate.chat_template_kwargs."""

    @field_validator("path")
    @classmethod
    def _path(cls, path: str | None) -> str | None:
        if path is not None and not path.endswith((".jsonl", ".parquet")):
            raise ValueError("allowed are a path ending in '.jsonl' or '.parquet'")
        return path

    @field_validator("modes")
    @classmethod
    def _modes(cls, modes: dict | None) -> dict | None:
        if modes is not None and not modes:
            raise ValueError("name at least one mode, or null for the default one")
        return modes


class EvaluateConfig(Section):
    num_prompts: Int = Field(64, ge=1)
    """Held-out prompts decoded."""
    max_new_tokens: Int = Field(48, ge=1)
    """Longest decoded answer."""
    near_tie_margin: Float = Field(0.05, ge=0.0)
    """A divergence from greedy whose top-2 target logits (in fp32) are this close, plus the
    target dtype's rounding at their size, is a near-tie (rounding, e.g. bf16 on GPU),
    counted apart from real lossless mismatches."""
    seed: Int = Field(0, ge=0)
    """Seed of the prompt draw, the cut before an assistant turn and the bootstrap."""
    chat_template_kwargs: TemplateOptions | None = None
    """Template options for the prompts scored; None = data.chat_template_kwargs."""
    sets: dict[Annotated[str, Field(pattern=SET_NAME)], PromptSetConfig] = {}
    """Prompt sets scored beside the held-out split, by name; ``heldout`` (no path) sets the
    held-out split's own modes, prompt count and answer length."""

    @field_validator("sets")
    @classmethod
    def _sets(cls, sets: dict[str, PromptSetConfig]) -> dict[str, PromptSetConfig]:
        for name, spec in sets.items():
            rule = "the held-out split has no path" if spec.path else "a prompt set needs a path"
            require((name == HELDOUT_SET) == (spec.path is None), f"evaluate.sets.{name}.path",
                    rule, spec.path)  # fmt: skip
        return sets


class ExportConfig(Section):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the exported drafter's weights; ``auto`` is the one the target's config serves
    in (bf16 for a bf16 target), so a CPU run does not hand a bf16 target fp32 weights."""


class LoggingConfig(Section):
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode, rank 0 only; DVCLive always logs."""
    every: Int = Field(10, ge=1)
    """Optimizer steps between log rows and simulated-τ measurements."""
    project: str = "dflash"
    """wandb project name: a run knob."""


class Config(BaseModel):
    """All params. A stage gets the ones ``dvc.yaml`` declares for it (``restrict``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    target: TargetConfig = TargetConfig()
    regenerate: RegenerateConfig = RegenerateConfig()
    drafter: DrafterConfig = DrafterConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    batching: BatchingConfig = BatchingConfig()
    train: TrainConfig = TrainConfig()
    engine: EngineConfig = EngineConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    export: ExportConfig = ExportConfig()
    logging: LoggingConfig = LoggingConfig()
    _unrestricted: Config | None = PrivateAttr(None)
    """Behind a ``restrict``-ed view, the params it was cut from: to hand on, never to read."""

    @model_validator(mode="after")
    def _across(self) -> Config:
        """Rules that tie two sections together."""
        require(self.train.topology != "engine" or bool(self.engine.endpoints),
                 "engine.endpoints", "train.topology engine needs at least one URL, e.g. "
                 "[http://127.0.0.1:8000/v1]", self.engine.endpoints)  # fmt: skip
        engine = self.train.topology == "engine"
        require(not engine or self.objective.loss == "ce", "objective.loss",
                 "kl needs the target's last hidden state, which engine features do not carry: "
                 "use ce with them, or train.features files captured by the target in process",
                 self.objective.loss)  # fmt: skip
        require(not engine or self.train.eval_every == 0, "train.eval_every",
                 "validation reads the held-out batch the target answers in process, which "
                 "engine features do not have: use 0 with them, or train.features files "
                 "captured by the target in process", self.train.eval_every)  # fmt: skip
        seq, budget, block = self.data.max_seq_len, self.batching.token_budget, self.drafter
        hold = f"must be below data.max_seq_len = {seq}, which must also hold the prompt"
        answers = [("regenerate", self.regenerate), ("evaluate", self.evaluate)]
        answers += [(f"evaluate.sets.{n}", s) for n, s in self.evaluate.sets.items()]
        for key, new in answers:
            if new.max_new_tokens is not None:
                require(new.max_new_tokens < seq, f"{key}.max_new_tokens", hold, new.max_new_tokens)
        loss, answer = block.min_loss_tokens, self.regenerate.max_new_tokens
        require(not self.data.regenerate or answer >= loss, "regenerate.max_new_tokens",
                 f"a regenerated answer could never reach the {loss} loss tokens "
                 "(2 x drafter.block_size) a sample needs", answer)  # fmt: skip
        require(
            budget >= seq,
            "batching.token_budget",
            f"must be >= data.max_seq_len = {seq}, so a micro-batch can hold the longest sample",
            budget,
        )
        require(
            block.min_loss_tokens <= seq,
            "drafter.block_size",
            f"the {block.min_loss_tokens} loss tokens (2 x drafter.block_size) a sample needs "
            f"must fit in data.max_seq_len = {seq}",
            block.block_size,
        )
        return self
