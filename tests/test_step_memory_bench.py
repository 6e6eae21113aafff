"""``bench/step_memory.py`` measures either drafter family's training step: at tiny shapes
here, where a DFlash 2 step's loss adds its selector's term to the same head loss."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"

TINY = {"vocab": 512, "hidden": 64, "layers": 6, "seq_len": 128, "rows": 1, "anchors": 8,
        "block_size": 4, "drafter_layers": 1, "target_features": 2, "role": "both",
        "selector_rank": 8, "top_k": 4}  # fmt: skip


def test_a_dflash2_step_is_measured_with_its_selectors_term(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", ["step_memory.py"])
    import step_memory

    steps = {f: step_memory.one_step(argparse.Namespace(**TINY, family=f)) for f in
             ("dflash", "dflash2")}  # fmt: skip
    assert steps["dflash2"]["family"] == "dflash2" and steps["dflash2"]["peak_rss_mib"] > 0
    assert steps["dflash2"]["labels"] == steps["dflash"]["labels"]
    assert steps["dflash2"]["loss"] > steps["dflash"]["loss"]  # + alpha x a K-way CE


def test_the_memory_model_adds_dflash2s_terms_growing_with_their_sizes(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from memory_model import Batch, Dims, components, role_components

    from dflash.model.dflash2_drafter import DFlash2Sizes

    d = Dims(vocab=1000, hidden=64, target_layers=4, intermediate=192, heads=1, kv_heads=1,
             head_dim=64, drafter_layers=2, features=2, block_size=4)  # fmt: skip
    b = Batch(rows=1, row_len=256, anchors=8)
    sizes = DFlash2Sizes(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    dflash = components(d, b, 4, 4)
    dflash2 = components(d, b, 4, 4, dflash2=sizes)
    added = set(dflash2) - set(dflash)
    assert {"selector: gradients (dense codebooks)", "conv activations"} <= added
    assert all(dflash2[k] == v for k, v in dflash.items() if k != "largest transient")
    grads = "selector: gradients (dense codebooks)"
    wider = components(replace(d, vocab=4000), b, 4, 4, dflash2=replace(sizes, selector_rank=16))
    codebooks = 2 * d.vocab * sizes.selector_rank * 4
    assert dflash2[grads] - 8 * 64 * 4 == codebooks  # r x H of the projection beside them
    assert wider[grads] - 16 * 64 * 4 == 8 * codebooks
    drafter_rank = role_components(d, b, 4, 4, "drafter", dflash2=sizes)
    assert drafter_rank[grads] == dflash2[grads]
