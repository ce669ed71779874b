"""Train a small image classifier on a Hugging Face-style Parquet dataset through omnifeed.

A template for a real training script: a plain PyTorch loop over `FeedClient`, labels from the
batch's meta values, augmentation from the feed config, and a checkpoint that holds the model,
the optimizer and the data position together, so a killed run resumes with exactly the batches
(augmentation included) it would have seen. Commands: examples/README.md.

    omnifeed index data/train.parquet --out index
    python examples/train_classifier.py --index index --config feed.yaml --checkpoint run.pt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnifeed.loader import FeedConfig
from omnifeed.loader.service import ServiceConfig
from omnifeed.trainer_adapter import FeedClient

# Used without --config. Augmentation lives in the feed, not in this loop: its randomness is a
# pure function of (plan seed, epoch, sample key), so a resumed run crops exactly as the
# uninterrupted one would have, and every epoch crops anew. A fixed-size crop also means the
# batch's images all have one size (no padding).
DEFAULT_FEED = {
    "plan": {"seed": 0, "batch_size": 32},
    "transforms": {
        "image": [{"random_resized_crop": {"size": 32, "scale": [0.5, 1.0]}}, {"horizontal_flip": {"p": 0.5}}]
    },
}


def tiny_cnn(num_classes: int) -> nn.Module:
    """Three conv blocks and a linear head; global pooling makes it work at any image size."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 16),
        nn.MaxPool2d(2),
        *block(16, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )


def open_client(args: argparse.Namespace) -> FeedClient:
    """A client of the service at --socket, or a feed in this process over --index and --config."""
    if args.socket is not None:  # the service owns the index and the feed config (`omnifeed serve`)
        return FeedClient(args.socket or None)
    feed = FeedConfig.from_yaml(args.config) if args.config else FeedConfig.model_validate(DEFAULT_FEED)
    return FeedClient.in_process(ServiceConfig(index=str(args.index), feed=feed))


def inputs_and_labels(batch: dict[str, Any], label_field: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's images as floats and their labels, row for row."""
    images = batch["image"]  # rows only for the samples that have an image; "index" says whose (their slot)
    labels = batch["meta"][label_field]  # an int64 tensor [n] when every sample of the batch has a label
    if not isinstance(labels, torch.Tensor):
        # a list means some sample lacks the label (None) or has a non-integer one: no fill value is guessed
        raise SystemExit(
            f"batch {batch['__key__']} has labels {labels!r}: every sample needs an integer {label_field!r}"
        )
    y = labels[images["index"]]
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise SystemExit(f"labels {y.tolist()} are outside 0..{num_classes - 1}: pass --num-classes")
    # uint8 [m, 3, H, W], padded bottom/right to the batch's largest image (none with a fixed-size crop)
    x = images["pixels"].float().div_(255).sub_(0.5).div_(0.25)
    return x, y


def save_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, client: FeedClient, step: int
) -> None:
    """Model, optimizer, data position and step in one file, written atomically.

    Written to a temporary file, flushed to disk, then renamed over the old one: a crash at any
    moment leaves either the previous checkpoint or the new one, never half of one. The data
    state (`client.state_dict()`, a few hundred bytes of JSON) is the position after the last
    batch this loop took, so it belongs to the same step as the model.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "data": client.state_dict(),
                "step": step,
            },
            f,
        )
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def train(args: argparse.Namespace) -> None:
    """Train until --max-steps steps or --epochs epochs are done (counted over every run, resumes included)."""
    torch.manual_seed(args.seed)  # model initialisation only; the data order and crops come from the feed's seed
    model = tiny_cnn(args.num_classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = 0
    log = open(args.log_batches, "a", buffering=1, encoding="utf-8") if args.log_batches else None
    with open_client(args) as client:
        if args.checkpoint is not None and args.checkpoint.exists():
            saved = torch.load(args.checkpoint, weights_only=True)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            client.load_state_dict(saved["data"])  # the next batch is the one after the checkpoint's step
            step = saved["step"]
            print(f"resumed from {args.checkpoint} at step {step}, epoch {client.epoch}", flush=True)
        model.train()
        # next_batch() crosses epoch boundaries; client.epoch is the epoch of the next batch
        while step < args.max_steps and client.epoch < args.epochs:
            batch = client.next_batch()
            x, y = inputs_and_labels(batch, args.label_field, args.num_classes)
            loss = nn.functional.cross_entropy(model(x), y)
            if not math.isfinite(loss.item()):  # stop before the step spoils the weights (and the next checkpoint)
                raise SystemExit(f"loss is {loss.item()} at step {step + 1}, batch {batch['__key__']}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if log is not None:  # what the batch was, to compare runs: keys and the augmented pixels' digest
                pixels = hashlib.sha256(batch["image"]["pixels"].numpy().tobytes()).hexdigest()
                log.write(
                    json.dumps(
                        {
                            "step": step,
                            "epoch": batch["__info__"]["epoch"],
                            "keys": batch["__key__"],
                            "labels": y.tolist(),
                            "label_dtype": str(y.dtype),
                            "pixels": pixels,
                            "shape": list(batch["image"]["pixels"].shape),
                            "loss": loss.item(),
                        }
                    )
                    + "\n"
                )
            if step % args.print_every == 0:
                print(f"step {step} epoch {batch['__info__']['epoch']} loss {loss.item():.4f}", flush=True)
            del batch  # through a service, the batch's shared memory goes back when its tensors are dropped
            if args.checkpoint is not None and step % args.save_every == 0:
                save_checkpoint(args.checkpoint, model, optimizer, client, step)
        if args.checkpoint is not None:
            save_checkpoint(args.checkpoint, model, optimizer, client, step)
        print(f"done at step {step}, next epoch {client.epoch}", flush=True)
    if log is not None:
        log.close()


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--index", type=Path, help="index directory (`omnifeed index DATA --out INDEX`): feed in-process"
    )
    source.add_argument(
        "--socket",
        nargs="?",
        const="",
        metavar="PATH",
        help="read from a running `omnifeed serve` (it has the index and feed config); "
        "no PATH: the service's default socket",
    )
    parser.add_argument("--config", type=Path, help="feed YAML (plan, decode, transforms, pools) for --index")
    parser.add_argument("--label-field", default="label", help="meta field holding the class (default: label)")
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=10, help="train until this many epochs are done")
    parser.add_argument("--max-steps", type=int, default=10**12, help="train until this many steps are done")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="model initialisation")
    parser.add_argument("--checkpoint", type=Path, help="resume from this file if it exists; write it as training goes")
    parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (and one at the end)")
    parser.add_argument("--print-every", type=int, default=10)
    parser.add_argument(
        "--log-batches", type=Path, help="append one JSON line per step: keys, labels, pixel digest, loss"
    )
    args = parser.parse_args(argv)
    if args.config is not None and args.socket is not None:
        parser.error("--config is the in-process feed's; a service has its own (omnifeed serve --config)")
    return args


if __name__ == "__main__":
    train(arguments())
