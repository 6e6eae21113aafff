"""The feature sources, one module each, named after the value of ``train.topology`` or
``train.features`` that chooses it (its ``PARAM``) and defining ``SOURCE``;
``dflash.features.registry`` finds them (:mod:`dflash.config.plugins`)."""
