"""A toy training loop over `FeedClient`: the demo's trainer ranks, the torchrun test's job, a template for real ones.

``python -m omnifeed.trainer_adapter --address SOCKET --rank R --world-size W``, or under
``torchrun ... -m omnifeed.trainer_adapter --torchrun --address SOCKET`` (gloo, DDP).
Trains a tiny model on each batch's image brightness and text length until the epoch in
progress is delivered (``--epochs N``: N epochs; ``--stop-file``: no further epoch once that file
exists; or ``--max-steps``), checkpointing model and data state together
(``--checkpoint``, every ``--save-every`` steps, by rank 0: at a step boundary every rank's
data state is the same; also at the end with ``--max-steps`` or ``--save-at-end``) and resuming
— at whatever world size it now runs: loading the data state performs the resize, and the hints
it returns scale the learning rate. Prints one JSON summary line per rank.

The checkpoint rule, the one a real job needs: every rank of a run loads the *same* settled
checkpoint before its first step. Under torchrun that is the checkpoint file as it is at start
(the ranks then move in lock-step: DDP's all-reduce is the barrier, so rank 0's next save comes
after every rank has loaded). Ranks started without a barrier between them (the demo's) give each
run its own files: ``--resume-from`` the previous run's committed checkpoint (``--fresh`` for the
first run), ``--checkpoint`` this run's, so a fast rank 0 saving can never change what a slower
peer of the same run loads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from ._client import FeedClient
from ._hints import scale_learning_rate


def _features(batch: dict[str, Any]) -> torch.Tensor:
    """Two numbers per sample: mean image brightness (0 without an image) and text length."""
    n = len(batch["__key__"])
    x = torch.zeros(n, 2)
    if "image" in batch:
        x[batch["image"]["index"], 0] = batch["image"]["pixels"].float().mean(dim=(1, 2, 3)) / 255
    if "text" in batch:
        x[batch["text"]["index"], 1] = batch["text"]["lengths"].float() / 1000
    return x


def _save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, client: FeedClient, step: int) -> None:
    """Model, optimizer and data state in one file, written atomically (a crash never leaves half a checkpoint)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "data": client.state_dict(), "step": step},
        tmp,
    )
    os.replace(tmp, path)


def _stop_requested(path: Path | None, distributed: bool) -> bool:
    """Whether ``path`` exists; under torchrun rank 0's answer, broadcast, so that every rank stops at the same step."""
    if path is None:
        return False
    flag = torch.tensor([float(path.exists())])
    if distributed:
        import torch.distributed as dist

        dist.broadcast(flag, src=0)
    return bool(flag.item())


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--torchrun", action="store_true", help="ranks from torchrun's environment; DDP over gloo")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="where rank 0 saves (atomically); also what a run resumes "
        "from when it exists and --resume-from is not given",
    )
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume-from",
        type=Path,
        help="the checkpoint every rank loads at start (must exist): the previous run's, settled",
    )
    resume.add_argument(
        "--fresh",
        action="store_true",
        help="start at step 0 even when --checkpoint exists (the first run of ranks that share no barrier)",
    )
    parser.add_argument(
        "--start-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long before connecting (a rank that starts late; fault injection)",
    )
    parser.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long after each step (a slow rank; fault injection)",
    )
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--max-steps", type=int, help="stop (and checkpoint) after this many steps in this run")
    parser.add_argument(
        "--save-at-end",
        action="store_true",
        help="checkpoint when the run ends, also when the epoch ended it (the next run starts the next epoch)",
    )
    parser.add_argument(
        "--epochs", type=int, default=1, help="epochs to train in this run (the first is the one in progress)"
    )
    parser.add_argument(
        "--stop-file",
        type=Path,
        help="start no further epoch once this file exists (with --torchrun rank 0 decides for all ranks)",
    )
    parser.add_argument("--kill-at-step", type=int, help="SIGKILL this process at that step (fault injection)")
    parser.add_argument("--kill-rank", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train until the epoch in progress is delivered (or ``--epochs``, ``--stop-file``, ``--max-steps``); print a JSON
    summary."""
    args = _arguments(argv)
    resume = None if args.fresh else args.resume_from if args.resume_from is not None else args.checkpoint
    if args.resume_from is not None and not args.resume_from.is_file():
        raise SystemExit(
            f"toy trainer: --resume-from {args.resume_from}: no such checkpoint; give the previous run's "
            "checkpoint, or --fresh to start at step 0"
        )
    if args.start_delay > 0:
        time.sleep(args.start_delay)
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.torchrun:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        client = FeedClient.from_torchrun_env(args.address)
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        client = FeedClient(args.address, rank=args.rank, world_size=args.world_size)
    steps = samples = run_steps = epochs = 0
    cpu = 0.0
    loss = torch.zeros(())
    hints = None
    with client:
        if resume is not None and resume.exists():
            saved = torch.load(resume, weights_only=True)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            steps = saved["step"]
            hints = client.load_state_dict(saved["data"])  # a new world size: the resize, and what it means
            if hints is not None:
                scale_learning_rate(optimizer, hints.lr_scale)
        started = time.perf_counter()
        batches = iter(client)
        while args.max_steps is None or run_steps < args.max_steps:
            if args.kill_at_step == steps and client.rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            before = time.thread_time()
            batch = next(batches, None)
            cpu += time.thread_time() - before
            if batch is None:  # the epoch is delivered
                epochs += 1
                if epochs >= args.epochs or _stop_requested(args.stop_file, args.torchrun):
                    break
                batches = iter(client)
                continue
            if not batch["__key__"]:
                raise RuntimeError(f"rank {client.rank} got an empty batch at step {steps}")
            x = _features(batch)
            loss = ((model(x).squeeze(1) - x[:, 0]) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps, run_steps = steps + 1, run_steps + 1
            samples += len(batch["__key__"])
            del batch
            if args.step_delay > 0:
                time.sleep(args.step_delay)
            if args.checkpoint is not None and client.rank == 0 and steps % args.save_every == 0:
                _save(args.checkpoint, model, optimizer, client, steps)
        ended = args.max_steps is not None or args.save_at_end
        if args.checkpoint is not None and client.rank == 0 and ended:
            _save(args.checkpoint, model, optimizer, client, steps)
        summary = {
            "rank": client.rank,
            "world_size": client.world_size,
            "steps": steps,
            "run_steps": run_steps,
            "samples": samples,
            "loss": round(float(loss), 5),
            "seconds": round(time.perf_counter() - started, 3),
            "waited_s": round(client.waited_s, 3),
            "client_cpu_ms_per_batch": round(cpu / max(run_steps, 1) * 1e3, 3),
            "reconnects": client.reconnects,
            "hints": hints.to_json() if hints is not None else None,
            "epochs": epochs,
            "next_epoch": client.epoch,
        }
    print(json.dumps(summary), flush=True)
    if args.torchrun:
        import torch.distributed as dist

        # DDP's reducer holds the process group. Dropped at exit, the reducer would destroy the group holding the
        # interpreter lock while it joins gloo's threads, one of which may be waiting for that lock to release a
        # Python object: a hang seen in CI. Dropped first, the group goes in destroy_process_group, lock released.
        del model, optimizer, loss
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
