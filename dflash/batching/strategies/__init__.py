"""The batching strategies, one module each, named after the strategy and defining
``STRATEGY``; ``dflash.batching.registry`` finds them by their file names."""
