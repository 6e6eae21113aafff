"""The DFlash drafter as it trains: the shipped definition plus its training attention.

The drafter borrows the target's embedding and LM head (frozen, never saved with it) and is
conditioned on target features by *KV injection*: in every layer the keys and values are the
fused context features followed by the block tokens, through the same ``k_proj``/``v_proj``.
Queries come from the block only. Its config, layers, rope and weight names are those of
:mod:`dflash.model.shipped`, the file every export ships; here the attention applies the training
rule with its own kernels and keeps a context cache for generation.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash.model import hf_files, shipped
from dflash.model.drafter_attention import AnchorBlocks, BlockMask, attend, build_block_mask
from dflash.model.export import config_json, read_config
from dflash.model.layer_ids import target_layer_ids as spread_layer_ids
from dflash.model.shipped import (
    Attention,
    DFlashDraftConfig,
    DraftModules,
    Layer,
    rope,
    rope_theta,
    visible,
)

Rule = tuple[int | None, bool]
"""A layer's attention window (None: full) and causality (``DFlashDraftConfig.attention_rule``)."""
PAPER_RULE: Rule = (None, False)


def drafter_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA, as the drafter trains there; nothing on CPU, where it runs fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class ContextCache:
    """Per-layer keys/values of the context features seen so far during generation.

    Only context entries are ever stored; the block's own keys are recomputed every step, so
    rejected draft tokens never enter the cache and there is nothing to crop.
    """

    def __init__(self) -> None:
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if layer in self.kv:
            k = torch.cat([self.kv[layer][0], k], dim=2)
            v = torch.cat([self.kv[layer][1], v], dim=2)
        self.kv[layer] = (k, v)
        return k, v


class RuleMasks(dict):
    """The training masks of a drafter whose layers differ in window or causality, by
    :data:`Rule`: each layer attends under its own."""


def layer_rules(config: DFlashDraftConfig) -> set[Rule]:
    """The attention rules a drafter's layers use."""
    return {config.attention_rule(i) for i in range(config.num_hidden_layers)}


def rule_masks(
    mask: AnchorBlocks | BlockMask | Tensor,
    rules: set[Rule],
    anchors: Tensor,
    document_ids: Tensor,
    block_size: int,
    position_ids: Tensor,
    block_positions: Tensor,
) -> RuleMasks:
    """The training rule ``mask`` for full, bidirectional layers and, for every other rule, the
    rule as a dense mask narrowed by it (:func:`~dflash.model.shipped.visible`): the window
    counts in positions, which restart at each document, so packed rows stay exact."""
    masks = RuleMasks({PAPER_RULE: mask})
    T = position_ids.shape[1]
    dense = build_block_mask(anchors, document_ids, block_size, T)
    keys = torch.cat([position_ids, block_positions], dim=1)
    for rule in rules - {PAPER_RULE}:
        masks[rule] = dense & visible(block_positions, keys, *rule)
    return masks


class TrainingAttention(Attention):
    """The shipped attention under the training rule: context and block keys stay apart, so
    many blocks share one row's context, and generation can cache the context's."""

    def forward(
        self,
        x: Tensor,
        context: Tensor,
        rope_block: tuple[Tensor, Tensor],
        rope_context: tuple[Tensor, Tensor],
        mask: AnchorBlocks | BlockMask | Tensor | RuleMasks | None,
        cache: ContextCache | None,
        block_positions: Tensor,
    ) -> Tensor:
        q = self.queries(x, *rope_block)
        block = self.keys_values(x, *rope_block)
        context_kv = self.keys_values(context, *rope_context)
        if cache is not None:
            context_kv = cache.extend(self.layer, *context_kv)
        rule = (self.window, self.causal)
        if isinstance(mask, RuleMasks):
            mask = mask[rule]
        elif mask is None and rule != PAPER_RULE:  # generation: the context is positions 0..C-1
            keys = torch.arange(context_kv[0].shape[2], device=x.device).expand(x.shape[0], -1)
            keys = torch.cat([keys, block_positions], dim=1)
            mask = visible(block_positions, keys, *rule)
        out = attend(q, context_kv, block, mask, scale=self.d**-0.5)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class TrainingLayer(Layer):
    attention = TrainingAttention


@dataclass(frozen=True)
class Borrowed:
    """The target's embedding and LM head, held in a plain dataclass rather than as submodules:
    they are then not parameters or state of the drafter, so they are never trained, saved or
    wrapped by DDP, and ``drafter.to(...)`` leaves them where the target is."""

    embed_tokens: nn.Module
    lm_head: nn.Module


class DFlashDrafter(DraftModules, nn.Module):
    def __init__(
        self, config: DFlashDraftConfig, embed_tokens: nn.Module, lm_head: nn.Module
    ) -> None:
        super().__init__()
        self.config = config
        self.borrowed = Borrowed(embed_tokens, lm_head)
        self.build_draft(config, TrainingLayer)
        self.recompute = False
        """Recompute each layer's activations in backward instead of keeping them
        (``train.recompute``): less memory per token for one more forward of the layers."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    @classmethod
    def from_target(
        cls,
        target: nn.Module,
        *,
        block_size: int,
        num_hidden_layers: int,
        num_target_features: int,
        mask_token_id: int,
        mask_token: str | None = None,
        seed: int = 0,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        causal: bool = False,
    ) -> DFlashDrafter:
        """A freshly initialised drafter (seeded, global RNG untouched) sized like ``target``.

        ``num_target_features`` target layers are fused; ``config.num_target_layers`` records
        the target's depth, as the public DFlash ``config.json`` does.
        """
        tc = target.config
        heads = tc.num_attention_heads
        dflash = {
            "mask_token_id": mask_token_id,
            "target_layer_ids": spread_layer_ids(tc.num_hidden_layers, num_target_features),
        }
        if mask_token is not None:
            dflash["mask_token"] = mask_token
        if causal or sliding_window is not None:  # written out: some vLLM builds assume
            dflash["causal"] = causal  # sliding layers causal where the key is missing
        windows = {}
        if layer_types is not None:
            windows = dict(layer_types=list(layer_types), sliding_window=sliding_window,
                           use_sliding_window=sliding_window is not None)  # fmt: skip
        config = DFlashDraftConfig(
            block_size=block_size,
            num_hidden_layers=num_hidden_layers,
            num_target_layers=tc.num_hidden_layers,
            vocab_size=target.get_input_embeddings().weight.shape[0],
            hidden_size=tc.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            intermediate_size=tc.intermediate_size,
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=rope_theta(tc),
            dflash_config=dflash,
            **windows,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls._attach(config, target)

    @classmethod
    def _attach(cls, config: DFlashDraftConfig, target: nn.Module) -> DFlashDrafter:
        if config.block_size < 2:
            raise ValueError(f"block_size = {config.block_size}: a block needs at least 2 slots")
        vocab, hidden = target.get_input_embeddings().weight.shape
        if (config.vocab_size, config.hidden_size) != (vocab, hidden):
            raise ValueError(
                f"drafter expects vocab {config.vocab_size} x hidden {config.hidden_size}, "
                f"the target has {vocab} x {hidden}"
            )
        depth = getattr(target.config, "num_hidden_layers", config.num_target_layers)
        if config.num_target_layers != depth or max(config.target_layer_ids) >= depth:
            raise ValueError(
                f"drafter was trained on a {config.num_target_layers}-layer target (features of "
                f"layers {config.target_layer_ids}), this target has {depth} layers"
            )
        if not 0 <= config.mask_token_id < vocab:
            raise ValueError(f"mask_token_id = {config.mask_token_id} is outside the vocab {vocab}")
        drafter = cls(config, target.get_input_embeddings(), target.get_output_embeddings())
        return drafter.to(target.get_input_embeddings().weight.device)

    def save_pretrained(
        self,
        directory: str | Path,
        target_config: Any = None,
        dtype: torch.dtype | None = None,
        weights: dict[str, Tensor] | None = None,
    ) -> None:
        """``config.json``, ``model.safetensors`` (the drafter's own weights only) and the
        remote-code ``dflash.py`` its ``auto_map`` names.

        Weights are saved in ``dtype``, by default the one the target runs in here (bf16 on
        CUDA), which is what serving stacks load the draft in; ``target_config`` adds the keys
        they size the draft by. ``weights`` replaces ``state_dict()`` for a sharded drafter (its
        whole, gathered state).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        dtype = dtype or self.borrowed.embed_tokens.weight.dtype
        config = self.config_json(target_config, dtype)
        (directory / hf_files.CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        weights = self.state_dict() if weights is None else weights
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in weights.items()}
        save_file(state, directory / hf_files.WEIGHTS, metadata={"format": "pt"})
        shutil.copyfile(shipped.__file__, directory / hf_files.REMOTE_CODE)

    def config_json(self, target_config: Any = None, dtype: torch.dtype | None = None) -> dict:
        """Its export's ``config.json`` (:func:`dflash.model.export.config_json`)."""
        return config_json(self.config, target_config, dtype)

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: nn.Module) -> DFlashDrafter:
        directory = Path(directory)
        config = read_config(json.loads((directory / hf_files.CONFIG).read_text()))
        return cls.from_weights(config, load_file(directory / hf_files.WEIGHTS), target)

    @classmethod
    def from_weights(
        cls, config: DFlashDraftConfig, weights: dict[str, Tensor], target: nn.Module
    ) -> DFlashDrafter:
        """The drafter of ``config`` holding exactly ``weights`` (every one, no other), copied
        into fp32 parameters, as in training, whatever dtype they are stored in."""
        drafter = cls._attach(config, target)
        drafter.load_state_dict(weights, strict=True)
        return drafter

    def embed(self, token_ids: Tensor) -> Tensor:
        """Target embeddings of ``token_ids``; detached so no gradient reaches the target."""
        weight = self.borrowed.embed_tokens.weight.detach()
        return F.embedding(token_ids, weight).to(self.fc.weight.dtype)

    def head(self) -> tuple[Tensor, Tensor | None]:
        """The target LM head's weight and bias, detached so no gradient reaches the target."""
        head = self.borrowed.lm_head
        bias = None if getattr(head, "bias", None) is None else head.bias.detach()
        return head.weight.detach(), bias

    def logits(self, hidden: Tensor) -> Tensor:
        """Target LM head applied to drafter hidden states."""
        weight, bias = self.head()
        return F.linear(hidden.to(weight.dtype), weight, bias)

    def forward(
        self,
        block_ids: Tensor,
        block_positions: Tensor,
        features: Tensor,
        context_positions: Tensor,
        mask: AnchorBlocks | BlockMask | Tensor | None = None,
        cache: ContextCache | None = None,
    ) -> Tensor:
        """Hidden states ``[B, Q, H]`` of the block slots.

        ``block_ids``/``block_positions`` are ``[B, Q]``; ``features`` ``[B, C, n*H]`` are target
        features at ``context_positions`` ``[B, C]`` (with a cache: only the new ones). ``mask``
        is the training rule from
        :func:`~dflash.model.drafter_attention.build_attention_mask`, a dense ``[B, Q, C + Q]``
        boolean mask, or None: every slot sees everything.
        """
        c = self.config
        x = self.embed(block_ids)
        context = self.fuse(features)
        rope_block = rope(block_positions, c.head_dim, c.theta)
        rope_context = rope(context_positions, c.head_dim, c.theta)
        for layer in self.layers:
            args = (x, context, rope_block, rope_context, mask, cache, block_positions)
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(layer, *args, use_reentrant=False)
            else:
                x = layer(*args)
        return self.norm(x)
