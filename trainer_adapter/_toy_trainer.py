"""A toy training loop over `FeedClient`: the demo's trainer ranks, and a template for real ones.

``python -m omnifeed.trainer_adapter._toy_trainer --address SOCKET --rank R --world-size W``
trains a two-parameter model on each batch's image brightness for one epoch, checkpointing
model and data state together (``--checkpoint``) every ``--save-every`` steps, resuming from
the checkpoint when it exists, and prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ._client import FeedClient


def _features(batch: dict[str, Any]) -> torch.Tensor:
    """One number per sample: mean image brightness (0 without an image) and text length."""
    n = len(batch["__key__"])
    x = torch.zeros(n, 2)
    if "image" in batch:
        x[batch["image"]["index"], 0] = batch["image"]["pixels"].float().mean(dim=(1, 2, 3)) / 255
    if "text" in batch:
        x[batch["text"]["index"], 1] = batch["text"]["lengths"].float() / 1000
    return x


def _save(path: Path, model: torch.nn.Module, client: FeedClient, step: int) -> None:
    """Model and data state in one file, written atomically (a crash never leaves half a checkpoint)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "data": client.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Train one epoch; print a JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--save-every", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = samples = 0
    cpu = 0.0
    loss = torch.zeros(())
    with FeedClient(args.address, rank=args.rank, world_size=args.world_size) as client:
        if args.checkpoint is not None and args.checkpoint.exists():
            saved = torch.load(args.checkpoint, weights_only=True)
            model.load_state_dict(saved["model"])
            client.load_state_dict(saved["data"])
            steps = saved["step"]
        started = time.perf_counter()
        batches = iter(client)
        while True:
            before = time.thread_time()
            batch = next(batches, None)
            cpu += time.thread_time() - before
            if batch is None:
                break
            x = _features(batch)
            loss = ((model(x).squeeze(1) - x[:, 0]) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            samples += len(batch["__key__"])
            del batch
            if args.checkpoint is not None and steps % args.save_every == 0:
                _save(args.checkpoint, model, client, steps)
        elapsed = time.perf_counter() - started
        summary = {"rank": args.rank, "steps": steps, "samples": samples, "loss": round(float(loss), 5),
                   "seconds": round(elapsed, 3), "waited_s": round(client.waited_s, 3),
                   "client_cpu_ms_per_batch": round(cpu / max(steps, 1) * 1e3, 3), "reconnects": client.reconnects}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
