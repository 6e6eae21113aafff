"""DFlash 2 weights under the names and shapes the engines load, and back.

The layout is z-lab's checkpoint's (its safetensors header), which vLLM's and SGLang's
``load_weights`` read: ``layers.{i}.{attention,mlp}_conv.base_kernel`` ``[2, taps, H]`` and
``.kernel_projection.weight`` ``[2 * taps * H / group, H]``,
``candidate_selector.hidden_projection.weight`` ``[r, H]`` and bare
``candidate_selector.{predecessor,successor}_codebook`` ``[V, r]``.
"""

import pytest
import torch
from conftest import tiny_drafter
from test_dflash2_packed import ANCHORS, SIZES, make_dflash2, packed_forward, packed_inputs

from dflash.model.dflash2_drafter import DFlash2Drafter, DFlash2Sizes, dflash2_config, is_dflash2
from dflash.model.dflash2_weights import dflash2_shapes, export_weights, import_weights
from dflash.model.shipped import DFlashDraftConfig

CONTRACT = {
    "layers.{i}.attention_conv.base_kernel": lambda H, T, G, r, V: (2, T, H),
    "layers.{i}.attention_conv.kernel_projection.weight": lambda H, T, G, r, V: (2 * T * G, H),
    "layers.{i}.mlp_conv.base_kernel": lambda H, T, G, r, V: (2, T, H),
    "layers.{i}.mlp_conv.kernel_projection.weight": lambda H, T, G, r, V: (2 * T * G, H),
}
SELECTOR = {
    "candidate_selector.hidden_projection.weight": lambda H, T, G, r, V: (r, H),
    "candidate_selector.predecessor_codebook": lambda H, T, G, r, V: (V, r),
    "candidate_selector.successor_codebook": lambda H, T, G, r, V: (V, r),
}


def _contract(layers: int, H: int, T: int, gs: int, r: int, V: int) -> dict:
    sizes = (H, T, H // gs, r, V)
    names = {k.format(i=i): f(*sizes) for i in range(layers) for k, f in CONTRACT.items()}
    return names | {k: f(*sizes) for k, f in SELECTOR.items()}


def test_published_checkpoints_shapes():
    """The sizes of z-lab's checkpoint header (H 6656, 5 layers, taps 2, group 16, rank 256,
    V 202048) give its shapes: ``[2, 2, 6656]``, ``[1664, 6656]``, ``[256, 6656]``,
    ``[202048, 256]``."""
    config = DFlashDraftConfig(hidden_size=6656, num_hidden_layers=5, vocab_size=202048)
    config = dflash2_config(config, DFlash2Sizes(2, 16, 256, 16))
    shapes = dflash2_shapes(config)
    assert shapes == _contract(5, 6656, 2, 16, 256, 202048)
    assert shapes["layers.4.mlp_conv.kernel_projection.weight"] == (1664, 6656)
    assert is_dflash2(config)


def test_exported_weights_are_the_contract_and_dflash_names(target):
    drafter = make_dflash2(target)
    c = drafter.config
    exported = export_weights(drafter.state_dict(), c)
    added = _contract(2, c.hidden_size, SIZES.conv_kernel_size, SIZES.conv_group_size,
                      SIZES.selector_rank, c.vocab_size)  # fmt: skip
    dflash = set(tiny_drafter(target).state_dict())
    assert set(exported) == dflash | set(added)
    assert {name: tuple(exported[name].shape) for name in added} == added
    assert not any(
        name.endswith("bias") or "embed" in name or "lm_head" in name for name in exported
    )


def test_export_and_import_round_trip(target):
    state = make_dflash2(target).state_dict()
    back = import_weights(export_weights(state, make_dflash2(target).config))
    assert list(back) == list(state)
    assert all(back[k] is state[k] for k in state)


@pytest.mark.parametrize("spelling", ["z-lab modules", "vLLM modules"])
def test_other_spellings_load_as_the_drafter(target, spelling):
    """z-lab's ``nn.Embedding`` codebooks (``.weight``) and vLLM's ``model.`` names load
    strictly into a drafter that computes what the original does."""
    drafter = make_dflash2(target, transform=False)
    state = drafter.state_dict()
    if spelling == "z-lab modules":
        renamed = {k + ".weight" if k.endswith("_codebook") else k: v for k, v in state.items()}
    else:
        renamed = {"model." + k: v for k, v in state.items()}
    assert set(renamed) != set(state)
    loaded = DFlash2Drafter.from_weights(drafter.config, import_weights(renamed), target)
    ids, features, docs, pos = packed_inputs(drafter)
    with torch.no_grad():
        want, _ = packed_forward(drafter, ids, features, docs, pos, ANCHORS, "two-part")
        got, _ = packed_forward(loaded, ids, features, docs, pos, ANCHORS, "two-part")
    assert torch.equal(got, want)


def test_weights_out_of_the_layout_are_refused(target):
    drafter = make_dflash2(target)
    state = drafter.state_dict()
    name = "layers.1.mlp_conv.kernel_projection.weight"
    with pytest.raises(ValueError, match=f"{name} \\(16, 31\\)"):
        export_weights({**state, name: state[name][:, :-1]}, drafter.config)
    with pytest.raises(ValueError, match="candidate_selector.successor_codebook missing"):
        export_weights(
            {k: v for k, v in state.items() if not k.endswith("successor_codebook")},
            drafter.config,
        )
    codebook = "candidate_selector.predecessor_codebook"
    with pytest.raises(ValueError, match="both candidate_selector.predecessor_codebook"):
        import_weights({codebook: state[codebook], codebook + ".weight": state[codebook]})
