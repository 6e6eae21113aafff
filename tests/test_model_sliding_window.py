"""Sliding-window targets: packed and one-document rows give each document's served features.

Each document run alone through the unpacked Hugging Face target (its own kernel and masks) is
the reference, for windows smaller than, equal to and larger than the documents, on a Qwen3
that alternates sliding and full layers and on a Mistral whose every layer slides.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash.features.target_forward import target_features
from dflash.model import document_layout
from dflash.model.shipped import select_features

LAYERS = [1, 2, 3]
T = 32
DOCS = [[10, 10, 7], [10, 13], [10]]
"""Document lengths per row; every row is padded to ``T``. The last row holds one document."""


SHAPE = dict(
    vocab_size=300,
    hidden_size=32,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
)
"""Both tiny targets: five layers, GQA, alike but for how they declare their windows."""


def qwen3_alternating(window: int) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    layer_types = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    config = Qwen3Config(
        **SHAPE, use_sliding_window=True, sliding_window=window, layer_types=layer_types
    )
    return Qwen3ForCausalLM(config).eval()


def mistral(window: int) -> MistralForCausalLM:
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=window)).eval()


def rows(lengths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``T`` tokens holding documents of ``lengths``, positions restarting per document."""
    ids = torch.randint(0, 300, (len(lengths), T), generator=torch.Generator().manual_seed(2))
    pos = torch.zeros(len(lengths), T, dtype=torch.long)
    docs = torch.full((len(lengths), T), -1)
    for r, row in enumerate(lengths):
        start = 0
        for d, n in enumerate(row):
            pos[r, start : start + n] = torch.arange(n)
            docs[r, start : start + n] = d
            start += n
    return ids, pos, docs


def alone(target, ids: torch.Tensor, lengths: list[list[int]]) -> torch.Tensor:
    """Every document through the unpacked target by itself, laid back where the row holds it."""
    want = torch.zeros(ids.shape[0], T, 32 * len(LAYERS))
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            with torch.no_grad():
                out = target(
                    input_ids=ids[r : r + 1, start : start + n],
                    output_hidden_states=True,
                    use_cache=False,
                )
            want[r, start : start + n] = select_features(out.hidden_states, LAYERS)[0]
            start += n
    return want


@pytest.mark.parametrize("build", [qwen3_alternating, mistral], ids=["qwen3", "mistral"])
@pytest.mark.parametrize("window", [4, 10, 40], ids=["smaller", "equal", "larger"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-document"])
@pytest.mark.parametrize("size", [64, 4], ids=["size64", "size4-classes"])
def test_features_equal_each_document_alone(build, window, packed, size, monkeypatch):
    monkeypatch.setattr(document_layout, "QUERY_TILE", size)  # 4: tiles of several widths
    monkeypatch.setattr(document_layout, "LENGTH_STEP", size)  # 4: several length classes
    target = build(window)
    lengths = DOCS if packed else [[n] for n in (10, 13, 7)]
    ids, pos, docs = rows(lengths)
    got = target_features(target, ids, pos, docs, LAYERS)
    torch.testing.assert_close(got, alone(target, ids, lengths), rtol=1e-5, atol=1e-5)


def test_the_window_changes_the_features():
    """The check has teeth: a window shorter than the documents gives other features."""
    ids, pos, docs = rows(DOCS)
    narrow = target_features(qwen3_alternating(4), ids, pos, docs, LAYERS)
    wide = target_features(qwen3_alternating(40), ids, pos, docs, LAYERS)
    assert (narrow - wide).abs().max() > 1e-3


@pytest.mark.parametrize("window, tiled", [(4, 2), (12, 2), (13, 0), (40, 0)])
def test_tiles_only_where_a_document_outgrows_the_window(window, tiled, monkeypatch):
    """The two sliding layers the Qwen3 runs (of layers 0-3) take query tiles only when the
    longest document (13 tokens) is longer than their window; every other layer, one call of
    the causal kernel (the documents make one length class, the tiles one width class)."""
    kinds = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        kinds.append("causal" if kwargs.get("is_causal") else "tiles")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    target_features(qwen3_alternating(window), *rows(DOCS), LAYERS)
    assert kinds.count("tiles") == tiled and kinds.count("causal") == len(LAYERS) + 1 - tiled
