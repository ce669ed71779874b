"""`omnifeed demo`: the main job on the built-in dataset, as a readable report.

Generates a small multimodal WebDataset (images, text, H.264 video, FLAC audio),
indexes it, reads a sample back by its index location, then deals the plan to
4 ranks, saves the state, resumes at 3 ranks, grows to 6, proves from the
delivery log that epoch 0 reached every sample exactly once, pre-caches the dataset into
the NVMe tier, and finally serves it: `omnifeed serve` and two toy trainer ranks as client
processes, batches over shared memory, the service's audit log verified exactly-once.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import yaml

from omnifeed.cache import NvmeTierConfig
from omnifeed.loader import (
    IndexConfig,
    Plan,
    PlanConfig,
    PlanCursor,
    SampleIndex,
    build_index,
    delivery_records,
    read_delivery_logs,
    read_field,
    verify_coverage,
)
from omnifeed.loader.service import request_metrics, wait_until_serving

from ._demo_data import DemoDatasetSpec, write_webdataset
from ._demo_mixture import mixture_step
from ._index_summary import length_table
from ._output_dir import prepare_output_dir
from ._precache import PrecacheJob
from ._precache_run import precache_local

RankArgs = Callable[[int, int], list[str]]
"""Extra toy-trainer arguments for (phase, rank): how a test skews the ranks (``--start-delay``, ``--step-delay``)."""

_PHASES = ((4, 3), (3, 4), (6, None))  # (world size, steps; None = until epoch 0 is delivered)
_SERVED_PHASES = ((2, 3), (1, 3), (3, None))


def run_demo(out: Path, *, samples: int = 240, stream: TextIO | None = None, rank_args: RankArgs | None = None) -> int:
    """Run the demo in ``out`` (omnifeed's own earlier output there is replaced; any other non-empty folder is
    refused); returns the exit status (0 when verified exactly-once). ``rank_args``: extra toy-trainer arguments per
    (phase, rank) of the served part (how a test skews the ranks)."""
    say = _Reporter(stream)
    prepare_output_dir(out, "demo")
    data = out / "data"
    say.title("1. Built-in dataset")
    spec = DemoDatasetSpec(num_samples=samples, num_shards=max(1, min(6, samples // 8)))
    shards = write_webdataset(data, spec)
    total = sum(p.stat().st_size for p in shards)
    say(f"{len(shards)} WebDataset shards, {samples} samples, {total / 1e6:.1f} MB in {data}")

    say.title("2. Index")
    urls = f"{data}/shard-{{0000..{len(shards) - 1:04d}}}.tar"
    report = build_index([urls], out / "index", IndexConfig(partitions=4), progress=False)
    index = SampleIndex(report.path)
    say(f"omnifeed index {urls} --out {report.path}")
    say(f"{report.num_samples} samples, fingerprint {report.fingerprint}")
    for line in length_table(index.manifest):
        say(line)

    say.title("3. Random access by index location (one ranged read per field)")
    for modality in ("image", "video", "audio"):
        position = next(
            (p for p in range(index.num_samples) if any(f.modality == modality for f in index.sample(p).fields)), None
        )
        if position is None:
            continue
        sample = index.sample(position)
        field = next(f for f in sample.fields if f.modality == modality)
        data = read_field(sample.shard, field, row_group=sample.row_group, row=sample.row)
        say(
            f"{sample.key}.{field.name:<5} {len(data):>7} bytes at offset {field.offset:>8} of "
            f"{Path(sample.shard.url).name}  {_describe(sample.lengths, modality)}"
        )

    say.title("4. Plan: 4 ranks -> save state -> resume at 3 ranks -> grow to 6")
    plan = Plan.from_index(index, PlanConfig(seed=0, batch_size=4))
    say(f"seed 0, batch size 4: {-(-index.num_samples // 4)} micro-batches per epoch")
    log_path = out / "delivery.jsonl"
    state: dict[str, Any] | None = None
    with log_path.open("w", encoding="utf-8") as log:
        for world_size, steps in _PHASES:
            cursor = PlanCursor(plan, world_size=world_size)
            if state is not None:
                cursor.load_state_dict(state)
            dealt = 0
            while (dealt < steps) if steps is not None else not cursor.epoch_delivered(0):
                step = cursor.next_step()
                for record in delivery_records(step, index):
                    log.write(json.dumps(record) + "\n")
                    if dealt == 0 and record["rank"] < 2:
                        say(f"  step {record['step']} rank {record['rank']}: {', '.join(record['keys'])}")
                dealt += 1
            state = cursor.state_dict()
            encoded = json.dumps(state)
            say(
                f"world size {world_size}: steps {cursor.step - dealt}..{cursor.step - 1}, "
                f"topology v{cursor.topology_version}; state {len(encoded)} bytes -> next epoch "
                f"{state['epoch']} micro-batch {state['micro_batch']}"
            )
    say(f"delivery log: {log_path}")

    say.title("5. Verify")
    coverage = verify_coverage(index, 0, read_delivery_logs([log_path]))
    say(f"omnifeed verify {report.path} {log_path} --epoch 0")
    say(json.dumps(coverage.to_json()))
    say(
        "\n"
        + (
            "OK: every sample of epoch 0 delivered exactly once across 4 -> 3 -> 6 ranks."
            if coverage.ok
            else "FAILED: the plan did not deliver epoch 0 exactly once."
        )
    )
    if not coverage.ok:
        return 1

    say.title("6. Mixture: the tars and a filtered Parquet copy, 80/20 then 30/70; 2 ranks -> 3")
    if not mixture_step(say, out, spec, report.path):
        return 1

    say.title("7. Pre-cache: fill the node's NVMe tier (LMDB) from the index")
    nvme = NvmeTierConfig(path=str(out / "cache"), capacity_bytes=1 << 30)
    job = PrecacheJob(index=str(report.path), nvme=nvme)
    precached = precache_local(job, list(range(len(index.manifest["partitions"]))), workers=1, progress=False)
    say(f"omnifeed precache {report.path} --cache {out / 'cache'}")
    say(json.dumps(precached.summary()))

    say.title("8. Serve: one service for the node; trainer ranks 2 -> 1 -> 3 over shared memory, from checkpoints")
    return _serve_phases(say, out, report.path, index, nvme, rank_args)


_RANK_TIMEOUT_S = 600.0  # a phase's ranks must all finish within this, else the demo fails naming the rank


def _train(
    say: Callable[[str], None],
    address: str,
    out: Path,
    phase: int,
    world_size: int,
    steps: int | None,
    rank_args: RankArgs | None = None,
) -> bool:
    """Toy trainer ranks of one phase as client processes; False (with the reason said) if one failed or hung.

    Each phase resumes from the previous phase's checkpoint and commits its own, a file per phase: the ranks
    share no barrier, so a rank 0 that finishes first and saves must not change what a later peer loads.
    """
    limit = ["--max-steps", str(steps), "--checkpoint", str(_checkpoint(out, phase))] if steps else []
    limit += ["--save-every", str(1 << 30)]  # one save, when the phase ends (rank 0)
    limit += ["--resume-from", str(_checkpoint(out, phase - 1))] if phase > 0 else ["--fresh"]
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omnifeed.trainer_adapter",
                "--address",
                address,
                "--rank",
                str(rank),
                "--world-size",
                str(world_size),
                *limit,
                *(rank_args(phase, rank) if rank_args else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + _RANK_TIMEOUT_S
    ok = True
    try:
        for rank, process in enumerate(ranks):
            try:
                stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(
                    f"FAILED: trainer rank {rank} of {world_size} did not finish within {_RANK_TIMEOUT_S:g} s "
                    f"(phase {phase + 1}); see the service log {out / 'service.log'}"
                )
                return False
            if process.returncode != 0:
                say(f"FAILED: trainer rank {rank} exited {process.returncode}: {stderr.strip()[-500:]}")
                ok = False
                continue
            summary = json.loads(stdout.strip().splitlines()[-1])
            hints = summary["hints"]
            if hints and rank == 0:
                say(
                    f"  resize {hints['previous_world_size']} -> {hints['world_size']} ranks (topology "
                    f"v{hints['topology_version']}): global batch {hints['global_batch_samples']} samples; keep the "
                    f"old one with grad_accum {hints['keep_global_batch_grad_accum']}; {hints['lr_rule']} LR scale "
                    f"{hints['lr_scale']:.3g} (applied)"
                )
            say(
                f"  rank {rank}: {summary['run_steps']} steps, {summary['samples']} samples, loss {summary['loss']}, "
                f"waited {summary['waited_s']:.2f} s, {summary['client_cpu_ms_per_batch']:.3f} ms CPU per batch in "
                "the trainer"
            )
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    if ok and steps and not _checkpoint(out, phase).is_file():
        say(f"FAILED: phase {phase + 1} committed no checkpoint ({_checkpoint(out, phase)})")
        return False
    return ok


def _checkpoint(out: Path, phase: int) -> Path:
    """The checkpoint phase ``phase`` commits (and phase ``phase + 1`` resumes from)."""
    return out / f"checkpoint-phase{phase + 1}.pt"


def _serve_phases(
    say: Callable[[str], None],
    out: Path,
    index_path: Path,
    index: SampleIndex,
    nvme: NvmeTierConfig,
    rank_args: RankArgs | None = None,
) -> int:
    """`omnifeed serve` in a process, toy trainer ranks 2 -> 1 -> 3 as client processes, the audit log verified;
    0 when it verifies exactly once."""
    socket_dir = Path(tempfile.mkdtemp(prefix="omnifeed-demo-"))  # socket paths must stay short
    audit = out / "audit.jsonl"
    config_path = out / "service.yaml"
    address = str(socket_dir / "feed.sock")
    # paths in a config file are relative to the file's folder: the demo writes them that way, as a user would
    config = {
        "index": _relative(index_path, out),
        "socket": address,
        "audit_log": audit.name,
        "metrics_port": 0,
        "feed": {
            "plan": {"seed": 0, "batch_size": 8},
            "cache": {"nvme": nvme.model_dump() | {"path": _relative(Path(nvme.path), out)}},
        },
    }
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    say(f"omnifeed serve --config {config_path}")
    service_log = out / "service.log"
    with service_log.open("w", encoding="utf-8") as log:
        service = subprocess.Popen(
            [sys.executable, "-m", "omnifeed.tools", "serve", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        try:
            wait_until_serving(address, service, timeout=120.0, detail=lambda: _last_lines(service_log))
        except (RuntimeError, TimeoutError) as exc:
            say(f"FAILED: {exc}")
            return 1
        say(
            "  "
            + next(
                (line for line in service_log.read_text(encoding="utf-8").splitlines() if "serving" in line),
                _last_lines(service_log, 1),
            )
        )
        for phase, (world_size, steps) in enumerate(_SERVED_PHASES):
            say(
                f"trainer ranks 0..{world_size - 1} of {world_size}"
                + (f" from {_checkpoint(out, phase - 1).name}" if phase else "")
                + (
                    f", {steps} steps each, then {_checkpoint(out, phase).name}"
                    if steps
                    else ", until epoch 0 is delivered"
                )
            )
            if not _train(say, address, out, phase, world_size, steps, rank_args):
                return 1
        snapshot = request_metrics(address)
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=60)  # `omnifeed serve` exits within 30 s of a SIGTERM, its cleanup done or not
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)
    tiers = snapshot["cache"]
    say(
        f"service: {snapshot['resizes']} resizes; {snapshot['handed_over']} prefetched micro-batches handed over to "
        f"new ranks instead of decoded again; fields from the NVMe tier: {tiers['nvme']['hits']}, from the source "
        f"files: {tiers['remote']['reads']}"
    )
    say(
        "decoded counts exceed the dataset's samples: the service reads ahead into epoch 1 while the last ranks "
        "finish, and batches prefetched for a departing topology are decoded again when they cannot be handed over"
    )
    say(f"{'modality':<8}{'decoded':>9}{'p50 ms':>9}{'p90 ms':>9}{'bad':>5}")
    for modality, m in snapshot["modalities"].items():
        latency = m["decode_latency_s"]
        say(
            f"{modality:<8}{m['decoded']:>9}{latency['p50'] * 1e3:>9.2f}{latency['p90'] * 1e3:>9.2f}"
            f"{sum(m['bad'].values()):>5}"
        )
    coverage = verify_coverage(index, 0, read_delivery_logs([audit]))
    say(f"omnifeed verify {index_path} {audit} --epoch 0")
    say(json.dumps(coverage.to_json()))
    say(
        "\n"
        + (
            "OK: the service delivered epoch 0 exactly once across 2 -> 1 -> 3 trainer ranks."
            if coverage.ok
            else "FAILED: the service's audit log does not cover epoch 0 exactly once."
        )
    )
    return 0 if coverage.ok else 1


def _relative(path: Path, folder: Path) -> str:
    """``path`` relative to ``folder`` when it lies inside it (as written into a config file there)."""
    try:
        return str(path.resolve().relative_to(folder.resolve()))
    except ValueError:
        return str(path.resolve())


def _last_lines(log: Path, count: int = 15) -> str:
    """The service log's last lines (what a user needs when the service died)."""
    lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines() if log.is_file() else []
    if count == 1:
        return lines[-1] if lines else ""
    return f"its last log lines ({log}):\n" + "\n".join(lines[-count:]) if lines else f"it logged nothing ({log})"


def _describe(lengths: Any, modality: str) -> str:
    if modality == "image":
        return f"{lengths.image_width}x{lengths.image_height} px"
    if modality == "video":
        return (
            f"{lengths.video_frames} frames at {lengths.video_fps:g} fps, {lengths.video_width}x{lengths.video_height}"
        )
    return f"{lengths.audio_seconds:.2f} s at {lengths.audio_sample_rate} Hz"


class _Reporter:
    """Writes the demo's report to a stream (stdout by default)."""

    def __init__(self, stream: TextIO | None) -> None:
        import sys

        self.stream = stream or sys.stdout

    def __call__(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def title(self, text: str) -> None:
        self(f"\n== {text}")
