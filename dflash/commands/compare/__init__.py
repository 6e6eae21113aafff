"""``dflash compare``: paired differences between runs, read from each run's own revision."""
