"""Sample lengths: the only input a plan depends on, read from any Parquet file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dflash.batching.errors import (
    BatchingError,
    BudgetTooSmallError,
    EmptyLengthsError,
    SampleTooLongError,
)


def read_lengths(path: str | Path) -> np.ndarray:
    """The ``length`` column of a Parquet file as int32; row index = ``sample_id``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"lengths file {path} does not exist")
    table = pq.read_table(path, columns=["length"])
    lengths = table.column("length").to_numpy()
    if lengths.size == 0:
        raise EmptyLengthsError(f"lengths file {path} has no rows: nothing to plan")
    if not np.issubdtype(lengths.dtype, np.integer):
        raise BatchingError(f"{path}: column 'length' must be integers, got {lengths.dtype}")
    return lengths.astype(np.int32)


def check_lengths(lengths: np.ndarray, max_seq_len: int, token_budget: int) -> None:
    """Refuse inputs no plan can hold, naming the first offending sample."""
    if lengths.size == 0:
        raise EmptyLengthsError("no samples: the lengths array is empty")
    if lengths.min() < 1:
        bad = int(np.argmin(lengths))
        raise BatchingError(f"sample {bad} has length {int(lengths[bad])}: lengths must be >= 1")
    longest = int(np.argmax(lengths))
    if lengths[longest] > max_seq_len:
        raise SampleTooLongError(
            f"sample {longest} has {int(lengths[longest])} tokens, more than max_seq_len = "
            f"{max_seq_len}; truncate or drop it when tokenizing"
        )
    if lengths[longest] > token_budget:
        raise BudgetTooSmallError(
            f"token_budget = {token_budget} is smaller than sample {longest} "
            f"({int(lengths[longest])} tokens): no micro-batch could hold it"
        )
