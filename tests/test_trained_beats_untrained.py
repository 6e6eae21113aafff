"""Training adds acceptance: on the tiny workspace, the trained drafter's τ beats the untrained
one's by a margin, in real speculative decoding against the target.

The drafter learns the target's own answers (``data.regenerate``), as DFlash prescribes: the
tiny target's greedy answers are what evaluate verifies against, so a drafter that learned
them is accepted, and one at initialisation accepts next to nothing.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import run_stages

pytestmark = pytest.mark.slow

MARGIN = 1.0
"""τ the trained drafter must gain over the untrained one: 3.67 against 1.00 where measured."""


def test_the_trained_drafter_beats_the_untrained_one(tiny_workspace_template, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(tiny_workspace_template, ws)
    sets = [
        "data.regenerate=true",
        "regenerate.max_new_tokens=12",
        "train.world_size=1",
        "train.epochs=2",
        "evaluate.num_prompts=4",
    ]
    stages = ["regenerate", "tokenize", "stats", "plan", "train", "evaluate"]
    run_stages(ws, stages, sets)
    metrics = json.loads((ws / "metrics/eval.json").read_text())
    trained = metrics["acceptance_length"]
    untrained = metrics["baselines"]["untrained"]["acceptance_length"]
    note = f"trained τ {trained:.3f}, untrained {untrained:.3f}"
    assert metrics["lossless_mismatches"] == 0, note
    assert trained >= 1.0 + MARGIN and trained >= untrained + MARGIN, note
