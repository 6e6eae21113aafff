"""What one DFlash training step holds in memory, component by component, from shapes alone.

The same formulas serve two ends: ``bench/step_memory.py`` checks them against the measured
peak of a real step on CPU (fp32), and ``bench/gpu_memory.py`` applies them to a real target in
bf16 to size ``batching.token_budget`` for a GPU. Only the big terms are modelled: weights,
optimizer state, features, activations kept for backward, and the largest transient buffer
(one loss chunk, one attention chunk or one target layer, whichever is biggest).

Under FSDP (``shards`` > 1) a rank keeps ``1/shards`` of the weights, gradients and AdamW
state, and gathers whole units for a while: the borrowed embedding and head for the drafter's
forward and backward, and one drafter layer with its unsharded gradient at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.model.attention import CONTEXT_SCORES_PER_CHUNK
from dflash.model.objective import LOGITS_PER_CHUNK

MIB = 2**20
FP32 = 4


@dataclass(frozen=True)
class Dims:
    """Target sizes (the drafter copies them) and drafter depth, as in a Hugging Face config."""

    vocab: int
    hidden: int
    target_layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    drafter_layers: int
    features: int
    block_size: int
    tied_embeddings: bool = False


@dataclass(frozen=True)
class Batch:
    """One micro-batch: ``rows`` rows of ``row_len`` tokens, ``anchors`` blocks per row."""

    rows: int
    row_len: int
    anchors: int

    @property
    def tokens(self) -> int:
        return self.rows * self.row_len


def layer_params(d: Dims) -> int:
    """One Qwen3 decoder layer: attention projections, SwiGLU MLP, norms."""
    attention = 2 * d.hidden * d.heads * d.head_dim + 2 * d.hidden * d.kv_heads * d.head_dim
    return attention + 3 * d.hidden * d.intermediate + 2 * d.hidden + 2 * d.head_dim


def target_params(d: Dims) -> int:
    return embed_head_params(d) + d.target_layers * layer_params(d) + d.hidden


def drafter_params(d: Dims) -> int:
    """Fusion ``Linear(n*H -> H)``, its norm, the layers and the final norm (no embeddings)."""
    return d.features * d.hidden**2 + d.drafter_layers * layer_params(d) + 2 * d.hidden


def embed_head_params(d: Dims) -> int:
    return d.vocab * d.hidden * (1 if d.tied_embeddings else 2)


def model_state_bytes(d: Dims, weight_bytes: int, shards: int = 1) -> dict[str, float]:
    """A rank's target weights and drafter weights, gradients and AdamW state (fp32)."""
    return {
        "target weights": target_params(d) * weight_bytes / shards,
        "drafter weights, grads, AdamW": drafter_params(d) * 4 * FP32 / shards,
    }


def gathered_bytes(d: Dims, act_bytes: int, weight_bytes: int) -> float:
    """What FSDP holds whole during the drafter's step: borrowed embedding and head, and one
    drafter layer (in the compute dtype) with its fp32 gradient before the reduce-scatter."""
    return embed_head_params(d) * weight_bytes + layer_params(d) * (act_bytes + FP32)


def components(
    d: Dims,
    b: Batch,
    act_bytes: int,
    weight_bytes: int,
    checkpoint_layers: bool = False,
    shards: int = 1,
) -> dict[str, float]:
    """Bytes per component of one step. ``act_bytes``: 4 in fp32, 2 under bf16 autocast.

    ``checkpoint_layers``: drafter layers recomputed in backward, so each keeps only its input.
    ``shards``: the ranks FSDP shards over (1: DDP, every rank whole).
    """
    H, inter, kv = d.hidden, d.intermediate, d.kv_heads * d.head_dim
    queries = b.rows * b.anchors * d.block_size
    labels = b.rows * b.anchors * (d.block_size - 1)
    # Kept for backward, per query slot and layer: residual, norms, q/k/v (and their normed,
    # rotated forms), the merged attention output, o_proj, SwiGLU gate/up/act/product.
    per_query = 10 * H + 4 * kv + 4 * inter
    per_context = 4 * kv  # the context's k/v through the same projections, normed and rotated
    layer = queries * per_query + b.tokens * per_context
    kept_layers = queries * H + layer if checkpoint_layers else d.drafter_layers * layer
    transients = {
        "target layer": b.tokens * (3 * inter + 4 * H) * act_bytes,
        "attention chunk": 3 * d.heads * CONTEXT_SCORES_PER_CHUNK * FP32,
        "loss chunk": 3 * LOGITS_PER_CHUNK * FP32,
    }
    gathered = {"gathered units (FSDP)": gathered_bytes(d, act_bytes, weight_bytes)}
    return {
        **model_state_bytes(d, weight_bytes, shards),
        "target features": b.tokens * (d.features + 2) * H * act_bytes,
        "drafter activations": kept_layers * act_bytes,
        "loss gradient": labels * H * FP32,
        "largest transient": max(transients.values()),
        **(gathered if shards > 1 else {}),
    }


def step_bytes(*args, **kwargs) -> float:
    return sum(components(*args, **kwargs).values())
