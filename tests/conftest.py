"""Shared fixtures: a tiny pipeline workspace built in code (corpus → … → plans).

The workspace is built once per test session by running the real stage functions with tiny
params, then copied per test, so training and evaluation tests start from real artefacts in
seconds instead of rebuilding them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from hold import Hold
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.cli import run_stage
from dflash.config.params import load_config
from dflash.model.drafter import DFlashDrafter
from dflash.model.drafter_attention import build_block_mask
from dflash.model.generate import greedy_generate
from dflash.model.objective import block_labels
from dflash.train.checkpointing.checkpoint import CHECKPOINT_NAME
from dflash.train.distributed.process_group import Dist, init_distributed

torch.set_num_threads(1)

TINY_PARAMS = {
    "data": {
        "source": "data/raw/corpus.jsonl",
        "eval_fraction": 0.1,
        "max_seq_len": 96,
        "max_conversations": None,
        "regenerate": False,
    },
    "tokenizer": {"vocab_size": 320},
    "target": {
        "num_hidden_layers": 6,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "pretrain_epochs": 1,
        "pretrain_batch_tokens": 2048,
        "pretrain_lr": 1.0e-2,
        "end_token_weight": 1.0,
    },
    "drafter": {
        "block_size": 4,
        "num_hidden_layers": 1,
        "num_target_features": 2,
        "anchors_per_sequence": 6,
    },
    "batching": {
        "strategy": "shuffle",
        "token_budget": 384,
        "max_batch_size": 8,
        "num_buckets": 2,
        "slot_cost": 0.5,
    },
    "train": {"epochs": 2, "world_size": 2, "checkpoint_every": 2, "num_workers": 0, "lr": 3.0e-3},
    "evaluate": {"num_prompts": 4, "max_new_tokens": 12},
    "logging": {"wandb": "disabled", "every": 1},
}


def tiny_qwen3(
    vocab_size: int = 300,
    hidden_size: int = 32,
    num_hidden_layers: int = 6,
    intermediate_size: int = 64,
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """A seeded, randomly initialised Qwen3 target with 4 query and 2 key/value heads."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        intermediate_size=intermediate_size,
    )
    return Qwen3ForCausalLM(config).eval()


BLOCK_SIZE = 4
MASK_ID = 299
"""The model tests' drafter block size and mask token (a token id of the tiny vocabulary)."""


def tiny_drafter(target, layers: int = 2, features: int = 2, **options) -> DFlashDrafter:
    """A drafter over ``target`` of ``layers`` layers reading ``features`` target layers, block
    size :data:`BLOCK_SIZE` and mask token :data:`MASK_ID` unless ``options`` say otherwise."""
    options = {"block_size": BLOCK_SIZE, "mask_token_id": MASK_ID, **options}
    return DFlashDrafter.from_target(
        target, num_hidden_layers=layers, num_target_features=features, **options
    )


@pytest.fixture(scope="module")
def target() -> Qwen3ForCausalLM:
    """The model tests' target: five layers, so two features skip some."""
    return tiny_qwen3(num_hidden_layers=5)


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    return tiny_drafter(target)


def drafter_grads(drafter: DFlashDrafter, loss: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of ``loss`` for each drafter parameter, the earlier ones cleared first."""
    drafter.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in drafter.parameters()]


def dense_blocks(drafter, features, ids, loss_mask, docs, pos, anchors):
    """Every anchor's block through the drafter under a dense mask: its hidden states
    ``(rows, anchors, block, hidden)``, then the block labels and which of them count. The
    reference the chunked, two-part objective is held to."""
    bs = drafter.config.block_size
    rows, count = anchors.shape
    slot = torch.arange(bs)
    first = ids.gather(1, anchors.clamp(min=0))[:, :, None]
    block_ids = torch.where(slot == 0, first, drafter.config.mask_token_id).flatten(1)
    block_pos = (pos.gather(1, anchors.clamp(min=0))[:, :, None] + slot).flatten(1)
    mask = build_block_mask(anchors, docs, bs, ids.shape[1])
    hidden = drafter(block_ids, block_pos, features, pos, mask).view(rows, count, bs, -1)
    return (hidden, *block_labels(ids, loss_mask, docs, anchors, bs))


def assert_drafts_losslessly(model, target, stop: bool = False) -> None:
    """An exported drafter's ``spec_generate`` writes the target's greedy tokens; with
    ``stop``, it also ends at a stop token, that token the last."""
    for prompt in ([5], [1, 2, 3], [7, 250, 7, 250, 7]):
        reference = greedy_generate(target, prompt, 20)
        ids = torch.tensor([prompt])
        out = model.spec_generate(target=target, input_ids=ids, max_new_tokens=20)
        assert out[0, len(prompt) :].tolist() == reference
        if stop:
            token = reference[6]
            out = model.spec_generate(
                target=target, input_ids=ids, max_new_tokens=20, stop_token_ids=[token]
            )
            assert out[0, len(prompt) :].tolist() == reference[: reference.index(token) + 1]


@pytest.fixture
def hub_modules(tmp_path, monkeypatch):
    """Remote code is copied under a temporary modules cache, not the user's ~/.cache."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path / "modules"


DATA_STAGES = ["ingest", "tokenizer", "target", "regenerate", "tokenize", "stats", "plan"]

WORDS = "the cat dog sat ran on a mat log hat big small red blue fast slow".split()


def tiny_corpus(n: int = 120) -> list[dict]:
    """Short, regular conversations: learnable in seconds by tiny models."""
    rows = []
    for i in range(n):
        a, b, c = WORDS[i % 16], WORDS[(i * 3) % 16], WORDS[(i * 7) % 16]
        turns = 1 + i % 3
        messages = []
        for t in range(turns):
            messages.append(
                {"role": "user", "content": f"tell me about the {a} {b} number {i} {t}"}
            )
            messages.append(
                {
                    "role": "assistant",
                    "content": f"the {a} {b} sat on the {c} mat and the {b} ran {t}",
                }
            )
        rows.append({"id": f"conv-{i}", "messages": messages})
    return rows


def write_workspace_inputs(directory: Path, params: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "data/raw").mkdir(parents=True, exist_ok=True)
    with open(directory / "data/raw/corpus.jsonl", "w") as f:
        for row in tiny_corpus():
            f.write(json.dumps(row) + "\n")
    (directory / "params.yaml").write_text(yaml.safe_dump(params))


def run_stages(directory: Path, stages: list[str], overrides: list[str] = ()) -> None:
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        config = load_config("params.yaml", list(overrides))
        for stage in stages:
            run_stage(stage, config)
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="session")
def tiny_workspace_template(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("workspace")
    write_workspace_inputs(directory, TINY_PARAMS)
    run_stages(directory, DATA_STAGES)
    return directory


@pytest.fixture
def tiny_workspace(tiny_workspace_template, tmp_path) -> Path:
    """A private copy of the prepared workspace (tests may train, resume and corrupt it)."""
    directory = tmp_path / "ws"
    shutil.copytree(tiny_workspace_template, directory)
    return directory


@pytest.fixture(scope="session")
def trained(tiny_workspace_template, tmp_path_factory):
    """``trained(*sets)``: the tiny workspace trained by ``dflash train`` (two ranks) with
    ``sets``, run once per session for each ``sets``. A reference that tests read, never write:
    the same run is what several tests compare against."""
    runs: dict[tuple[str, ...], Path] = {}

    def run(*sets: str) -> Path:
        if sets not in runs:
            workspace = tmp_path_factory.mktemp("trained") / "ws"
            shutil.copytree(tiny_workspace_template, workspace)
            cmd = [sys.executable, "-m", "dflash.cli", "train", *(f"--set={s}" for s in sets)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(
                cmd, cwd=workspace, env=env, capture_output=True, text=True, timeout=600
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
            runs[sets] = workspace
        return runs[sets]

    return run


def survivors(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``processes`` still running after up to ``timeout`` seconds. A zombie has
    ended: only its exit status is left, for its parent or, once orphaned, the container's
    init to collect."""

    def running(process: psutil.Process) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + timeout
    while time.time() < deadline and any(running(p) for p in processes):
        time.sleep(0.05)
    return [p for p in processes if running(p)]


def checkpoint_written(workspace: Path, step: int) -> bool:
    """Whether checkpoint ``step`` of a run in ``workspace`` is complete (its digest written)."""
    name = CHECKPOINT_NAME.format(step=step) + ".sha256"
    return any((workspace / "checkpoints").glob(f"*/{name}"))


@pytest.fixture
def hold(tmp_path) -> Iterator[Hold]:
    """Holds a run this test starts after a checkpoint, so a kill lands mid-run (tests/hold.py);
    released at the end, so a failed test leaves no rank waiting forever."""
    held = Hold(tmp_path / "hold")
    yield held
    held.release()


def gloo_rank(rank: int, world_size: int, port: int) -> Dist:
    """Join the gloo job that :func:`spawn_ranks` started, as rank ``rank``, on one thread."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)}
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    return init_distributed()


def leave_gloo() -> None:
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(fn, world_size: int, *args) -> list[dict]:
    """Run ``fn(rank, world_size, port, results, *args)`` in ``world_size`` spawned processes;
    what each put on ``results`` (a dict with its ``rank``), in rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(fn, (world_size, port, results, *args), nprocs=world_size)
    return sorted((results.get() for _ in range(world_size)), key=lambda r: r["rank"])
