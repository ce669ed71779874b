"""`omnifeed chaos`: a bounded fault-injection soak of the service, its decode workers, the trainers and storage.

::

    demo dataset ─▶ RangeServer (HTTP, 503s, latency spikes) ─▶ index over http:// URLs
    omnifeed serve (audit log; audio decoded in worker processes) ◀── toy trainer ranks (DDP, checkpoints)
    every few seconds, at random: kill -9 the service | a decode worker | a trainer rank; a resize; a spike
    after --minutes: no more faults; the job finishes the epoch in progress; the service stops (SIGTERM)
    then: verify_coverage per epoch over the audit log, /dev/shm and orphan processes, resource figures

What the run is and what happened is `_chaos_config`; what fires when is `_chaos_schedule`; the
processes are `_chaos_procs`; the checks and the summary `_chaos_report`; the faulty origin
`_chaos_storage`. docs/chaos.md says how to read the summary. Exit status 0 only if every check passed.
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import psutil
import yaml

from omnifeed.loader import IndexConfig, SampleIndex, build_index, read_delivery_logs
from omnifeed.loader.service import request_metrics

from ._chaos_config import ChaosConfig, Tally, config_json
from ._chaos_procs import Job, Service, marked_processes, reap_orphans
from ._chaos_report import Resources, Verdict, render, service_storage, verify_audit
from ._chaos_schedule import KINDS, AuditWatch, Schedule
from ._chaos_storage import RangeServer
from ._demo_data import DemoDatasetSpec, write_webdataset
from ._output_dir import prepare_output_dir

_STALL_S = 180.0  # no delivery for this long while a job runs: a hang
_MAX_UNEXPECTED = 5  # unexpected failures (a rank or the service dying on its own) before the soak gives up
_EXTENSION_S = 120.0  # at most this long past --minutes waiting for a kind that could not fire yet
_SPIKE_REQUESTS = 10  # a spike lasts until it slowed this many requests, however long it was drawn
_WORKER_AGE_S = 2.0  # a decode worker is killed only once it has run this long


class Soak:
    """One chaos run: storage, index, service, jobs, faults, then the checks."""

    def __init__(self, config: ChaosConfig, stream: TextIO) -> None:
        self.config, self.stream, self.out = config, stream, config.out
        self.token = secrets.token_hex(8)
        self.schedule = Schedule(config.seed, config.interval_s, config.world_sizes)
        self.tally = Tally()
        self.resources = Resources()
        self.audit = AuditWatch(config.out / "audit.jsonl")
        self.checkpoint, self.stop_file = config.out / "checkpoint.pt", config.out / "stop"
        self.server: RangeServer | None = None
        self.service: Service | None = None
        self.job: Job | None = None
        self._job_mark = 0  # the job's first audit record
        self._socket_dir = Path(tempfile.mkdtemp(prefix="of-chaos-", dir="/tmp"))  # socket paths must stay short
        self._metrics: dict[int, dict[str, Any]] = {}  # the last snapshot of each service start
        self._started = time.monotonic()

    def say(self, line: str) -> None:
        """One line of the run's log."""
        print(line, file=self.stream, flush=True)

    def event(self, line: str) -> None:
        """A timestamped line of the run's log."""
        self.say(f"[{time.monotonic() - self._started:6.1f} s] {line}")

    # -- setup -----------------------------------------------------------------------------
    def prepare(self) -> tuple[SampleIndex, Path]:
        """Dataset, HTTP origin (faults off while indexing), index over http:// URLs, service config."""
        config = self.config
        started = time.monotonic()
        data = self.out / "data"
        spec = DemoDatasetSpec(num_samples=config.samples, num_shards=config.shards, seed=config.seed)
        shards = write_webdataset(data, spec)
        self.server = RangeServer(data, seed=config.seed).start()
        sources = f"{self.server.url}/shard-{{0000..{len(shards) - 1:04d}}}.tar"
        report = build_index([sources], self.out / "index", IndexConfig(partitions=4, workers=1), progress=False)
        if report.errors:
            raise RuntimeError(f"indexing {sources} failed: {report.errors[0]}")
        self.server.delay_s, self.server.fail_fraction = config.latency_s, config.fail_fraction
        service_config = {
            "index": str(report.path),
            "socket": str(self._socket_dir / "feed.sock"),
            "audit_log": str(self.audit.path),
            "prefetch_batches": 2,
            "stream_idle_s": 5.0,
            "feed": {
                "plan": {"seed": config.seed, "batch_size": config.batch_size},
                "pools": {"audio": {"workers": 2, "processes": 1, "buffer_samples": 64}},
                "cache": {
                    "remote": {
                        "timeout_s": 5.0,
                        "retries": 5,
                        "backoff_s": 0.02,
                        "latency_window": 32,
                        "degraded_latency_s": config.latency_s * config.spike_factor / 2,
                    }
                },
            },
        }
        path = self.out / "service.yaml"
        path.write_text(yaml.safe_dump(service_config), encoding="utf-8")
        self.say(
            f"dataset: {config.samples} samples in {len(shards)} shards at {sources}; index {report.path} "
            f"({time.monotonic() - started:.0f} s)"
        )
        self.say(
            f"storage: {config.fail_fraction:.0%} of requests answered 503, {config.latency_s * 1e3:.0f} ms per "
            f"request, spikes x{config.spike_factor:g}"
        )
        return SampleIndex(report.path), path

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> Verdict:
        """Run the soak; the verdict of its checks."""
        shm_before = _shm_segments()
        index, service_config = self.prepare()
        self.service = Service(service_config, self._socket_dir / "feed.sock", self.out / "service.log", self.token)
        self._started = time.monotonic()
        self.service.launch()
        self._start_job(self.schedule.world_size())  # its ranks start up while the service does; they retry
        self.service.wait_ready()
        self.say(f"service: pid {self.service.pid}, audit log {self.audit.path}")
        injecting_until = self._started + self.config.minutes * 60
        next_fault = self._started + self.schedule.interval()
        last_sample = stopping = 0.0
        while True:
            now = time.monotonic()
            if now - last_sample >= 1.0:
                self._sample()
                last_sample = now
            for epoch in self.audit.poll():
                self.event(f"epoch {epoch} begins")
            if (
                not stopping
                and now >= injecting_until
                and (not set(KINDS) - set(self.tally.injected) or now >= injecting_until + _EXTENSION_S)
            ):
                stopping = now
                self.stop_file.touch()
                self.event("no more faults: the job finishes the epoch in progress")
            if self._supervise(stopping > 0):
                break
            if not stopping and now >= next_fault:
                kind = self.schedule.kind()
                if self._fire(kind):
                    self.tally.injected[kind] = self.tally.injected.get(kind, 0) + 1
                    next_fault = now + self.schedule.interval()
                else:  # cannot fire now (no worker alive, the job starting): another kind first
                    self.schedule.defer(kind)
                    next_fault = now + 0.3
            if now - self.audit.changed > _STALL_S:
                self._unexpected(f"no delivery for {_STALL_S:.0f} s: the job or the service hangs (see {self.out})")
                break
            if len(self.tally.unexpected) >= _MAX_UNEXPECTED:
                break
            time.sleep(0.1)
        return self._finish(index, shm_before, time.monotonic() - self._started)

    def _supervise(self, stopping: bool) -> bool:
        """Restart what died on its own (counted as unexpected); True once the job finished as asked."""
        assert self.job is not None and self.service is not None
        if not self.service.alive():
            code = self.service.process.returncode if self.service.process is not None else None
            self._unexpected(f"the service exited on its own ({code}); see {self.service.log}")
            self.service.start()
        status = self.job.status()
        if status == "finished":
            if stopping:
                return True
            self._unexpected(f"job {self.job.number} ended before it was asked to")
            self._start_job(self.job.world_size)
        elif status == "failed":
            self._unexpected("; ".join(self.job.failures()) or f"job {self.job.number} failed")
            self.job.stop()
            self._start_job(self.job.world_size)
        return False

    def _start_job(self, world_size: int) -> None:
        assert self.service is not None
        self.audit.poll()
        self._job_mark = self.audit.records
        self.job = Job(
            self.tally.jobs,
            world_size,
            self.service.socket,
            self.checkpoint,
            self.out / "jobs",
            self.token,
            self.config.save_every,
            self.stop_file,
        )
        self.tally.jobs += 1

    def _job_active(self) -> bool:
        """Whether the job runs and has had a batch delivered since it started (it is past its start-up)."""
        self.audit.poll()
        return self.job is not None and self.job.status() == "running" and self.audit.records > self._job_mark

    def _unexpected(self, what: str) -> None:
        self.tally.unexpected.append(what)
        self.event(f"UNEXPECTED: {what}")

    def _fire(self, kind: str) -> bool:
        """Inject one fault while the job runs; False when it cannot be injected now."""
        assert self.service is not None and self.job is not None and self.server is not None
        if kind in ("service_kill", "worker_kill"):  # also while a job restarts, once batches have flowed
            if not self.audit.records:
                return False
        elif not self._job_active():
            return False
        if kind == "service_kill":
            self._sample()
            self.service.kill()
            time.sleep(self.schedule.uniform(0.0, 1.5))
            self.service.start()
            self.event(f"service killed (kill -9); restarted as pid {self.service.pid}")
        elif kind == "worker_kill":
            workers = [w for w in self.service.decode_workers() if _age(w) >= _WORKER_AGE_S]
            if not workers:  # none yet, or only one just started (a second kill of the same call is no single fault)
                return False
            victim = workers[self.schedule.pick(len(workers))]
            victim.kill()
            self.event(f"decode worker process {victim.pid} of the service killed (kill -9)")
        elif kind in ("trainer_kill", "resize"):
            return self._stop_job(kind)
        else:
            seconds = self.schedule.uniform(*self.config.spike_s)
            self.server.spike(seconds, self.config.spike_factor, at_least=_SPIKE_REQUESTS)
            self.event(
                f"storage latency x{self.config.spike_factor:g} for {seconds:.1f} s (and {_SPIKE_REQUESTS} requests)"
            )
        return True

    def _stop_job(self, kind: str) -> bool:
        """Kill a rank (then stop the others) or stop every rank for a resize, and restart from the checkpoint."""
        job = self.job
        assert job is not None
        if kind == "trainer_kill":
            rank = self.schedule.pick(job.world_size)
            job.kill_rank(rank)
            size = job.world_size
            what = f"trainer rank {rank} of {size} killed (kill -9); the job restarts from its checkpoint"
        else:
            size = self.schedule.world_size(other_than=job.world_size)
            self.tally.resizes.append(f"{job.world_size}->{size}")
            what = f"resize {job.world_size} -> {size}: every rank stopped, the job restarts from its checkpoint"
        job.stop()
        self.event(what)
        self._start_job(size)
        return True

    def _sample(self) -> None:
        """Resource figures of the service, and its metrics (kept per service start)."""
        assert self.service is not None
        if not self.service.alive():
            return
        row = self.service.resources()
        if row is not None:
            self.resources.add(self.service.starts, max(self.audit.epoch, 0), row)
        try:
            self._metrics[self.service.starts] = request_metrics(str(self.service.socket), timeout=2.0)
        except (OSError, EOFError, ValueError):
            pass

    # -- the end ---------------------------------------------------------------------------
    def _finish(self, index: SampleIndex, shm_before: set[str], seconds: float) -> Verdict:
        assert self.service is not None and self.server is not None
        self._sample()
        finished = self.job is not None and self.job.status() == "finished"
        if self.job is not None and not finished:
            self.job.stop()
        code = self.service.stop()
        if code != 0:
            self._unexpected(f"the service exited {code} on SIGTERM at the end")
        server = self.server
        self.tally.storage = {
            "requests": server.requests,
            "errors_503": server.failures,
            "slowed": server.slowed,
            "spikes": server.spikes,
            **service_storage(self._metrics.values()),
        }
        server.stop()
        orphans = reap_orphans(self.token)
        shm = sorted(_shm_segments() - shm_before)
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        summaries = self.job.summaries() if self.job is not None and finished else []
        self.tally.epochs = max((int(s["next_epoch"]) for s in summaries), default=0)
        audit = verify_audit(index, list(read_delivery_logs([self.audit.path])), self.tally.epochs)
        verdict = Verdict(
            config=config_json(self.config),
            seconds=seconds,
            tally=asdict(self.tally),
            audit=audit,
            resources=self.resources.summary(),
            shm_leaked=shm,
            orphans=orphans,
        )
        (self.out / "summary.json").write_text(json.dumps(verdict.to_json(), indent=1) + "\n", encoding="utf-8")
        return verdict

    def cleanup(self) -> None:
        """After an error or an interrupt: stop whatever still runs (idempotent)."""
        if self.job is not None:
            self.job.stop()
        if self.service is not None and self.service.alive():
            self.service.kill()
        if self.server is not None:
            self.server.stop()
        for process in marked_processes(self.token):
            try:
                process.kill()
            except Exception:  # noqa: BLE001  gone meanwhile
                pass
        shutil.rmtree(self._socket_dir, ignore_errors=True)


def _age(process: psutil.Process) -> float:
    try:
        return time.time() - process.create_time()
    except psutil.Error:
        return 0.0


def _shm_segments() -> set[str]:
    root = Path("/dev/shm")
    return {p.name for p in root.iterdir() if p.name.startswith("omnifeed")} if root.is_dir() else set()


def run_chaos(config: ChaosConfig, stream: TextIO | None = None) -> int:
    """Run the soak in ``config.out`` (omnifeed's own earlier output replaced, another non-empty folder refused); print
    its summary; 0 only if every check passed."""
    out = stream or sys.stdout
    prepare_output_dir(config.out, "chaos")
    soak = Soak(config, out)
    try:
        verdict = soak.run()
    except BaseException:
        soak.cleanup()
        raise
    print(render(verdict), file=out, flush=True)
    return 0 if verdict.ok else 1
