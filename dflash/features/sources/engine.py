"""``engine``: serving engines compute the features (vLLM's ``extract_hidden_states``).

Each document of a micro-batch is one request to the servers of the ``engine`` params
(:class:`dflash.features.engine_client.EngineClient`), fetched ahead in plan order
(:class:`dflash.features.documents.DocumentFeatures`). The engines write no answers to the
held-out prompts, so there is no held-out batch: simulated τ and validation need a target
in process.
"""

from __future__ import annotations

import torch

from dflash.data.store import TokenStore
from dflash.features.documents import DocumentFeatures, Fetch
from dflash.features.engine_client import EngineClient, connect
from dflash.features.source import Inputs, Kind
from dflash.features.target_forward import feature_dtype
from dflash.model.layer_ids import feature_width

PARAM = "train.topology"

REQUESTS_PER_ENDPOINT = 8
"""Documents in flight per endpoint: the engine batches them itself."""


def served_fetch(client: EngineClient) -> Fetch:
    """Each document a request to the engines."""

    def fetch(sample_id: int, token_ids: list[int], what: str) -> torch.Tensor:
        return client.states(token_ids, what)

    return fetch


def build(run: Inputs) -> DocumentFeatures:
    e, files = run.config.engine, run.files
    hidden, dtype = run.target.config.hidden_size, feature_dtype(run.target)
    client = connect(e, files.hidden_states, len(run.layer_ids), hidden, dtype)
    return DocumentFeatures(
        served_fetch(client), TokenStore(files.tokenized), run.placement.ctx,
        feature_width(run.layer_ids, hidden), dtype, run.config.train.feature_prefetch,
        REQUESTS_PER_ENDPOINT * len(e.endpoints), forwards=lambda: client.requests,
    )  # fmt: skip


SOURCE = Kind(name="engine", build=build)
