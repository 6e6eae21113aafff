"""Each rule of the plan validator fires on a plan broken for that rule, and names it."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from dflash.batching import io
from dflash.batching.errors import InvalidPlanError
from dflash.batching.params import PlanParams
from dflash.batching.planner import plan_epoch, plan_meta, write_plans
from dflash.batching.validate import check_epoch, validate_plans

LENGTHS = np.array([10, 12, 10, 30, 7, 22, 12, 18, 9, 25, 14, 10, 5, 28, 16, 11], np.int32)


def planned(strategy="shuffle", **kw):
    kw = {"token_budget": 64, "max_seq_len": 32, "max_batch_size": 4, **kw}
    if strategy == "bucketed":
        kw["boundaries"] = (12, 20, 32)
    params = PlanParams(strategy, **kw)
    table = plan_epoch(LENGTHS, params, 0)
    return {c: table.column(c).to_numpy().copy() for c in table.column_names}, plan_meta(
        LENGTHS, params, 1
    )


def check(col, meta, match):
    table = pa.table({name: pa.array(col[name], io.SCHEMA.field(name).type) for name in col})
    with pytest.raises(InvalidPlanError, match=match):
        check_epoch(table, LENGTHS, meta, 0)


def first_multi_row_mb(col):
    """Index of the second table row of the first micro-batch with two or more rows."""
    same_mb = (np.diff(col["step"]) == 0) & (np.diff(col["rank"]) == 0)
    same_mb &= np.diff(col["micro"]) == 0
    return int(np.flatnonzero(same_mb & (np.diff(col["row"]) == 1))[0]) + 1


def test_a_valid_plan_passes():
    for strategy in ("sorted", "shuffle", "bucketed", "packed"):
        col, meta = planned(strategy, world_size=2, grad_accum=2)
        check_epoch(pa.table(col).cast(io.SCHEMA), LENGTHS, meta, 0)


def test_schema():
    col, meta = planned()
    table = pa.table(col).cast(io.SCHEMA).set_column(0, "epoch", pa.array(col["epoch"], pa.int64()))
    with pytest.raises(InvalidPlanError, match="schema"):
        check_epoch(table, LENGTHS, meta, 0)


def test_epoch_column():
    col, meta = planned()
    col["epoch"][:] = 1
    check(col, meta, "column 'epoch' is not 0")


def test_sample_id_range():
    col, meta = planned()
    col["sample_id"][0] = LENGTHS.size
    check(col, meta, "outside 0..15")


def test_each_sample_once():
    col, meta = planned()
    a, b = 0, 2  # both 10 tokens long: lengths and budgets stay right
    where_a = int(np.flatnonzero(col["sample_id"] == a)[0])
    col["sample_id"][where_a] = b
    check(col, meta, "sample (0 is placed 0|2 is placed 2) times")


def test_length_matches_the_lengths_file():
    col, meta = planned()
    col["length"][0] -= 1
    check(col, meta, "has length")


def test_plan_order():
    col, meta = planned()
    i = first_multi_row_mb(col)
    col["row"][i - 1], col["row"][i] = col["row"][i], col["row"][i - 1]
    check(col, meta, "not after row")


def test_rank_and_micro_within_world_and_accumulation():
    col, meta = planned(world_size=2)
    check(col, {**meta, "world_size": 1}, "rank >= world_size")


def test_no_missing_micro_batch_slot():
    col, meta = planned()
    last = col["step"] == col["step"].max()
    col["step"][last] += 1
    check(col, meta, "slot .* is missing")


def test_last_step_complete():
    lengths_one_rank, meta = planned("sorted", token_budget=64, max_batch_size=2)
    steps = lengths_one_rank["step"].max() + 1
    world = next(w for w in (2, 3, 5, 7) if steps % w)
    col = dict(lengths_one_rank)
    col["rank"] = col["step"] % world
    col["step"] = col["step"] // world
    check(col, {**meta, "world_size": world}, "last step is incomplete")


def test_rows_numbered_from_zero():
    col, meta = planned()
    i = first_multi_row_mb(col)
    mb = (col["step"] == col["step"][i]) & (col["rank"] == col["rank"][i])
    col["row"][np.flatnonzero(mb & (col["micro"] == col["micro"][i]))[-1]] += 1
    check(col, meta, "are not numbered 0, 1, 2")


def test_offsets_are_the_tokens_before():
    col, meta = planned("packed")
    inside = np.flatnonzero(col["offset"] > 0)[0]
    col["offset"][inside] += 1
    check(col, meta, "offset")


def test_unpacked_rows_hold_one_sample():
    col, meta = planned(max_seq_len=64)
    i = first_multi_row_mb(col)
    col["row"][i] = col["row"][i - 1]
    col["offset"][i] = col["length"][i - 1]
    mb = (col["step"] == col["step"][i]) & (col["rank"] == col["rank"][i])
    mb &= col["micro"] == col["micro"][i]
    later = np.flatnonzero(mb)[np.flatnonzero(mb) > i]
    col["row"][later] -= 1
    check(col, meta, "'shuffle' rows hold one sample")


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("max_seq_len", 20, "tokens > max_seq_len"),
        ("max_batch_size", 1, "rows > max_batch_size"),
        ("token_budget", 40, "tokens > token_budget"),
    ],
)
def test_limits(key, value, match):
    col, meta = planned()
    check(col, {**meta, key: value}, match)


def test_buckets_not_mixed():
    col, meta = planned("bucketed")
    check(col, {**meta, "boundaries": [11, 32]}, "mixes length buckets")


@pytest.fixture
def plans(tmp_path):
    params = PlanParams("sorted", 64, 32, 4)
    write_plans(LENGTHS, params, 2, tmp_path)
    return tmp_path


def edit_summary(plans, change):
    path = plans / "summary.json"
    summary = json.loads(path.read_text())
    change(summary)
    path.write_text(json.dumps(summary))


def test_directory_rules(plans):
    validate_plans(plans, LENGTHS)
    with pytest.raises(InvalidPlanError, match="other lengths"):
        validate_plans(plans, LENGTHS[::-1].copy())


def test_summary_epochs_agree_with_meta(plans):
    edit_summary(plans, lambda s: s["epochs"].pop())
    with pytest.raises(InvalidPlanError, match="summary lists 1 epochs"):
        validate_plans(plans, LENGTHS)


def test_epoch_file_present(plans):
    io.epoch_path(plans, 1).unlink()
    with pytest.raises(InvalidPlanError, match="is missing"):
        validate_plans(plans, LENGTHS)


def test_epoch_file_meta_matches_summary(plans):
    edit_summary(plans, lambda s: s["meta"].update(seed=5))
    with pytest.raises(InvalidPlanError, match="meta differs"):
        validate_plans(plans, LENGTHS)


def test_summary_figures_match_the_plan(plans):
    edit_summary(plans, lambda s: s["epochs"][0].update(padding_efficiency=0.5))
    with pytest.raises(InvalidPlanError, match="padding_efficiency"):
        validate_plans(plans, LENGTHS)


def test_sorted_keeps_its_micro_batches(plans):
    path = io.epoch_path(plans, 1)
    table, meta = io.read_epoch(path)
    epoch0, _ = io.read_epoch(io.epoch_path(plans, 0))
    col = {c: table.column(c).to_numpy().copy() for c in table.column_names}
    # Swap two samples of equal length between two micro-batches: every other rule holds.
    a, b = 0, 2
    ia, ib = (int(np.flatnonzero(col["sample_id"] == s)[0]) for s in (a, b))
    col["sample_id"][ia], col["sample_id"][ib] = b, a
    broken = pa.table({n: pa.array(col[n], io.SCHEMA.field(n).type) for n in col})
    io.write_epoch(broken, path, meta)
    from dflash.batching.metrics import epoch_metrics

    figures, _ = epoch_metrics(broken, LENGTHS.size, epoch_metrics(epoch0, LENGTHS.size, None)[1])
    edit_summary(plans, lambda s: s["epochs"].__setitem__(1, figures))
    same_mb = len(
        {tuple(col[k][ia] for k in ("step", "rank", "micro"))}
        | {tuple(col[k][ib] for k in ("step", "rank", "micro"))}
    )
    if same_mb == 1:
        pytest.skip("the two samples share a micro-batch in this plan")
    with pytest.raises(InvalidPlanError, match="'sorted' must keep every micro-batch"):
        validate_plans(plans, LENGTHS)
