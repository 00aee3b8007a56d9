"""Two CPU processes (torchrun, gloo) train what one process trains at the same global batch, write one
record and one W&B run, and evaluate exactly; gradient accumulation is the same global batch too."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from conftest import ROOT, compose_cfg, quick_cfg
from process_workers import process_group_states

from normexp.data.samplers import ShardedSampler
from normexp.run import run
from normexp.tracking.records import read_metrics, read_summary

# LN model, no augmentation randomness (digits have none; no mixup, no drop path), 20+ steps, an odd-sized
# validation set (359 images) that 2 processes cannot split evenly. SGD: the all-reduce sums gradients in
# another order, and Adam's m / sqrt(v) turns those float32 rounding differences in near-zero gradients into
# whole steps of the learning rate (AdamW: 1.7e-4 apart in the weights after 22 steps), SGD keeps them tiny.
COMMON = ["trainer.opt=momentum", "trainer.lr=0.05", "trainer.epochs=1", "trainer.warmup_epochs=0",
          "trainer.log_interval=1", "trainer.progress=false", "trainer.smoothing=0",
          "data.val_fraction=0.1996", "trainer.device=cpu"]


def cli(*args: str, nproc: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                "--master_port=29517", "-m", "normexp"] if nproc > 1 else [sys.executable, "-m", "normexp"]
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*launcher, *args], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


def step_losses(run_dir) -> list[float]:
    return [r["train/loss"] for r in read_metrics(run_dir) if "val/top1" not in r and "train/loss" in r]


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains(tmp_path):
    single = cli(*COMMON, "logger=none", "data.batch_size=64",
                 env={"NORMEXP_OUTPUT_DIR": str(tmp_path / "a")})
    assert single.returncode == 0, single.stderr[-3000:]
    double = cli(*COMMON, "logger=wandb", "data.batch_size=32", nproc=2,
                 env={"NORMEXP_OUTPUT_DIR": str(tmp_path / "b")})
    assert double.returncode == 0, double.stderr[-3000:]
    one, two = (next((tmp_path / x).glob("classification/*/summary.json")).parent for x in "ab")

    a, b = read_summary(one), read_summary(two)
    assert (a["global_batch"], a["world_size"]) == (64, 1) and (b["global_batch"], b["world_size"]) == (64, 2)
    losses_a, losses_b = step_losses(one), step_losses(two)
    assert len(losses_a) == len(losses_b) >= 20
    assert max(abs(x - y) for x, y in zip(losses_a, losses_b, strict=True)) < 1e-5
    weights_a = torch.load(one / "checkpoint.pth", weights_only=True)["model"]
    weights_b = torch.load(two / "checkpoint.pth", weights_only=True)["model"]
    assert max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a) < 1e-5
    assert a["metrics"]["final"]["val/top1"] == b["metrics"]["final"]["val/top1"]  # exact: 359 images
    assert a["metrics"]["final"]["val/loss"] == pytest.approx(b["metrics"]["final"]["val/loss"], abs=1e-5)
    # one record, one W&B run: process 1 writes nothing
    assert sorted(p.parent for p in tmp_path.glob("**/summary.json")) == sorted([one, two])
    assert len(list((two / "wandb").glob("offline-run-*"))) == 1
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["classification"]


def test_a_run_leaves_the_process_group_it_joined(tmp_path):
    # left at the block's end and on the endings it names; one joined before (by the entry point, under
    # torchrun) is kept for the runs that follow, and left by whoever joined it
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:  # three free ports, one per group
        for sock in (a, b, c):
            sock.bind(("127.0.0.1", 0))
        ports = [sock.getsockname()[1] for sock in (a, b, c)]
    result = str(tmp_path / "states.npy")
    mp.start_processes(process_group_states, args=(2, ports, result), nprocs=2, start_method="spawn")
    assert np.load(result).tolist() == [True, False, False, True]


def test_sampler_deals_the_same_global_batches_to_any_number_of_processes():
    def global_batches(world: int, per_process: int, **kw) -> list[list[int]]:
        shards = [list(ShardedSampler(100, shuffle=True, seed=3, rank=r, world_size=world,
                                      batch_size=per_process, drop_last=True, **kw)) for r in range(world)]
        steps = len(shards[0]) // per_process
        return [sorted(i for s in shards for i in s[k * per_process:(k + 1) * per_process])
                for k in range(steps)]

    assert global_batches(1, 12) == global_batches(2, 6) == global_batches(4, 3)
    # evaluation: every sample exactly once, no padding
    shards = [list(ShardedSampler(7, shuffle=False, seed=0, rank=r, world_size=3)) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(7))
    # repeated augmentation: each image 3 times in a row, the epoch as long as without repeats
    order = ShardedSampler(512, shuffle=True, seed=0, repeats=3).epoch_order()
    assert len(order) == 512 and (order[:510].view(-1, 3) == order[:510].view(-1, 3)[:, :1]).all()


def test_accumulation_is_the_same_global_batch(tmp_path):
    base = ["logger=none", "data.img_size=8", "trainer.epochs=1", "trainer.warmup_epochs=0",
            "trainer.log_interval=1", "trainer.smoothing=0", "trainer.progress=false"]
    run(compose_cfg(*base, "data.batch_size=64"), tmp_path / "b64")
    run(compose_cfg(*base, "data.batch_size=32", "trainer.accum_steps=2"), tmp_path / "b32x2")
    summary = read_summary(tmp_path / "b32x2")
    assert (summary["global_batch"], summary["accum_steps"]) == (64, 2)
    losses_a, losses_b = step_losses(tmp_path / "b64"), step_losses(tmp_path / "b32x2")
    assert len(losses_a) == len(losses_b) == 22
    assert max(abs(x - y) for x, y in zip(losses_a, losses_b, strict=True)) < 1e-5


def test_global_batch_sets_the_accumulation(tmp_path):
    run(quick_cfg("data.batch_size=32", "trainer.global_batch=128", epochs=1), tmp_path / "run")
    summary = read_summary(tmp_path / "run")
    assert (summary["global_batch"], summary["accum_steps"]) == (128, 4)
