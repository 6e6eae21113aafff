"""GPU check of the DFlash objective: FlexAttention against the two-part kernel, bf16 vs fp32.

Run ``python bench/gpu_check_model.py``. Without CUDA it says so and exits 0. It builds a small
random Qwen3 target and drafter, a micro-batch of packed rows with random anchors, and prints
(and writes as JSON with ``--out``) the differences in loss and gradients between the two
attention paths, the bf16 loss error, step times, and whether speculative decoding stays lossless.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.features.target_forward import target_features
from dflash.model.anchors import sample_anchors
from dflash.model.drafter import DFlashDrafter
from dflash.model.generate import dflash_generate, greedy_generate
from dflash.model.objective import dflash_objective


def packed_batch(
    rows: int, seq_len: int, docs_per_row: int, vocab: int, anchors: int, bs: int, device: str
):
    """Random packed rows: documents of random lengths, anchors drawn per document."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab - 1, size=(rows, seq_len))
    doc = np.full((rows, seq_len), -1)
    pos = np.zeros((rows, seq_len), dtype=np.int64)
    anchor_rows = []
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(bs, seq_len - bs), docs_per_row - 1, replace=False))
        starts = [0, *cuts.tolist()]
        ends = [*cuts.tolist(), seq_len - rng.integers(0, bs)]  # a little padding at the end
        row_anchors = []
        for d, (s, e) in enumerate(zip(starts, ends, strict=True)):
            doc[r, s:e], pos[r, s:e] = d, np.arange(e - s)
            row_anchors += (s + sample_anchors(np.ones(e - s), bs, anchors, rng)).tolist()
        anchor_rows.append(row_anchors)
    width = max(map(len, anchor_rows))
    anchor = np.full((rows, width), -1)
    for r, a in enumerate(anchor_rows):
        anchor[r, : len(a)] = a
    ids[doc < 0] = 0
    arrays = (ids, doc >= 0, doc, pos, anchor)
    return tuple(torch.as_tensor(a, dtype=torch.long, device=device) for a in arrays)


def loss_and_grads(drafter, batch, features, flex: bool, bf16: bool):
    ids, loss_mask, doc, pos, anchors = batch
    drafter.zero_grad()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = dflash_objective(drafter, features, ids, loss_mask, doc, pos, anchors, 7.0, flex=flex)
        loss = out.loss_sum / out.weight_sum
    loss.backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = torch.cat([p.grad.flatten() for p in drafter.parameters()])
    return float(loss), grads, seconds, out


def figures() -> dict:
    """The check's figures (CUDA only); ``bench/gpu_acceptance.py`` reads them too."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=4096, hidden_size=256, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                         intermediate_size=768)  # fmt: skip
    target = Qwen3ForCausalLM(config).cuda().eval()
    bs = 16
    drafter = DFlashDrafter.from_target(
        target, block_size=bs, num_hidden_layers=2, num_target_features=3, mask_token_id=4095
    )
    batch = packed_batch(
        rows=4, seq_len=1024, docs_per_row=3, vocab=4096, anchors=64, bs=bs, device="cuda"
    )
    ids, _, doc, pos, _ = batch
    features = target_features(target, ids, pos, doc, drafter.config.target_layer_ids)

    results = {}
    for flex in (False, True):
        loss_and_grads(drafter, batch, features, flex, bf16=False)  # warm-up (compile)
        results[flex] = loss_and_grads(drafter, batch, features, flex, bf16=False)
    bf16 = loss_and_grads(drafter, batch, features, flex=True, bf16=True)
    two_part_loss, two_part_grad, two_part_s, two_part_out = results[False]
    flex_loss, flex_grad, flex_s, flex_out = results[True]
    grad_rel = float((flex_grad - two_part_grad).norm() / two_part_grad.norm())
    prompts = [ids[0, :n].tolist() for n in (8, 32, 100)]
    lossless = all(
        dflash_generate(target, drafter, p, 64).tokens == greedy_generate(target, p, 64)
        for p in prompts
    )
    return {
        "two_part_loss": two_part_loss,
        "flex_loss": flex_loss,
        "flex_vs_two_part_loss_abs_diff": abs(flex_loss - two_part_loss),
        "flex_vs_two_part_grad_rel_diff": grad_rel,
        "same_accuracy_counts": bool(torch.equal(two_part_out.correct, flex_out.correct)),
        "bf16_loss": bf16[0],
        "bf16_vs_fp32_loss_rel_diff": abs(bf16[0] - flex_loss) / flex_loss,
        "two_part_step_s": two_part_s,
        "flex_step_s": flex_s,
        "bf16_flex_step_s": bf16[2],
        "generate_lossless_fp32": lossless,
        "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: skipping the GPU check")
        return
    result = figures()
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    grad_rel, lossless = result["flex_vs_two_part_grad_rel_diff"], result["generate_lossless_fp32"]
    ok = grad_rel < 1e-3 and result["flex_vs_two_part_loss_abs_diff"] < 1e-4 and lossless
    raise SystemExit(0 if ok and result["bf16_vs_fp32_loss_rel_diff"] < 2e-2 else 1)


if __name__ == "__main__":
    main()
