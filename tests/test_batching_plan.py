"""Plans: every invariant under random inputs, the running-max rule, determinism, errors."""

import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.batching import io, registry
from dflash.batching.boundaries import optimal_boundaries
from dflash.batching.errors import (
    BudgetTooSmallError,
    EmptyLengthsError,
    InvalidPlanError,
    SampleTooLongError,
    TooFewMicroBatchesError,
)
from dflash.batching.layout import greedy_chunks
from dflash.batching.lengths import read_lengths
from dflash.batching.metrics import structure, window_ks
from dflash.batching.params import PlanParams
from dflash.batching.planner import main, plan_epoch, plan_meta, write_plans
from dflash.batching.validate import check_epoch, validate_plans


def make_params(lengths, strategy, **kw) -> PlanParams:
    kw.setdefault("token_budget", 4 * int(lengths.max()))
    kw.setdefault("max_seq_len", int(lengths.max()))
    kw.setdefault("max_batch_size", 8)
    if strategy == "bucketed":
        kw.setdefault("boundaries", tuple(optimal_boundaries(lengths, 3)))
    return PlanParams(strategy=strategy, **kw)


def lognormal_lengths(n: int, seed: int = 0, high: int = 512) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.5, 0.9, n), 1, high).astype(np.int32)


@st.composite
def plan_inputs(draw):
    lengths = np.array(draw(st.lists(st.integers(1, 64), min_size=1, max_size=120)), np.int32)
    strategy = draw(st.sampled_from(sorted(registry.strategies())))
    max_seq_len = draw(st.integers(int(lengths.max()), 96))
    params = PlanParams(
        strategy=strategy,
        token_budget=draw(st.integers(int(lengths.max()), 400)),
        max_seq_len=max_seq_len,
        max_batch_size=draw(st.integers(1, 12)),
        world_size=draw(st.integers(1, 4)),
        grad_accum=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**32 - 1)),
        boundaries=tuple(optimal_boundaries(lengths, draw(st.integers(1, 4))))
        if strategy == "bucketed"
        else None,
    )
    return lengths, params, draw(st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(plan_inputs())
def test_every_invariant_holds(inputs):
    lengths, params, epoch = inputs
    try:
        table = plan_epoch(lengths, params, epoch)
    except TooFewMicroBatchesError:
        rng = np.random.default_rng([params.seed, epoch])
        made = registry.strategy(params.strategy).layout(lengths, params, rng).n_micro_batches
        per_step = params.world_size * params.grad_accum
        assert -(-made // per_step) * per_step > lengths.size
        return
    check_epoch(table, lengths, plan_meta(lengths, params, epoch + 1), epoch)


@settings(max_examples=25, deadline=None)
@given(plan_inputs())
def test_written_plans_validate(inputs):
    lengths, params, _ = inputs
    params = replace(params, world_size=1, grad_accum=1)
    with tempfile.TemporaryDirectory() as out:
        write_plans(lengths, params, 2, out)
        validate_plans(out, lengths)


def test_greedy_uses_the_running_maximum():
    sizes = np.array([100, 10, 10, 10, 10])
    begin = greedy_chunks(sizes, token_budget=200, max_rows=64)
    assert np.flatnonzero(begin).tolist() == [0, 2]


@pytest.mark.parametrize("strategy", ["shuffle", "bucketed"])
def test_short_after_long_never_breaks_the_budget(strategy):
    lengths = np.array([1000] * 20 + [10] * 2000, dtype=np.int32)
    params = make_params(lengths, strategy, token_budget=2000, max_batch_size=200)
    for epoch in range(3):
        s = structure(plan_epoch(lengths, params, epoch))
        assert s.padded.max() <= 2000


def test_files_are_byte_identical(tmp_path):
    lengths = lognormal_lengths(3000)
    for strategy in registry.strategies():
        params = make_params(lengths, strategy, world_size=2, grad_accum=2, seed=7)
        a, b = tmp_path / f"{strategy}_a", tmp_path / f"{strategy}_b"
        write_plans(lengths, params, 2, a)
        write_plans(lengths, params, 2, b)
        names = sorted(p.name for p in a.iterdir())
        assert names == ["epoch_000.parquet", "epoch_001.parquet", "summary.json"]
        for name in names:
            assert (a / name).read_bytes() == (b / name).read_bytes(), (strategy, name)


@pytest.mark.parametrize("strategy", sorted(registry.strategies()))
def test_new_epoch_new_composition_except_sorted(tmp_path, strategy):
    lengths = lognormal_lengths(5000)
    params = make_params(lengths, strategy, world_size=2)
    summary = write_plans(lengths, params, 3, tmp_path)
    orders = [pq.read_table(io.epoch_path(tmp_path, e))["sample_id"] for e in range(3)]
    assert not orders[0].equals(orders[1])
    if strategy == "sorted":
        assert summary["frozen_batch_fraction"] == 1.0 and summary["pair_overlap"] == 1.0
    else:
        assert summary["frozen_batch_fraction"] < 0.05
        assert summary["pair_overlap"] < 0.2
    assert summary["epochs"][0]["frozen_batch_fraction"] is None


@pytest.mark.parametrize("strategy", sorted(registry.strategies()))
def test_ranks_are_balanced(strategy):
    lengths = lognormal_lengths(20000, high=2048)
    params = make_params(lengths, strategy, token_budget=8192, max_batch_size=64, world_size=8)
    s = structure(plan_epoch(lengths, params, 0))
    loads = np.zeros((s.mb_step.max() + 1, 8))
    np.add.at(loads, (s.mb_step, s.mb_rank), s.padded)
    assert np.mean(loads.max(1) / loads.mean(1) - 1) < 0.05


def test_packed_fills_rows_up_to_the_budget_without_padding():
    lengths = lognormal_lengths(20000, high=2048)
    params = make_params(lengths, "packed", token_budget=8192, max_seq_len=2048)
    s = structure(plan_epoch(lengths, params, 0))
    assert s.length.sum() / s.padded.sum() > 0.999
    assert s.row_tokens.max() <= 8192 and s.row_tokens.mean() > 0.97 * 8192


def test_packed_rows_go_longest_first_so_equal_samples_lie_side_by_side():
    lengths = np.minimum(lognormal_lengths(5000, high=2048), 512)  # many cut at one length
    params = make_params(lengths, "packed", token_budget=2048, max_seq_len=512)
    table = plan_epoch(lengths, params, 0)
    row = np.cumsum(table["offset"].to_numpy() == 0)
    length = table["length"].to_numpy()
    same_row = row[1:] == row[:-1]
    assert (length[1:][same_row] <= length[:-1][same_row]).all()


def test_read_rank_plan(tmp_path):
    lengths = lognormal_lengths(2000)
    params = make_params(lengths, "packed", world_size=3, grad_accum=2)
    write_plans(lengths, params, 1, tmp_path)
    meta = io.read_plan_meta(tmp_path)
    assert meta["meta"]["world_size"] == 3 and meta["meta"]["lengths_sha256"]
    per_rank = [io.read_rank_plan(io.epoch_path(tmp_path, 0), r) for r in range(3)]
    assert {len(steps) for steps in per_rank} == {meta["n_steps"]}
    seen = []
    for steps in per_rank:
        for step in steps:
            assert len(step) == 2
            for micro in step:
                assert 1 <= len(micro) <= params.max_batch_size
                for row in micro:
                    assert [off for _, off, _ in row] == np.cumsum([0] + [n for *_, n in row])[
                        :-1
                    ].tolist()
                    assert all(lengths[sid] == n for sid, _, n in row)
                    seen.extend(sid for sid, _, _ in row)
    assert sorted(seen) == list(range(lengths.size))


def test_errors_name_the_problem(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"length": pa.array([], pa.int32())}), empty)
    with pytest.raises(EmptyLengthsError, match="no rows"):
        read_lengths(empty)
    lengths = np.array([10, 300, 20], dtype=np.int32)
    with pytest.raises(SampleTooLongError, match="sample 1 has 300 tokens"):
        plan_epoch(lengths, make_params(lengths, "shuffle", max_seq_len=256), 0)
    with pytest.raises(BudgetTooSmallError, match="token_budget = 200"):
        plan_epoch(lengths, make_params(lengths, "shuffle", token_budget=200), 0)
    with pytest.raises(TooFewMicroBatchesError, match="world_size × grad_accum = 4"):
        plan_epoch(lengths, make_params(lengths, "sorted", world_size=4), 0)
    assert issubclass(TooFewMicroBatchesError, ValueError)


def _lengths_file(path: Path, lengths: np.ndarray) -> Path:
    pq.write_table(pa.table({"length": lengths}), path)
    return path


def test_cli_plans_and_validate_catches_a_broken_plan(tmp_path, capsys):
    lengths_file = _lengths_file(tmp_path / "lengths.parquet", lognormal_lengths(1500))
    out = tmp_path / "plans"
    args = ["--lengths", str(lengths_file), "--strategy", "bucketed", "--token-budget", "2048"]
    args += ["--max-seq-len", "512", "--max-batch-size", "16", "--epochs", "2"]
    args += ["--world-size", "2", "--grad-accum", "1", "--seed", "3", "--out", str(out)]
    assert main(args) == 0
    assert main(["validate", str(out), "--lengths", str(lengths_file)]) == 0

    path = io.epoch_path(out, 1)
    table, meta = io.read_epoch(path)
    io.write_epoch(table.slice(1), path, meta)
    assert main(["validate", str(out), "--lengths", str(lengths_file)]) == 1
    assert "sample" in capsys.readouterr().err
    with pytest.raises(InvalidPlanError):
        validate_plans(out, read_lengths(lengths_file))


def test_validate_refuses_other_lengths(tmp_path):
    lengths = lognormal_lengths(500)
    write_plans(lengths, make_params(lengths, "shuffle"), 1, tmp_path)
    with pytest.raises(InvalidPlanError, match="other lengths"):
        validate_plans(tmp_path, lengths[::-1].copy())


def test_fingerprint_is_of_int32_bytes():
    lengths = np.array([1, 2, 3])
    assert io.lengths_fingerprint(lengths) == io.lengths_fingerprint(lengths.astype(np.int32))
    assert io.lengths_fingerprint(lengths) != io.lengths_fingerprint(np.array([1, 2, 4]))


def test_one_packed_row_is_split_until_every_rank_has_work():
    lengths = np.ones(10, dtype=np.int32)
    params = make_params(lengths, "packed", max_seq_len=64, token_budget=64, world_size=4)
    params = replace(params, grad_accum=2)
    table = plan_epoch(lengths, params, 0)
    check_epoch(table, lengths, plan_meta(lengths, params, 1), 0)
    assert structure(table).padded.size == 8


def test_replanning_replaces_the_plan_whole_or_not_at_all(tmp_path, monkeypatch):
    out = tmp_path / "plans"
    lengths = lognormal_lengths(500)
    params = make_params(lengths, "shuffle")
    write_plans(lengths, params, 3, out)
    write_plans(lengths, params, 1, out)
    assert sorted(p.name for p in out.iterdir()) == ["epoch_000.parquet", "summary.json"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    real = io.write_epoch

    def killed_after_one(table, path, meta):
        real(table, path, meta)
        if path.name != "epoch_000.parquet":
            raise KeyboardInterrupt

    monkeypatch.setattr(io, "write_epoch", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        write_plans(lengths, replace(params, seed=9), 3, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans"]


def test_plans_refuse_to_replace_a_directory_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    lengths = lognormal_lengths(50)
    with pytest.raises(FileExistsError, match="notes.txt"):
        write_plans(lengths, make_params(lengths, "shuffle"), 1, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_packed_windows_draw_lengths_as_a_shuffle_does():
    """Packed rows are random draws: no window of 4,096 samples in plan order strays 10%."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(7.24, 0.9, 60_000), 16, 8192).astype(np.int32)
    params = PlanParams("packed", token_budget=49_152, max_seq_len=8192, max_batch_size=64,
                        world_size=8)  # fmt: skip
    in_order = plan_epoch(lengths, params, 0).column("length").to_numpy()
    means = in_order[: in_order.size // 4096 * 4096].reshape(-1, 4096).mean(axis=1)
    assert np.all(np.abs(means / lengths.mean() - 1) < 0.1)
    assert window_ks(in_order) < 0.03
