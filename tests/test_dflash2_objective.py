"""The DFlash 2 objective: the head's loss plus ``selector_alpha`` x the selector's K-way
cross-entropy, chunked, equal to a plain computation over whole logits, and training the
selector."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_dflash2_packed import ANCHORS, _randomize_dflash2_, make_dflash2, one_row, packed_inputs
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from dflash.model import dflash2_drafter
from dflash.model.dflash2 import unary
from dflash.model.labels import label_plan
from dflash.model.objective import Objective, dflash_objective
from dflash.train.distributed.parallel import borrowed_unsharded, wrap_drafter
from dflash.train.distributed.process_group import Dist

GAMMA = 7.0


def _batch(drafter):
    ids, features, docs, pos = packed_inputs(drafter)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :2] = 0  # some labels do not count
    return features, ids, loss_mask, docs, pos, ANCHORS


def _loss(drafter, batch, alpha: float) -> torch.Tensor:
    out = dflash_objective(
        drafter, *batch, GAMMA, flex=False, objective=Objective(selector_alpha=alpha)
    )
    return out.loss_sum


def _reference(drafter, batch) -> torch.Tensor:
    """Σ w · CE over whole ``[labels, V]`` logits, the gold token swapped in at rank K where the
    top-K lacks it, written from the contract."""
    features, ids, loss_mask, docs, pos, anchors = batch
    bs = drafter.config.block_size
    plan = label_plan(loss_mask, docs, anchors, bs, GAMMA, blocks=True)
    ids1, features1, docs1, pos1, real = one_row(ids, features, docs, pos, anchors)
    slot = torch.arange(bs)
    safe = real.clamp(min=0)
    block_ids = torch.where(
        slot == 0, ids1.gather(1, safe)[:, :, None], drafter.config.mask_token_id
    )
    block_pos = pos1.gather(1, safe)[:, :, None] + slot
    places = (real[:, :, None] + slot).clamp(max=ids1.shape[1] - 1).flatten(1)
    tokens = ids1.gather(1, places)[0]
    hidden = drafter(block_ids.flatten(1), block_pos.flatten(1), features1, pos1, plan.blocks)[0]
    total = torch.zeros(())
    selector, transform = drafter.candidate_selector, drafter.unary_transform()
    for i, w in zip(plan.index.tolist(), plan.weights.tolist(), strict=True):
        logits = drafter.logits(hidden[i])
        u = unary(logits, transform["output_multiplier"], transform["softcap"])
        ids_k = logits.topk(selector.top_k).indices.tolist()
        gold = int(tokens[i])
        if gold not in ids_k:
            ids_k[-1] = gold
        predecessor = int(tokens[i - 1])  # slot k's label is the block's token k; k-1's before it
        context = selector.predecessor_codebook[predecessor] * selector.hidden_projection(hidden[i])
        pair = selector.successor_codebook[ids_k] @ context
        scores = u[ids_k] + pair
        total = total + w * F.cross_entropy(scores[None], torch.tensor([ids_k.index(gold)]))
    return total


def test_the_selector_term_is_a_plain_k_way_cross_entropy_in_chunks(target, monkeypatch):
    drafter = _randomize_dflash2_(make_dflash2(target), draw=5)
    monkeypatch.setattr(dflash2_drafter, "chunk_rows", lambda vocab, device: 3)
    batch = _batch(drafter)
    with torch.no_grad():
        term = _loss(drafter, batch, 0.5) - _loss(drafter, batch, 0.0)
        reference = _reference(drafter, batch)
    assert reference > 0
    torch.testing.assert_close(term, 0.5 * reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("trained", [False, True])
def test_the_gradient_reaches_the_selector(target, trained):
    drafter = make_dflash2(target)
    if trained:
        _randomize_dflash2_(drafter, draw=6)
    drafter.zero_grad()
    _loss(drafter, _batch(drafter), 1.0).backward()
    grads = {n: p.grad for n, p in drafter.candidate_selector.named_parameters()}
    assert grads["hidden_projection.weight"].abs().sum() > 0  # the pair term starts at 0
    if trained:
        assert all(g.abs().sum() > 0 for g in grads.values())


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of this process alone: FSDP shards over one rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_the_selector_term_trains_a_wrapped_drafter_alike(target, world_of_one, parallelism):
    """The term is computed outside the forward: DDP's inner module and FSDP's gathered root
    must give it the weights and take its gradients as the bare drafter does."""
    bare = _randomize_dflash2_(make_dflash2(target), draw=7)
    wrapped = _randomize_dflash2_(make_dflash2(target), draw=7)
    model = wrap_drafter(wrapped, world_of_one, parallelism)
    assert isinstance(model, DistributedDataParallel | FSDPModule)
    for drafter in (bare, model):
        drafter.zero_grad()
        with borrowed_unsharded(drafter):
            _loss(drafter, _batch(bare), 1.0).backward()
    for (name, p), q in zip(
        bare.candidate_selector.named_parameters(),
        wrapped.candidate_selector.parameters(),
        strict=True,
    ):
        grad = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
        torch.testing.assert_close(grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_selector_keeps_no_vocabulary_wide_tensor_and_its_gradient_is_the_plain_one(target):
    """The K scored logits come from their rows of the head (recomputed in the backward): the
    backward holds nothing ``[.., V]`` wide, and the gradient to the drafter's hidden states is
    the one through whole logits."""
    drafter = _randomize_dflash2_(make_dflash2(target), draw=7)
    vocab, n = drafter.config.vocab_size, 10
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, drafter.config.hidden_size, generator=gen, requires_grad=True)
    preds, gold = (torch.randint(0, vocab, (n,), generator=gen) for _ in range(2))
    widths = []

    def keep(t):
        widths.append(t.shape[-1] if t.dim() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = drafter.selector_scores(hidden, preds, gold, rows=3)
    assert vocab not in widths
    ours = torch.autograd.grad(F.cross_entropy(out.scores, out.gold_index), hidden)[0]

    logits = drafter.logits(hidden)  # the plain way: gather from whole logits
    selector = drafter.candidate_selector
    pair = selector.pair(selector.project(hidden), preds, out.loss_candidates)
    plain = unary(logits.gather(-1, out.loss_candidates), **drafter.unary_transform()) + pair
    expected = torch.autograd.grad(F.cross_entropy(plain, out.gold_index), hidden)[0]
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
