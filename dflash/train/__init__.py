"""Multi-process training of the drafter against the frozen target, driven by the epoch plans."""
