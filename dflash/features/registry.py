"""Every feature source by name, loaded from its module (:mod:`dflash.features.choices`), and
the one factory that builds a run's.

``PLUGIN_PACKAGE`` tells ``dflash.pipeline.closure`` that this module imports every module of
the package, so the train stage depends on all the sources' code.
"""

from __future__ import annotations

from dflash.config import plugins
from dflash.config.schema import TrainConfig
from dflash.features.choices import ATTRIBUTE, chosen_by
from dflash.features.source import FeatureSource, Inputs, Kind

PLUGIN_PACKAGE = "dflash.features.sources"


def kind_of(train: TrainConfig) -> Kind:
    """The kind of source a run's ``train`` params choose; a ``ConfigError`` naming the param
    and its allowed values when there is none of that name."""
    name, key = chosen_by(train)
    return plugins.load(PLUGIN_PACKAGE, ATTRIBUTE, name, Kind, key)


def build_features(run: Inputs) -> FeatureSource:
    """The run's feature source, built for this rank."""
    return kind_of(run.config.train).build(run)
