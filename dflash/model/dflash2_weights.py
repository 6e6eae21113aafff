"""DFlash 2's weights as the engines load them, and back.

The checkpoint layout every engine and z-lab's reference read (z-lab's safetensors header,
vLLM's and SGLang's ``load_weights``): per layer ``layers.{i}.attention_conv.base_kernel``
``[2, taps, H]`` and ``...kernel_projection.weight`` ``[2 * taps * H / group_size, H]``, the same
under ``mlp_conv``; ``candidate_selector.hidden_projection.weight`` ``[r, H]`` and the two
codebooks ``candidate_selector.{predecessor,successor}_codebook`` ``[V, r]``, bare, with no
``.weight``. None has a bias. DFlash's own weights keep their names.

:class:`~dflash.model.dflash2_drafter.DFlash2Drafter` holds its weights under exactly these
names, so :func:`export_weights` renames nothing and checks the shapes; :func:`import_weights`
reads the other spellings a DFlash 2 state dict comes in: vLLM's module names (``model.``
before each) and z-lab's modules (codebooks as ``nn.Embedding``, hence ``.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor

from dflash.model.dflash2 import SIDES, draft_value
from dflash.model.shipped import DFlashDraftConfig

CONVS = ("attention_conv", "mlp_conv")
SELECTOR = "candidate_selector"
SPELLINGS = (
    (re.compile(r"^model\."), ""),
    (re.compile(rf"^({SELECTOR}\.(?:predecessor|successor)_codebook)\.weight$"), r"\1"),
)
"""Other spellings of a DFlash 2 weight's name and their rewrite to the exported one: vLLM's
``model.`` prefix; z-lab's ``nn.Embedding`` codebooks."""


def dflash2_shapes(config: DFlashDraftConfig) -> dict[str, tuple[int, ...]]:
    """The weights DFlash 2 adds to a drafter of ``config``, by exported name, with shapes."""
    hidden, vocab = config.hidden_size, config.vocab_size
    taps = draft_value(config, "conv_kernel_size")
    groups = hidden // draft_value(config, "conv_group_size")
    rank = draft_value(config, "selector_rank")
    shapes = {}
    for i in range(config.num_hidden_layers):
        for conv in CONVS:
            shapes[f"layers.{i}.{conv}.base_kernel"] = (SIDES, taps, hidden)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (SIDES * taps * groups, hidden)
    shapes[f"{SELECTOR}.hidden_projection.weight"] = (rank, hidden)
    shapes[f"{SELECTOR}.predecessor_codebook"] = (vocab, rank)
    shapes[f"{SELECTOR}.successor_codebook"] = (vocab, rank)
    return shapes


def export_weights(state: Mapping[str, Tensor], config: DFlashDraftConfig) -> dict[str, Tensor]:
    """The drafter's ``state`` under the exported names (its own), every DFlash 2 weight there
    with the shape ``config`` gives it; a ValueError names any that is not."""
    out = dict(state)
    wrong = [
        f"{name} {tuple(out[name].shape) if name in out else 'missing'} (expected {shape})"
        for name, shape in dflash2_shapes(config).items()
        if name not in out or tuple(out[name].shape) != shape
    ]
    if wrong:
        raise ValueError("DFlash 2 weights not in the served layout: " + "; ".join(wrong))
    return out


def import_weights(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A DFlash 2 state dict in any spelling of :data:`SPELLINGS` under the drafter's names
    (the exported ones); two names that meet in one are refused."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        renamed = name
        for pattern, replacement in SPELLINGS:
            renamed = pattern.sub(replacement, renamed)
        if renamed in out:
            raise ValueError(f"{name} and another weight are both {renamed}")
        out[renamed] = tensor
    return out
