"""``bench/step_memory.py`` measures either drafter family's training step: at tiny shapes
here, where a DFlash 2 step's loss adds its selector's term to the same head loss."""

from __future__ import annotations

import argparse
import sys
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
