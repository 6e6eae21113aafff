"""Host reads in a training step: at most 2 per micro-batch, none per layer or per document."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from conftest import tiny_qwen3
from syncs import HostReads

from dflash.features.sources.colocated import ColocatedFeatures
from dflash.model.drafter import DFlashDrafter
from dflash.model.drafter_attention import build_attention_mask
from dflash.train.batches import build_micro_batch
from dflash.train.distributed.process_group import Dist
from dflash.train.step import forward_backward

PACKED = [[(0, 0, 30), (1, 30, 17)], [(2, 0, 22), (4, 22, 9), (5, 31, 25)]]
PADDED = [[(3, 0, 40)], [(5, 0, 25)]]
MANY_DOCUMENTS = [[(4, 9 * i, 9) for i in range(6)], [(1, 0, 17), (4, 17, 9)]]


def store() -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A token store of six samples: ids and loss masks, by sample id."""
    rng = np.random.default_rng(0)
    lengths = [30, 17, 22, 40, 9, 25]
    return {
        i: (rng.integers(1, 290, n), (rng.random(n) < 0.8).astype(np.int64))
        for i, n in enumerate(lengths)
    }


def step_reads(target_layers: int, drafter_layers: int, plans: list) -> HostReads:
    torch.manual_seed(0)
    target = tiny_qwen3(num_hidden_layers=target_layers)
    drafter = DFlashDrafter.from_target(
        target,
        block_size=4,
        num_hidden_layers=drafter_layers,
        num_target_features=2,
        mask_token_id=299,
    )
    kw = dict(block_size=4, anchors_per_sequence=3, gamma=7.0, seed=0, epoch=0)
    micro_batches = [build_micro_batch(store(), rows, **kw) for rows in plans]
    ctx = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    features = ColocatedFeatures(target, drafter.config.target_layer_ids)
    with HostReads() as reads:
        forward_backward(ctx, drafter, micro_batches, features, 7.0, contextlib.nullcontext())
    return reads


def test_counter_sees_host_reads_and_data_sized_ops():
    x = torch.arange(6)
    with HostReads() as reads:
        x.tolist(), int(x[1]), bool(x.any()), x[x > 2], x.nonzero(), torch.bincount(x, minlength=8)
        x.unique(), x.masked_select(x > 1), x.sum() + 1, x.index_select(0, x[:2]), x.cumsum(0)
    ops = [r.op for r in reads.reads]
    assert ops[:3] == [
        "tolist",
        "aten._local_scalar_dense.default",
        "aten._local_scalar_dense.default",
    ]
    assert len(reads) == 8, reads.by_site()
    assert all("test_train_syncs.py" in r.site for r in reads.reads)


@pytest.mark.parametrize("plans", [[PACKED], [PADDED], [PACKED, PADDED, MANY_DOCUMENTS]])
def test_a_step_reads_the_device_at_most_twice_per_micro_batch(plans):
    reads = step_reads(6, 2, plans)
    assert len(reads) <= 2 * len(plans), reads.by_site()


def test_no_host_read_per_layer_or_per_document():
    """More target and drafter layers, more documents a row: the same reads."""
    few = step_reads(6, 1, [PACKED])
    assert len(step_reads(9, 3, [PACKED])) == len(few)
    assert len(step_reads(6, 1, [MANY_DOCUMENTS])) == len(few)
    assert not [r for r in few.reads if "target_attention" in r.site or "drafter" in r.site]


def test_the_flex_mask_reads_nothing_back():
    """On CUDA the drafter's mask is built on the device from the loader's anchors."""
    kw = dict(block_size=4, anchors_per_sequence=3, gamma=7.0, seed=0, epoch=0)
    mb = build_micro_batch(store(), PACKED, flex=True, **kw)
    assert mb.label_plan.blocks is None
    documents = mb.document_ids + torch.arange(2)[:, None] * mb.document_ids.shape[1]
    documents = torch.where(mb.document_ids >= 0, documents, -1).reshape(1, -1)
    with HostReads() as reads:
        build_attention_mask(mb.label_plan.anchors, documents, 4, documents.shape[1], flex=True)
    assert len(reads) == 0, reads.by_site()
