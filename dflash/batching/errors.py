"""Errors of the batching library: each names the bad input, all are ``BatchingError``s."""

from dflash.errors import BatchingError

__all__ = [
    "BatchingError",
    "BudgetTooSmallError",
    "EmptyLengthsError",
    "InvalidPlanError",
    "SampleTooLongError",
    "TooFewMicroBatchesError",
]


class EmptyLengthsError(BatchingError):
    """The lengths file holds no samples."""


class SampleTooLongError(BatchingError):
    """A sample is longer than ``max_seq_len``."""


class BudgetTooSmallError(BatchingError):
    """A single sample does not fit in ``token_budget``."""


class TooFewMicroBatchesError(BatchingError):
    """Too few samples for every rank to get ``grad_accum`` micro-batches in every step."""


class InvalidPlanError(BatchingError):
    """A plan on disk breaks one of its invariants (``dflash.batching.validate``) or does not
    describe the run about to use it (other data, params or world size): the one error type
    for a plan that must not be trained on."""
