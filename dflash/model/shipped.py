"""The DFlash drafter's one definition, shipped in every export as a remote-code file.

Its config, layers and rope are the drafter's: the trainer's ``dflash.model.drafter`` builds
on them and adds only its training attention. The export copies this file as ``dflash.py``
and points ``auto_map`` at it, so ``AutoModel`` with ``trust_remote_code=True`` (z-lab's
documented path) loads the drafter without this project installed; it therefore imports
torch, transformers and the standard library only. The parameter names are z-lab's
reference's, so the same ``model.safetensors`` loads there, here and in the trainer.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config


def rope_theta(config) -> float:
    """transformers 5 keeps the base in ``rope_parameters``; 4.x in ``rope_theta``."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class DFlashDraftConfig(Qwen3Config):
    """A Qwen3 config (what vLLM, SGLang and z-lab read) that also names the DFlash keys:
    ``block_size`` and ``num_target_layers`` at the top, the rest under ``dflash_config``.

    Its ``initializer_range`` (Qwen3's) is the std of the drafter's initial projections.
    """

    @property
    def dflash(self) -> dict:
        return getattr(self, "dflash_config", None) or {}

    @property
    def target_layer_ids(self) -> list[int]:
        """The target layers whose outputs are fused into the context (0 is the first layer)."""
        return list(self.dflash["target_layer_ids"])

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash.get("mask_token_id")

    @property
    def mask_token(self) -> str | None:
        """Its string: SGLang looks the mask token up by name, assuming ``<|MASK|>`` without it."""
        return self.dflash.get("mask_token")

    @property
    def theta(self) -> float:
        return rope_theta(self)

    def attention_rule(self, layer: int) -> tuple[int | None, bool]:
        """Drafter layer ``layer``'s window (None: full attention) and causality, from
        ``layer_types``, ``sliding_window`` and ``dflash_config.causal`` as vLLM reads them."""
        types = getattr(self, "layer_types", None) or []
        sliding = layer < len(types) and types[layer] == "sliding_attention"
        return (self.sliding_window if sliding else None), bool(self.dflash.get("causal", False))


def visible(queries: Tensor, keys: Tensor, window: int | None, causal: bool) -> Tensor:
    """``[B, Q, K]``: where a query at position ``queries [B, Q]`` may see a key at ``keys
    [B, K]`` under a layer's window and causality (positions count inside a document)."""
    gap = queries[:, :, None] - keys[:, None, :]
    seen = torch.ones_like(gap, dtype=torch.bool)
    if causal:
        seen &= gap >= 0
    if window is not None:
        seen &= gap < window
    return seen


def rope(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin ``[B, L, head_dim]`` of absolute positions (the Qwen / Llama layout), in fp32."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=positions.device) / head_dim)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, H, L, d]``; cos/sin broadcast over heads."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    """Queries from the block; keys and values from the context features and the block, through
    the same ``k_proj``/``v_proj`` (*KV injection*). ``layer`` is its index in the drafter."""

    def __init__(self, config: DFlashDraftConfig, layer: int) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.layer = layer
        self.window, self.causal = config.attention_rule(layer)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.d = d
        self.q_proj = nn.Linear(hidden, self.heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, hidden, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)

    def split(self, x: Tensor, n: int) -> Tensor:
        return x.view(*x.shape[:2], n, self.d)

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q = self.split(self.q_proj(x), self.heads)
        return rotate(self.q_norm(q).to(q.dtype).transpose(1, 2), cos, sin)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        k = self.split(self.k_proj(x), self.kv_heads)
        k = rotate(self.k_norm(k).to(k.dtype).transpose(1, 2), cos, sin)
        return k, self.split(self.v_proj(x), self.kv_heads).transpose(1, 2)

    def forward(
        self, x: Tensor, context: Tensor, cos: Tensor, sin: Tensor, positions: Tensor
    ) -> Tensor:
        q_len = x.shape[1]
        q = self.queries(x, cos[:, -q_len:], sin[:, -q_len:])
        k, v = self.keys_values(torch.cat([context, x], dim=1), cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        mask = None
        if self.window is not None or self.causal:
            mask = visible(positions[:, -q_len:], positions, self.window, self.causal)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.d**-0.5)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """A pre-norm layer; ``attention`` is the class of its attention, whose inputs it passes on."""

    attention = Attention

    def __init__(self, config: DFlashDraftConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = self.attention(config, layer)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, *attention_inputs) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attention_inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftModules:
    """The drafter's own modules under the names ``model.safetensors`` holds, built in one order
    so that a seeded drafter draws the same initial weights in both models."""

    def build_draft(self, config: DFlashDraftConfig, layer: type[Layer] = Layer) -> None:
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)

    def fuse(self, target_hidden: Tensor) -> Tensor:
        """The context the layers attend to: the tapped target layers, projected and normed."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))


def pick(logits: Tensor, temperature: float) -> Tensor:
    """Greedy at temperature 0, else a sample, per position."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.flatten(0, -2), 1).view(probs.shape[:-1])


class DFlashDraftModel(DraftModules, PreTrainedModel):
    """Drafts a block ``[last, MASK x (block_size - 1)]`` in one pass from target features.

    The target's embedding and LM head are not part of it: ``spec_generate`` borrows them.
    """

    config_class = DFlashDraftConfig
    base_model_prefix = "dflash"
    _no_split_modules = ["Layer"]

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__(config)
        self.target_layer_ids = config.target_layer_ids
        self.mask_token_id = config.mask_token_id
        self.block_size = config.block_size
        self.build_draft(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(std=self.config.initializer_range)
        elif isinstance(module, nn.RMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, noise_embedding: Tensor, target_hidden: Tensor, position_ids: Tensor):
        """Hidden states ``[B, Q, H]`` of the block.

        ``target_hidden`` ``[B, C, n*H]`` are the fused target layers' outputs of the context;
        ``position_ids`` ``[B, C + Q]`` the absolute positions of the context, then the block.
        """
        context = self.fuse(target_hidden)
        cos, sin = rope(position_ids, self.config.head_dim, self.config.theta)
        x = noise_embedding.to(self.fc.weight.dtype)
        for layer in self.layers:
            x = layer(x, context, cos, sin, position_ids)
        return self.norm(x)

    def features(self, hidden_states: tuple[Tensor, ...]) -> Tensor:
        return select_features(hidden_states, self.target_layer_ids)

    def draft(self, target: nn.Module, block: Tensor, context: Tensor, temperature: float):
        """Fill the masked slots of ``block`` ``[1, bs]``, which starts at ``context``'s end."""
        start = context.shape[1]
        positions = torch.arange(start + block.shape[1], device=block.device)[None]
        hidden = self(target.get_input_embeddings()(block), context, positions)
        head = target.get_output_embeddings()
        drafted = pick(head(hidden[:, 1:].to(head.weight.dtype)), temperature)
        return torch.cat([block[:, :1], drafted], dim=1)

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: Tensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        mask_token_id: int | None = None,
    ) -> Tensor:
        """``[1, prompt + new]`` tokens; at temperature 0 exactly the target's greedy output.

        Each step drafts a block after the newest token, the target checks it in one pass with
        its KV cache, and the drafts it agrees with are kept, plus its own next token.
        """
        mask = self.mask_token_id if mask_token_id is None else mask_token_id
        stops = set(stop_token_ids or ())
        prompt, cache = input_ids.shape[1], DynamicCache()
        past = kv(target, cache)
        out = target(input_ids, use_cache=True, output_hidden_states=True, **past)
        context = self.features(out.hidden_states)
        ids = torch.cat([input_ids, pick(out.logits[:, -1:], temperature)], dim=1)
        stopped = int(ids[0, -1]) in stops
        while ids.shape[1] - prompt < max_new_tokens and not stopped:
            block = torch.full((1, self.block_size), mask, device=ids.device)
            block[0, 0] = ids[0, -1]
            block = self.draft(target, block, context, temperature)
            start = context.shape[1]
            positions = torch.arange(start, start + self.block_size, device=ids.device)[None]
            out = target(
                block, position_ids=positions, use_cache=True, output_hidden_states=True,
                **past,
            )  # fmt: skip
            posterior = pick(out.logits, temperature)
            agree = int((block[0, 1:] == posterior[0, :-1]).long().cumprod(0).sum())
            new = posterior[:, : agree + 1]
            ids = torch.cat([ids, new], dim=1)
            context = torch.cat([context, self.features(out.hidden_states)[:, : agree + 1]], 1)
            drop(cache, cache.get_seq_length() - context.shape[1])
            stopped = bool(stops & set(new[0].tolist()))
        return trim(ids, prompt, max_new_tokens, stops)


def concat_layers(outputs, layer_ids: list[int], *after: Tensor) -> Tensor:
    """The drafter's context features: the outputs of the target's decoder layers ``layer_ids``
    (``outputs[i]`` is layer i's), then ``after``, concatenated along the hidden dimension."""
    return torch.cat([outputs[i] for i in layer_ids] + list(after), dim=-1)


def select_features(hidden_states: tuple[Tensor, ...], layer_ids: list[int]) -> Tensor:
    """The tapped target layers (``hidden_states[0]`` is the embedding: layer i is i + 1)."""
    return concat_layers(hidden_states[1:], layer_ids)


def kv(target: nn.Module, cache: DynamicCache) -> dict[str, DynamicCache]:
    """The cache under the keyword the target takes: ``cache`` in transformers 5, where
    ``past_key_values`` warns and goes in 5.40; ``past_key_values`` before."""
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    return {name: cache}


def drop(cache: DynamicCache, count: int) -> None:
    """Forget the rejected drafts: a negative ``crop`` means the same in transformers 4 and 5."""
    if count > 0:
        cache.crop(-count)


def trim(ids: Tensor, prompt: int, max_new_tokens: int, stops: set[int]) -> Tensor:
    """Cut the new tokens at the budget and just after the first stop token."""
    new = ids[0, prompt : prompt + max_new_tokens].tolist()
    end = next((i + 1 for i, token in enumerate(new) if token in stops), len(new))
    return ids[:, : prompt + end]
