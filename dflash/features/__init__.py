"""Target features: the hidden states the drafter is conditioned on, and where a rank gets them.

- ``source``: the :class:`~dflash.features.source.FeatureSource` protocol every kind implements.
- ``sources/``: the kinds, one module each (colocated, decoupled, engine, files), found by
  ``registry``; ``choices`` lists their names for the params.
- ``target_forward``: the target's forward that yields features, from packed rows too.
- ``target_ranks``: a decoupled run's target ranks, serving features to the drafter ranks.
- ``engine_client``: hidden states from serving engines (vLLM and hs-connectors).
- ``documents``: features fetched one document at a time (engines, files); ``prefetch``: the
  window of requests posted ahead.
- ``capture``: the ``capture`` stage's files: written once, checked, read back.
"""
