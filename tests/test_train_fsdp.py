"""FSDP2 training: the same run as DDP up to float rounding, from sharded target and drafter."""

from __future__ import annotations

import csv
import os

import pytest
import torch
from test_train import final_weights, torchrun

from dflash.train.parallel import clip_grad_norm


def losses(workspace) -> list[float]:
    return [float(row["loss"]) for row in csv.DictReader(open(workspace / "plots/train/log.csv"))]


@pytest.mark.slow
def test_fsdp_trains_like_ddp(tiny_workspace, tmp_path):
    """2 gloo ranks in fp32: the first 10 steps' losses and the exported drafter agree."""
    runs = {}
    for parallelism in ("ddp", "fsdp"):
        workspace = tmp_path / parallelism
        os.system(f"cp -r {tiny_workspace} {workspace}")
        proc = torchrun(workspace, "train.epochs=1", f"train.parallelism={parallelism}")
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        runs[parallelism] = losses(workspace)[:10], final_weights(workspace)
    (ddp_loss, ddp_weights), (fsdp_loss, fsdp_weights) = runs["ddp"], runs["fsdp"]
    assert len(ddp_loss) == 10
    assert fsdp_loss == pytest.approx(ddp_loss, abs=1e-5)
    assert ddp_weights.keys() == fsdp_weights.keys()
    for name, weight in ddp_weights.items():
        torch.testing.assert_close(fsdp_weights[name], weight, atol=1e-5, rtol=0)


def test_clip_grad_norm_is_torch_clip_grad_norm():
    def params(seed: int) -> list[torch.nn.Parameter]:
        torch.manual_seed(seed)
        out = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
        for p in out:
            p.grad = torch.randn(5) * 3
        return out

    ours, theirs = params(0), params(0)
    norm = clip_grad_norm(ours, 1.0)
    assert norm == torch.nn.utils.clip_grad_norm_(theirs, 1.0).item()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.grad, b.grad)
