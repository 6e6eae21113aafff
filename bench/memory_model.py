"""What one DFlash training step holds in memory, component by component, from shapes alone.

The same formulas serve two ends: ``bench/step_memory.py`` checks them against the measured
peak of a real step on CPU (fp32), and ``bench/gpu_memory.py`` applies them to a real target in
bf16 to size ``batching.token_budget`` for a GPU. Only the big terms are modelled: weights,
optimizer state, features, activations kept for backward, the FlexAttention block mask on a
GPU, and the largest transient buffer (one loss chunk, one target layer, or one attention chunk
of the CPU kernel or the block mask being built on a GPU, whichever is biggest).

A DFlash 2 drafter (``dflash2``: its :class:`DFlash2Sizes`) adds its convolutions' and its
selector's weights, gradients and AdamW state, the selector's two dense ``[V, r]`` codebook
gradients, the activations both keep for backward, and as transients the selector's backward
and, on CPU, AdamW's update of a codebook.

Under FSDP (``shards`` > 1) a rank keeps ``1/shards`` of the weights, gradients and AdamW
state, and gathers whole units for a while: the borrowed embedding and head for the drafter's
forward and backward, and one drafter layer with its unsharded gradient at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.model.dflash2 import SIDES
from dflash.model.dflash2_drafter import DFlash2Sizes
from dflash.model.drafter_attention import CONTEXT_SCORES_PER_CHUNK, FLEX_TILE
from dflash.model.objective import chunk_rows

MIB = 2**20
FP32 = 4
MASK_TILE_BYTES = 16
"""The block mask kept per (query tile, key tile) pair: four int32 tile lists (partial and full
key tiles of each query tile, and their transposes), kept for the backward."""
MASK_BUILD_TILE_BYTES = 30
"""Peak bytes per tile pair while ``flex_block_mask`` builds it: the kept lists, the boolean
tile matrices, their int32 copies and the int64 orders sorting them (measured on CPU)."""


CONV_KERNEL_SIZE, CONV_GROUP_SIZE = 2, 16
"""DFlash 2's convolution as z-lab publishes it (and the default's), which the benches size."""


def dflash2_sizes(args) -> DFlash2Sizes | None:
    """The DFlash 2 sizes a bench's ``--family``, ``--selector-rank`` and ``--top-k`` name (None
    for a DFlash drafter)."""
    if args.family != "dflash2":
        return None
    return DFlash2Sizes(CONV_KERNEL_SIZE, CONV_GROUP_SIZE, args.selector_rank, args.top_k)


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


def mask_tiles(d: Dims, b: Batch) -> int:
    """FlexAttention tile pairs of the block mask. The objective lays the micro-batch's rows
    end to end, so its queries and keys are those of all rows: the count grows with the square
    of the micro-batch."""
    queries = b.rows * b.anchors * d.block_size
    return -(-queries // FLEX_TILE) * -(-(b.tokens + queries) // FLEX_TILE)


def loss_chunk_bytes(d: Dims, b: Batch, act_bytes: int, device: str) -> float:
    """One chunk of the loss: its fp32 logits, the matmul's output in the compute dtype and the
    gradient's copy in it (in fp32 the copies are the logits themselves: counted anyway)."""
    labels = b.rows * b.anchors * (d.block_size - 1)
    rows = min(labels, chunk_rows(d.vocab, torch.device(device)))
    return rows * d.vocab * (FP32 + 2 * act_bytes)


def transients(
    d: Dims, b: Batch, act_bytes: int, device: str = "cpu", dflash2: DFlash2Sizes | None = None
) -> dict[str, float]:
    """Buffers that live for a moment of the step, one at a time: the largest one counts."""
    named = {
        "target layer": b.tokens * (3 * d.intermediate + 4 * d.hidden) * act_bytes,
        "loss chunk": loss_chunk_bytes(d, b, act_bytes, device),
    }
    if device == "cuda":
        named["block mask, building"] = mask_tiles(d, b) * MASK_BUILD_TILE_BYTES
    else:
        named["attention chunk"] = 3 * d.heads * CONTEXT_SCORES_PER_CHUNK * FP32
    if dflash2 is not None:
        named["selector backward"] = selector_backward_bytes(d, b, act_bytes, dflash2)
        if device == "cpu":
            named["AdamW step"] = adamw_step_bytes(d, dflash2)
    return named


def adamw_step_bytes(d: Dims, s: DFlash2Sizes) -> float:
    """AdamW on CPU updates one parameter at a time through two temporaries its size (the
    second moment's root and its quotient), mapped afresh while the heap keeps the memory the
    freed activations held: with DFlash 2 the largest parameter is a ``[V, r]`` codebook, and
    this step is the CPU peak. On a GPU the caching allocator serves it from those blocks."""
    largest = max(d.vocab * s.selector_rank, d.features * d.hidden**2, d.hidden * d.intermediate)
    return 2 * largest * FP32


def labels_of(d: Dims, b: Batch) -> int:
    return b.rows * b.anchors * (d.block_size - 1)


def conv_params(d: Dims, s: DFlash2Sizes) -> int:
    """The two convs of every drafter layer: ``base_kernel [2, taps, H]`` and
    ``kernel_projection`` ``H -> 2 x taps x H / group_size``."""
    groups = d.hidden // s.conv_group_size
    one = SIDES * s.conv_kernel_size * d.hidden * (1 + groups)
    return d.drafter_layers * 2 * one


def selector_params(d: Dims, s: DFlash2Sizes) -> int:
    """The two codebooks ``[V, r]`` and ``hidden_projection [r, H]``."""
    return s.selector_rank * (2 * d.vocab + d.hidden)


def dflash2_state_bytes(d: Dims, s: DFlash2Sizes, shards: int = 1) -> dict[str, float]:
    """A rank's DFlash 2 weights and AdamW moments (fp32) and their gradients, each codebook's
    dense ``[V, r]`` however few rows a step gathers."""
    return {
        "convs: weights, grads, AdamW": conv_params(d, s) * 4 * FP32 / shards,
        "selector: weights, AdamW": selector_params(d, s) * 3 * FP32 / shards,
        "selector: gradients (dense codebooks)": selector_params(d, s) * FP32 / shards,
    }


def conv_activation_bytes(
    d: Dims, s: DFlash2Sizes, b: Batch, act_bytes: int, checkpoint_layers: bool
) -> float:
    """Per query slot, each of a layer's two convs keeps what ``block_convolve`` recomputes its
    taps from in backward: the sublayer's output and both sides' dynamic kernels. The sublayer
    keeps the convolved input, and under autocast the kernel projection a compute-dtype copy of
    the conv's input."""
    queries = b.rows * b.anchors * d.block_size
    kernels = SIDES * s.conv_kernel_size * (d.hidden // s.conv_group_size)
    copy = d.hidden * act_bytes if act_bytes != FP32 else 0
    per_conv = (2 * d.hidden + kernels) * act_bytes + copy
    layers = 1 if checkpoint_layers else d.drafter_layers
    return layers * 2 * queries * per_conv


def selector_activation_bytes(d: Dims, s: DFlash2Sizes, b: Batch, act_bytes: int) -> float:
    """Per counted label: the picked hidden state, its projection, the predecessor's codebook
    row and its product with the projection (fp32, the codebooks' dtype; the einsum keeps a
    compute-dtype copy of the product), the K candidates' codebook rows, the int64 ids of the
    predecessor and of the candidates (for the pair's lookup and the head rows' recompute),
    and the K-way cross-entropy's fp32 log-probabilities."""
    r, k = s.selector_rank, s.selector_top_k
    copy = r * act_bytes if act_bytes != FP32 else 0
    per_label = (d.hidden + r + k * r) * act_bytes + 2 * r * FP32 + copy
    return labels_of(d, b) * (per_label + (2 * k + 1) * 8 + k * FP32)


def selector_backward_bytes(d: Dims, b: Batch, act_bytes: int, s: DFlash2Sizes) -> float:
    """The gradient of the K candidates' codebook rows, the first thing backward makes (the
    selector's term is the last of the forward), while every activation is still kept; in fp32
    for the codebooks, beside its compute-dtype original under autocast."""
    copy = act_bytes if act_bytes != FP32 else 0
    return labels_of(d, b) * s.selector_top_k * s.selector_rank * (FP32 + copy)


def components(
    d: Dims,
    b: Batch,
    act_bytes: int,
    weight_bytes: int,
    checkpoint_layers: bool = False,
    shards: int = 1,
    device: str = "cpu",
    dflash2: DFlash2Sizes | None = None,
) -> dict[str, float]:
    """Bytes per component of one step. ``act_bytes``: 4 in fp32, 2 under bf16 autocast.

    ``checkpoint_layers``: drafter layers recomputed in backward, so each keeps only its input.
    ``shards``: the ranks FSDP shards over (1: DDP, every rank whole). ``device``: ``cuda``
    attends through a FlexAttention block mask and takes the GPU's loss chunks; ``cpu`` runs
    the two-part kernel's attention chunks. ``dflash2``: a DFlash 2 drafter's sizes (None: a
    DFlash drafter), adding :func:`dflash2_components`.
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
    mask = {"block mask": mask_tiles(d, b) * MASK_TILE_BYTES} if device == "cuda" else {}
    gathered = {"gathered units (FSDP)": gathered_bytes(d, act_bytes, weight_bytes)}
    return {
        **model_state_bytes(d, weight_bytes, shards),
        "target features": b.tokens * (d.features + 2) * H * act_bytes,
        "drafter activations": kept_layers * act_bytes,
        "loss gradient": labels * H * FP32,
        **mask,
        **dflash2_components(d, b, act_bytes, checkpoint_layers, shards, dflash2),
        "largest transient": max(transients(d, b, act_bytes, device, dflash2).values()),
        **(gathered if shards > 1 else {}),
    }


def dflash2_components(
    d: Dims,
    b: Batch,
    act_bytes: int,
    checkpoint_layers: bool,
    shards: int,
    s: DFlash2Sizes | None,
) -> dict[str, float]:
    """What a DFlash 2 drafter adds to a DFlash one's step (nothing for ``s`` None)."""
    if s is None:
        return {}
    # FSDP keeps the selector in the drafter's root unit: gathered whole, in fp32, for the step,
    # and its gradient whole until the reduce-scatter.
    gathered = {"selector, gathered (FSDP)": selector_params(d, s) * 2 * FP32}
    return {
        **dflash2_state_bytes(d, s, shards),
        "conv activations": conv_activation_bytes(d, s, b, act_bytes, checkpoint_layers),
        "selector activations": selector_activation_bytes(d, s, b, act_bytes),
        **(gathered if shards > 1 else {}),
    }


def step_bytes(*args, **kwargs) -> float:
    return sum(components(*args, **kwargs).values())


def role_components(
    d: Dims,
    b: Batch,
    act_bytes: int,
    weight_bytes: int,
    role: str,
    shards: int = 1,
    device: str = "cpu",
    dflash2: DFlash2Sizes | None = None,
) -> dict[str, float]:
    """Bytes per component on one rank of a decoupled run (``train.topology: decoupled``).

    A target rank holds the target (``shards``: target ranks it is sharded over under FSDP),
    the features it computes and one target layer's transient, and when sharded the unit FSDP
    holds gathered: the embedding, or a decoder layer with the next one's all-gather in flight;
    a drafter rank holds the borrowed embedding and head whole, the drafter's state
    (``shards``: drafter ranks under FSDP), the received features and the drafter's step, whose
    transients hold no target layer. ``dflash2`` adds a DFlash 2 drafter's parts to the
    drafter rank.
    """
    named = transients(d, b, act_bytes, device, dflash2)
    if role == "target":
        gathered = max(d.vocab * d.hidden, 2 * layer_params(d)) * weight_bytes
        return {
            "target weights": target_params(d) * weight_bytes / shards,
            "target features": b.tokens * (d.features + 2) * d.hidden * act_bytes,
            "target layer": named["target layer"],
            **({"gathered units (FSDP)": gathered} if shards > 1 else {}),
        }
    drafter = components(
        d, b, act_bytes, weight_bytes, shards=shards, device=device, dflash2=dflash2
    )
    del drafter["target weights"]
    drafter["largest transient"] = max(v for k, v in named.items() if k != "target layer")
    if shards > 1:  # the borrowed parts stay whole: FSDP gathers only drafter layers
        drafter["gathered units (FSDP)"] -= embed_head_params(d) * weight_bytes
    return {"borrowed embedding and head": embed_head_params(d) * weight_bytes, **drafter}


def target_flops_per_token(d: Dims, row_len: int) -> float:
    """Forward FLOPs per token of the target up to its deepest fused layer (no LM head);
    causal attention sees half the row on average."""
    depth = d.target_layers - 2  # the features stop at the third-to-last layer
    attention = 4 * (row_len / 2) * d.heads * d.head_dim
    return depth * (2 * layer_params(d) + attention)


def drafter_flops_per_token(d: Dims, b: Batch) -> float:
    """Forward and backward FLOPs per token of the drafter's step: each block slot runs the
    fusion and the layers (x3 with backward) and the frozen LM head (x2: no weight gradient);
    each context token runs its key/value projections; slots attend to the context."""
    slots = b.anchors * d.block_size / b.row_len
    kv = d.kv_heads * d.head_dim
    per_slot = 2 * drafter_params(d) - 2 * d.features * d.hidden**2  # layers
    fuse = 2 * d.features * d.hidden**2  # every context token is fused once
    context = d.drafter_layers * 2 * 2 * d.hidden * kv
    attention = d.drafter_layers * 4 * (b.row_len / 2 + d.block_size) * d.heads * d.head_dim
    head = 2 * d.hidden * d.vocab
    return 3 * (slots * (per_slot + attention) + fuse + context) + 2 * slots * head
