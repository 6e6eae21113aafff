"""Shared fixtures: a tiny pipeline workspace built in code (corpus → … → plans).

The workspace is built once per test run by running the real stage functions with tiny
params, then copied per test, so training and evaluation tests start from real artefacts in
seconds instead of rebuilding them. The reference runs (``trained``) are made once per run too,
and ``make test``'s pytest-xdist workers share both (:func:`built_once`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from hold import Hold
from run_outputs import final_weights
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.cli import run_stage
from dflash.config.params import load_config
from dflash.heap import skip_exit_collection
from dflash.model.drafter import DFlashDrafter
from dflash.model.drafter_attention import build_block_mask
from dflash.model.generate import greedy_generate
from dflash.model.labels import block_labels
from dflash.train.checkpointing import checkpoint
from dflash.train.checkpointing.checkpoint import CHECKPOINT_NAME
from dflash.train.distributed.process_group import Dist, init_distributed

# One CPU thread per process, this one too: a stage run in process sets torch's threads from
# OMP_NUM_THREADS (dflash/threads.py), and a process's two threads on cores shared with other
# work wait on each other (a one-rank training in process ran 5x slower with two).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most slow tests first, each file's tests in their order: under ``make
    test``'s workers (a file at a time each) the long files start early and the short ones
    fill in at the end, rather than one worker finishing a long file alone."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


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
    **fields,
) -> Qwen3ForCausalLM:
    """A seeded, randomly initialised Qwen3 target with 4 query and 2 key/value heads;
    ``fields``: other ``Qwen3Config`` fields."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        intermediate_size=intermediate_size,
        **fields,
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
def target(request) -> Qwen3ForCausalLM:
    """A test module's own target: :func:`tiny_qwen3` of the module's ``TINY_TARGET``
    keywords, else the model tests' five layers, so two features skip some."""
    return tiny_qwen3(**getattr(request.module, "TINY_TARGET", {"num_hidden_layers": 5}))


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    return tiny_drafter(target)


@pytest.fixture
def world_of_one(tmp_path) -> Iterator[Dist]:
    """A gloo process group of this process alone: FSDP shards over one rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


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


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The directory ``name`` that ``build(directory)`` makes once per test run. Under
    pytest-xdist every worker shares it: the first to ask builds it, under a lock the others
    wait on, so a reference costs the run one build however the tests are spread."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    directory, built = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.exists():
            shutil.rmtree(directory, ignore_errors=True)
            build(directory)
            built.touch()
    return directory


def _prepare(directory: Path) -> None:
    write_workspace_inputs(directory, TINY_PARAMS)
    run_stages(directory, DATA_STAGES)


@pytest.fixture(scope="session")
def tiny_workspace_template(tmp_path_factory) -> Path:
    """The tiny workspace after the data stages: built once per run, then only copied."""
    return built_once(tmp_path_factory, "workspace", _prepare)


@pytest.fixture
def tiny_workspace(tiny_workspace_template, tmp_path) -> Path:
    """A private copy of the prepared workspace (tests may train, resume and corrupt it)."""
    directory = tmp_path / "ws"
    shutil.copytree(tiny_workspace_template, directory)
    return directory


@pytest.fixture(scope="session")
def trained(tiny_workspace_template, tmp_path_factory):
    """``trained(*sets)``: the tiny workspace trained by ``dflash train`` (two ranks) with
    ``sets``, run once per test run for each ``sets`` (:func:`built_once`). A reference that
    tests read, never write: the same run is what several tests compare against."""

    def train(directory: Path, sets: tuple[str, ...]) -> None:
        shutil.copytree(tiny_workspace_template, directory)
        cmd = [sys.executable, "-m", "dflash.cli", "train", *(f"--set={s}" for s in sets)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            cmd, cwd=directory, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]

    def run(*sets: str) -> Path:
        name = "trained-" + hashlib.sha256("\n".join(sets).encode()).hexdigest()[:12]
        return built_once(tmp_path_factory, name, lambda directory: train(directory, sets))

    return run


class Interrupted(Exception):
    """Stands for a kill right after a checkpoint is written."""


@contextmanager
def interrupted_after(monkeypatch, step: int) -> Iterator[None]:
    """An in-process run in the block stops, as if killed, once checkpoint ``step`` is
    written; after the block, runs save checkpoints as before."""
    save = checkpoint.save_checkpoint

    def save_then_die(directory, at, *args, **kwargs):
        save(directory, at, *args, **kwargs)
        if at == step:
            raise Interrupted

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_die)
    with pytest.raises(Interrupted):
        yield
    monkeypatch.setattr(checkpoint, "save_checkpoint", save)


def stopped_and_resumed(
    workspace: Path, copy: Path, sets: list[str], monkeypatch, capsys, step: int = 3
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plan ``workspace`` with ``sets`` and train it uninterrupted; train ``copy`` of it stopped
    after checkpoint ``step`` (:func:`interrupted_after`) and resumed in process, which must say
    it resumed there. Both runs' exported weights, for the caller to compare."""
    run_stages(workspace, ["plan"], sets)
    shutil.copytree(workspace, copy)
    run_stages(workspace, ["train"], sets)
    with interrupted_after(monkeypatch, step):
        run_stages(copy, ["train"], sets)
    capsys.readouterr()
    run_stages(copy, ["train"], sets)
    assert f"(global step {step})" in capsys.readouterr().out.partition("resumed at")[2]
    return final_weights(workspace), final_weights(copy)


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
    """Join the gloo job that :func:`spawn_ranks` started, as rank ``rank``, on one thread; its
    exit skips the teardown's collection, as a ``dflash train`` rank's does."""
    skip_exit_collection()
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
