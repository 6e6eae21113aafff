"""The evaluate stage: score the trained drafter on every prompt set and write the outputs.

``metrics/eval_details.json`` holds every figure and ``metrics/eval.json`` the headline that
``dvc exp show`` compares (the contracts in docs/design.md). DVCLive gets per-prompt τ of each
method as steps and the per-position acceptance as a plot, for ``dvc plots``; its summary is
an output, not a metrics file, so it adds no column to ``dvc exp show``.
"""

from __future__ import annotations

import logging
import sys

import torch

from dflash.config.schema import Config
from dflash.data.tokenizer import load_tokenizer, stop_token_ids
from dflash.eval.evaluate import NGRAM_MAX, proposer, score, untrained_drafter
from dflash.eval.ngram import NgramProposer
from dflash.eval.outputs import eval_headline, live_summary, strata_csv
from dflash.eval.prompts import prompt_sets
from dflash.eval.records import prompt_records, records_csv
from dflash.fileio import remove_files, write_json_atomic, write_text_atomic
from dflash.metrics.dvclive import open_live
from dflash.metrics.schema import EvalDetails
from dflash.model.families import load_drafter
from dflash.model.load import load_target
from dflash.pipeline.fingerprint import path_digest
from dflash.pipeline.freshness import stale_drafter
from dflash.pipeline.workspace import Workspace

logger = logging.getLogger(__name__)


def run(config: Config, workspace: Workspace) -> int:
    w = workspace
    stale = stale_drafter(w.root)
    if stale:
        print(f"dflash evaluate: {stale}", file=sys.stderr)
        return 2
    torch.manual_seed(config.evaluate.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(w.target, device=device)
    drafter = load_drafter(w.drafter, target).to(device).eval()
    tokenizer = load_tokenizer(w.tokenizer)
    sets = prompt_sets(config, tokenizer, w.heldout, (w.prompts, w.dvc_cache))
    bs, stop_ids = drafter.config.block_size, stop_token_ids(tokenizer)
    proposers = {
        "dflash": proposer(drafter),
        "ngram": NgramProposer(bs, NGRAM_MAX),
        "untrained": proposer(untrained_drafter(drafter, target, config.train.seed)),
    }
    scored = [score(target, drafter, proposers, s, config, stop_ids) for s in sets]
    metrics, decodes = scored[0]  # the held-out split: today's keys at the top
    metrics["sets"] = {s.name: m for s, (m, _) in zip(sets[1:], scored[1:], strict=True)}
    metrics["drafter_sha256"] = path_digest(w.drafter)  # what was scored, for publishing
    records = [
        r
        for s, (_, d) in zip(sets, scored, strict=True)
        for r in prompt_records(s.name, s.prompts, s.modes, d.methods)
    ]
    write_eval_outputs(metrics, decodes, records, w)
    for s, (m, _) in zip(sets, scored, strict=True):
        base = m["baselines"]
        logger.info(
            f"{s.name}: τ = {m['acceptance_length']:.3f} per response "
            f"({m['acceptance_length_pooled']:.3f} pooled, {m['acceptance_length_zlab']:.3f} "
            f"z-lab's count) over {m['n_prompts']} prompts; n-gram "
            f"{base['ngram']['acceptance_length']:.3f}, untrained "
            f"{base['untrained']['acceptance_length']:.3f}; mismatches "
            f"{m['lossless_mismatches']} (near-ties {m['near_tie_divergences']}), "
            f"decode speedup {'n/a' if m['speedup'] is None else format(m['speedup'], '.2f')}x"
        )
    return 0


def write_eval_outputs(metrics: dict, decodes, records: list[dict], w: Workspace) -> None:
    """The old metrics go first and the new come last: a run killed in between leaves no old
    metrics beside new acceptance rows (they are two files in two directories)."""
    details = EvalDetails.model_validate(metrics)
    remove_files(w.eval_metrics, w.eval_details, w.eval_acceptance, w.eval_strata, w.eval_prompts)
    per = details.per_position_acceptance
    lines = "position,acceptance\n" + "".join(f"{k},{a:.6f}\n" for k, a in enumerate(per, 1))
    write_text_atomic(w.eval_acceptance, lines)
    write_text_atomic(w.eval_strata, strata_csv(details))
    write_text_atomic(w.eval_prompts, records_csv(records))
    live = open_live(w.eval_live)
    for i in range(len(decodes.greedy)):
        for name, outputs in decodes.methods.items():
            accepted = outputs[i].accepted
            if accepted:
                live.log_metric(f"tau/{name}", sum(accepted) / len(accepted))
        live.next_step()
    points = [{"position": k, "acceptance": a} for k, a in enumerate(per, 1)]
    live.log_plot("acceptance", points, x="position", y="acceptance", title="Acceptance")
    live.summary.update(live_summary(details))
    live.end()
    write_json_atomic(w.eval_details, details.dump(), sort_keys=True)
    write_json_atomic(w.eval_metrics, eval_headline(details).dump(), sort_keys=True)
