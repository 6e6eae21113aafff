"""The drafter's model card: how to serve it, what trained it, and how well it drafts.

An export is copied away from the pipeline that made it; the card travels with it, so whoever
holds the directory can serve it with vLLM or SGLang, rerun its training params, and compare
its figures with their own. Its commands run as written from the directory that holds it: the
drafter is ``.``, and the target, which is not copied, is one variable at the top of each.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from dflash.metrics.names import CARD, shown
from dflash.model.hf_files import REMOTE_CODE

DFLASH2 = "DFlash2DraftModel"
"""The architecture of a DFlash 2 export (``dflash.model.dflash2_drafter.ARCHITECTURE``)."""

TRAINING_KEYS = tuple(m.name for m in shown(CARD))
"""Training figures the card shows (:data:`dflash.metrics.names.CARD`): the run's outcome,
never its timings. A ``train.keep_best`` run also shows the step whose weights it holds."""
SCORECARD_KEYS = {
    "acceptance_length": "τ (acceptance length, per response)",
    "acceptance_length_ci95": "τ 95% interval",
    "acceptance_length_zlab": "τ counted as z-lab's dflash_generate",
    "lossless_mismatches": "lossless mismatches",
    "baselines.ngram.acceptance_length": "τ of n-gram prompt lookup",
}
"""Figures of ``metrics/eval.json`` the card shows when it is given them, in this order."""


def _flat(figures: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _value(value: Any) -> str:
    if value is None:  # a figure the run could not give (metrics' null_reasons say why)
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


TARGET_NOTE = "the target: its hub name, or its directory (models/target of the training run)"
"""Said beside the one variable of each command that a user may have to change."""


def _serving(target: str, directory: str, block_size: int) -> str:
    """How vLLM and SGLang serve the drafter."""
    spec = json.dumps(
        {"method": "dflash", "model": directory, "num_speculative_tokens": block_size - 1}
    )
    return f"""## Serve

Run these from this directory; set `TARGET` first when the target is not at that path. They
read local files only: download the target first, or drop `local_files_only=True`.

vLLM:

```bash
TARGET={target}  # {TARGET_NOTE}
vllm serve "$TARGET" \\
  --speculative-config '{spec}'
```

SGLang:

```bash
TARGET={target}  # {TARGET_NOTE}
python -m sglang.launch_server --model-path "$TARGET" \\
  --speculative-algorithm DFLASH \\
  --speculative-draft-model-path {directory} \\
  --speculative-num-draft-tokens {block_size} \\
  --trust-remote-code
```
"""


def _dflash2(dflash: dict[str, Any]) -> str:
    """What makes the drafter DFlash 2, and what serves it."""
    return f"""
A DFlash 2 drafter (`{DFLASH2}`): a block-local dynamic convolution of
{dflash["conv_kernel_size"]} taps around every sublayer ({dflash["conv_group_size"]} channels a
group), and a rank-{dflash["selector_rank"]} selector that rescores the head's top
{dflash["selector_top_k"]} candidates per slot; a block is the selector's greedy walk from the
anchor. vLLM (0.33.0 and later) and SGLang (0.5.23 and later) serve `{DFLASH2}`; no remote code
ships with it.
"""


def _transformers(target: str, directory: str) -> str:
    """How Transformers runs the drafter through the remote code shipped beside it."""
    return f"""
Transformers (the modelling code is `{REMOTE_CODE}` in this directory):

```python
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

TARGET = {json.dumps(target)}  # {TARGET_NOTE}
DRAFTER = {json.dumps(directory)}  # this directory

tokenizer = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
target = AutoModelForCausalLM.from_pretrained(TARGET, dtype="auto", local_files_only=True).eval()
draft = AutoModel.from_pretrained(
    DRAFTER, trust_remote_code=True, dtype="auto", local_files_only=True
).eval()

messages = [{{"role": "user", "content": "Name three uses of a hash map."}}]
input_ids = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
)["input_ids"].to(target.device)
eos_token_id = tokenizer.eos_token_id
output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256,
                             stop_token_ids=[eos_token_id], temperature=0.0)
print(tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True))
```
"""


SCORECARD_NOTE = (
    "\nThe scorecard of real speculative decoding: `dflash evaluate`, then "
    "`python -m dflash.commands.publish DIR` copies this export with it.\n"
)


def _figures(training: dict[str, Any], scorecard: dict[str, Any] | None) -> str:
    rows = [(key, _value(training[key])) for key in TRAINING_KEYS if key in training]
    if scorecard:
        flat = _flat(scorecard)
        rows += [(label, _value(flat[key])) for key, label in SCORECARD_KEYS.items() if key in flat]
    lines = ["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return "## Figures\n\n" + "\n".join(lines) + "\n" + ("" if scorecard else SCORECARD_NOTE)


SCORECARD_HEADING = "## Scorecard"
"""Opens the scorecard; a card holding it is one ``dflash.commands.publish`` wrote."""


def scorecard_section(table: list[dict]) -> str:
    """τ per prompt set and stratum (``dflash.eval.strata.rows``) as a Markdown table."""

    def cell(value: Any) -> str:
        return "–" if value is None else _value(value)

    lines = [
        SCORECARD_HEADING,
        "",
        "τ per response (95% bootstrap interval), z-lab's count of τ, and n-gram prompt lookup's "
        "τ on the same prompts, by prompt set and stratum (`metrics/eval.json` of the run):",
        "",
        "| set | stratum | τ | 95% CI | τ (z-lab) | n-gram τ | prompts |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        ci = r["acceptance_length_ci95"]
        shown = f"{ci[0]:.2f}–{ci[1]:.2f}" if ci else "–"
        lines.append(
            f"| {r['set']} | {r['stratum']} | {cell(r['acceptance_length'])} | {shown} | "
            f"{cell(r['acceptance_length_zlab'])} | {cell(r['ngram_acceptance_length'])} | "
            f"{r['n_prompts']} |"
        )
    return "\n".join(lines) + "\n"


def model_card(
    config: dict[str, Any],
    target: str,
    params: dict[str, Any],
    training: dict[str, Any],
    scorecard: dict[str, Any] | None = None,
    directory: str = ".",
) -> str:
    """The ``README.md`` of a drafter export, from its ``config.json`` dict and the run's params.

    ``training`` holds the training summary's figures; ``scorecard`` evaluate's metrics when
    they describe this very export (they are written after it, so training passes none).
    ``directory`` is the drafter as the commands name it: the card's own directory.
    """
    bs, dflash = config["block_size"], config["dflash_config"]
    mask = dflash.get("mask_token", "?")
    source = params.get("data", {}).get("source", "?")
    architecture = config["architectures"][0]
    if architecture == DFLASH2:
        name, running = "DFlash 2", _serving(target, directory, bs) + _dflash2(dflash)
    else:
        name, running = "DFlash", _serving(target, directory, bs) + _transformers(target, directory)
    return f"""# {name} drafter for `{target}`

A DFlash block-diffusion draft model trained by the dflash pipeline against `{target}`: in one
forward pass it drafts {bs - 1} tokens from the features of target layers
{dflash["target_layer_ids"]}, and the target verifies them, so the output is the target's own.
Trained on the conversations of `{source}` (`data.source`).
{config["num_hidden_layers"]} layers, hidden size {config["hidden_size"]}, weights in
{config["dtype"]}, mask token `{mask}` (id {dflash["mask_token_id"]}). The target's embedding
and LM head are borrowed, not stored here.

{running}
## Training params

```yaml
{yaml.safe_dump(params, sort_keys=True).rstrip()}
```

{_figures(training, scorecard)}"""
