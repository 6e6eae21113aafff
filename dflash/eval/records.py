"""One record per scored prompt: what ``dflash compare`` pairs across runs.

Two runs scored on the same prompts differ prompt by prompt far less than their τ intervals
suggest, since most of τ's spread is between prompts. ``metrics/eval_prompts.csv`` keeps each
prompt's τ with its set, its place in the set, a digest of its tokens (a pair is only a pair
when the prompts are the same) and the strata it falls in, so a comparison can resample
prompts and keep each prompt's two runs together. torch stays out: compare reads it back.
"""

from __future__ import annotations

import csv
import hashlib
import io
from typing import TYPE_CHECKING

from dflash.eval.strata import groups

if TYPE_CHECKING:
    from dflash.eval.prompts import Prompt
    from dflash.model.generate import GenerateOutput

COLUMNS = ("set", "prompt", "digest", "strata", "tau", "ngram_tau", "tokens")
STRATA_SEPARATOR = " "


def digest(ids: list[int]) -> str:
    """A short hash of a prompt's tokens."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def response_tau(output: GenerateOutput) -> float | None:
    """Committed tokens per verification step of one response (None without a step)."""
    return sum(output.accepted) / len(output.accepted) if output.accepted else None


def prompt_records(
    set_name: str,
    prompts: list[Prompt],
    modes: list[str],
    methods: dict[str, list[GenerateOutput]],
) -> list[dict]:
    """A record per prompt of one set, naming every ``kind:group`` stratum it is in."""
    labels: list[list[str]] = [[] for _ in prompts]
    for kind, by in groups(prompts, modes).items():
        for name, index in by.items():
            for i in index:
                labels[i].append(f"{kind}:{name}")
    return [
        {
            "set": set_name,
            "prompt": i,
            "digest": digest(p.ids),
            "strata": STRATA_SEPARATOR.join(labels[i]),
            "tau": response_tau(methods["dflash"][i]),
            "ngram_tau": response_tau(methods["ngram"][i]),
            "tokens": len(methods["dflash"][i].tokens),
        }
        for i, p in enumerate(prompts)
    ]


def records_csv(records: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({k: "" if r[k] is None else r[k] for k in COLUMNS})
    return out.getvalue()


def read_records(text: str) -> list[dict]:
    """The records of :func:`records_csv`, typed; a prompt without a step has ``tau`` None."""

    def number(value: str) -> float | None:
        return float(value) if value else None

    return [
        {
            "set": row["set"],
            "prompt": int(row["prompt"]),
            "digest": row["digest"],
            "strata": row["strata"].split(STRATA_SEPARATOR) if row["strata"] else [],
            "tau": number(row["tau"]),
            "ngram_tau": number(row["ngram_tau"]),
            "tokens": int(row["tokens"]),
        }
        for row in csv.DictReader(io.StringIO(text))
    ]
