"""One loader running one pipeline for one epoch, in its own process (the child side of `omnifeed bench`).

    python -m omnifeed.tools._bench_loaders '{"loader": "dataloader", "pipeline": "image", ...}'

Every Python loader runs the same decode code (omnifeed's decoders, which are Pillow, PyAV and
the tokenizer) and the same collate (omnifeed's batch format), with the same number of CPU
workers, so the figures compare the loaders, not the decoders. DALI decodes with its own
libjpeg-turbo pipeline, as its users would run it. Prints one JSON line: samples, seconds to
the first batch, seconds after it, CPU seconds of this process and every child it waited for.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from omnifeed.loader import (
    FIELD_MODALITIES,
    DecodeConfig,
    FeedConfig,
    ImageDecodeConfig,
    IndexConfig,
    PlanConfig,
    PoolConfig,
)
from omnifeed.loader.decode import make_decoder
from omnifeed.loader.feed import Decoded, collate

PIPELINES = ("image", "mixed")
IMAGE_ONLY = frozenset({"omnifeed-draft", "omnifeed-processes", "dali"})


@dataclass(frozen=True)
class RunSpec:
    """What one child runs: a loader, a pipeline, the dataset's forms, workers and batch size."""

    loader: str
    pipeline: str
    workers: int
    batch_size: int
    shards: list[str]  # WebDataset shards
    folder: str  # the same samples as files: {key}.{field}
    index: str  # omnifeed's index of the shards
    work: str  # scratch folder of this run (sockets, converted formats)
    converted: str = ""  # Streaming's MDS or LitData's chunks of the folder, written by `prepare`
    samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def decode_config(pipeline: str, draft: bool = False) -> DecodeConfig:
    """The decode work of ``pipeline``: images to 224×224 (short side, centre crop); other modalities as configured by default."""
    return DecodeConfig(image=ImageDecodeConfig(resize="short_side", size=224, crop="center", draft=draft))


class SampleDecoder:
    """A sample's fields (name -> bytes) decoded by modality into omnifeed's per-sample form, as the feed does."""

    def __init__(self, config: DecodeConfig) -> None:
        self.config = config
        self.modality_of = IndexConfig().modality_of
        self.decoders: dict[str, Callable[[bytes, str], object]] = {}

    def __call__(self, fields: dict[str, bytes], key: str) -> Decoded:
        """Decoded modalities of one sample; unknown fields kept as bytes under ``meta``."""
        out: Decoded = {}
        for name, data in fields.items():
            modality = self.modality_of(name)
            if modality == "meta":
                out.setdefault("meta", {})[name] = data
                continue
            if modality not in self.decoders:
                self.decoders[modality] = make_decoder(modality, self.config)
            out[modality] = self.decoders[modality](data, key)
        return out


def collate_samples(samples: list[tuple[str, Decoded]]) -> dict[str, Any]:
    """omnifeed's batch format for the peers (the same padding work the feed does), as torch tensors as the feed hands it out."""
    from omnifeed.loader.feed import to_torch

    batch: dict[str, Any] = to_torch(collate([s for _, s in samples], [k for k, _ in samples], {}))
    return batch


def folder_samples(folder: str) -> list[tuple[str, dict[str, Path]]]:
    """(key, {field: path}) of every sample under ``folder`` (files named ``key.field``), sorted by key."""
    grouped: dict[str, dict[str, Path]] = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            key, _, name = path.name.partition(".")
            grouped.setdefault(str(path.parent / key), {})[name] = path
    return sorted(grouped.items())


# -- map-style over the folder: DataLoader, StatefulDataLoader -----------------------------
class FolderDataset:
    """Map-style: sample ``i`` of the folder, read and decoded (what a DataLoader user writes)."""

    def __init__(self, folder: str, pipeline: str) -> None:
        self.items = [(Path(key).name, paths) for key, paths in folder_samples(folder)]
        self.decode = SampleDecoder(decode_config(pipeline))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[str, Decoded]:
        key, paths = self.items[i]
        return key, self.decode({name: path.read_bytes() for name, path in paths.items()}, key)


def _dataloader(spec: RunSpec, cls: Any) -> Iterable[dict[str, Any]]:
    import torch

    return cls(
        FolderDataset(spec.folder, spec.pipeline),
        batch_size=spec.batch_size,
        shuffle=True,  # type: ignore[arg-type]
        num_workers=spec.workers,
        collate_fn=collate_samples,
        generator=torch.Generator().manual_seed(0),
        persistent_workers=False,
    )


def run_dataloader(spec: RunSpec) -> Iterable[dict[str, Any]]:
    """torch.utils.data.DataLoader, map-style over the folder, ``num_workers`` processes."""
    import torch.utils.data

    return _dataloader(spec, torch.utils.data.DataLoader)


def run_statefuldataloader(spec: RunSpec) -> Iterable[dict[str, Any]]:
    """torchdata's StatefulDataLoader, the same dataset and arguments."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return _dataloader(spec, StatefulDataLoader)


# -- streaming over the shards: webdataset.WebLoader ---------------------------------------
def run_webloader(spec: RunSpec) -> Iterable[dict[str, Any]]:
    """webdataset.WebLoader over the shards: shard shuffle, a 1,000-sample shuffle buffer, batched in the workers."""
    import webdataset as wds

    decode = SampleDecoder(decode_config(spec.pipeline))

    def decoded(sample: dict[str, Any]) -> tuple[str, Decoded]:
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        return sample["__key__"], decode(fields, sample["__key__"])

    dataset = (
        wds.WebDataset(spec.shards, shardshuffle=len(spec.shards), empty_check=False)
        .shuffle(1000)
        .map(decoded)
        .batched(spec.batch_size, collation_fn=collate_samples, partial=True)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=spec.workers)


# -- converted formats: MosaicML Streaming (MDS), LitData -----------------------------------
def _packed(paths: dict[str, Path]) -> bytes:
    return msgpack.packb({name: path.read_bytes() for name, path in paths.items()}, use_bin_type=True)


def prepare(spec: RunSpec) -> None:
    """Write the folder's samples in the loader's own format (not timed): one msgpack blob of fields per sample."""
    items = folder_samples(spec.folder)
    out = Path(spec.converted)
    if spec.loader == "streaming":
        from streaming import MDSWriter

        with MDSWriter(out=str(out), columns={"key": "str", "fields": "bytes"}, size_limit=1 << 26) as writer:
            for key, paths in items:
                writer.write({"key": Path(key).name, "fields": _packed(paths)})
    elif spec.loader == "litdata":
        import litdata

        litdata.optimize(
            fn=_litdata_sample,
            inputs=[[key, {n: str(p) for n, p in paths.items()}] for key, paths in items],
            output_dir=str(out),
            chunk_bytes="64MB",
            num_workers=1,
            mode="overwrite",
        )


def _litdata_sample(item: list[Any]) -> dict[str, Any]:
    key, paths = item
    return {"key": Path(key).name, "fields": _packed({n: Path(p) for n, p in paths.items()})}


def run_streaming(spec: RunSpec) -> Iterable[dict[str, Any]]:
    """MosaicML StreamingDataset (local MDS shards, shuffle on) under torch's DataLoader, ``num_workers`` processes."""
    import torch.utils.data
    from streaming import StreamingDataset

    base: Any = StreamingDataset
    decode = SampleDecoder(decode_config(spec.pipeline))

    class Decoding(base):
        def __getitem__(self, i: int) -> tuple[str, Decoded]:
            row = super().__getitem__(i)
            return row["key"], decode(msgpack.unpackb(row["fields"]), row["key"])

    dataset = Decoding(local=spec.converted, shuffle=True, shuffle_seed=0, batch_size=spec.batch_size)
    return torch.utils.data.DataLoader(
        dataset, batch_size=spec.batch_size, num_workers=spec.workers, collate_fn=collate_samples
    )


def run_litdata(spec: RunSpec) -> Iterable[dict[str, Any]]:
    """LitData's StreamingDataset and StreamingDataLoader over its optimized chunks, shuffle on."""
    import litdata

    base: Any = litdata.StreamingDataset
    decode = SampleDecoder(decode_config(spec.pipeline))

    class Decoding(base):
        def __getitem__(self, i: Any) -> tuple[str, Decoded]:
            row = super().__getitem__(i)
            return row["key"], decode(msgpack.unpackb(row["fields"]), row["key"])

    dataset = Decoding(spec.converted, shuffle=True, seed=0)
    return litdata.StreamingDataLoader(
        dataset, batch_size=spec.batch_size, num_workers=spec.workers, collate_fn=collate_samples
    )


# -- DALI's CPU pipeline (images) ----------------------------------------------------------
def run_dali(spec: RunSpec) -> Iterable[dict[str, Any]]:
    """DALI on the CPU: file reader (shuffled), libjpeg-turbo decode, resize short side 224, centre crop, CHW."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    files = [str(paths["jpg"]) for _, paths in folder_samples(spec.folder)]

    @pipeline_def(batch_size=spec.batch_size, num_threads=spec.workers, device_id=None, seed=0)
    def images() -> Any:
        jpegs, labels = fn.readers.file(files=files, labels=list(range(len(files))), random_shuffle=True, name="reader")
        decoded = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        resized = fn.resize(decoded, resize_shorter=224, interp_type=types.INTERP_LINEAR)
        return fn.transpose(fn.crop(resized, crop=(224, 224)), perm=[2, 0, 1]), labels

    pipe = images()
    pipe.build()
    return DALIGenericIterator(
        [pipe], ["pixels", "label"], reader_name="reader", last_batch_policy=LastBatchPolicy.PARTIAL
    )


# -- omnifeed ------------------------------------------------------------------------------
def feed_config(spec: RunSpec, draft: bool = False, processes: bool = False) -> FeedConfig:
    """The feed with ``workers`` decode threads in all (one pool for images; shared threads for the mixed set).

    ``processes``: images decode in ``workers`` processes writing into shared memory instead (two
    threads per process hand them the tasks).
    """
    if spec.pipeline == "image":
        image = (
            PoolConfig(workers=2 * spec.workers, processes=spec.workers, buffer_samples=4 * spec.batch_size)
            if processes
            else PoolConfig(workers=spec.workers, buffer_samples=4 * spec.batch_size)
        )
        pools = {"image": image, "text": PoolConfig(workers=0), "meta": PoolConfig(workers=0)}
        shared = 0
    else:
        pools = {m: PoolConfig(workers=0) for m in FIELD_MODALITIES}
        shared = spec.workers
    return FeedConfig(
        plan=PlanConfig(seed=0, batch_size=spec.batch_size),
        decode=decode_config(spec.pipeline, draft),
        pools=pools,
        shared_workers=shared,
    )


def run_omnifeed(spec: RunSpec, draft: bool = False, processes: bool = False) -> Iterable[dict[str, Any]]:
    """omnifeed's trainer client with the feed in this process."""
    from omnifeed.loader.service import ServiceConfig
    from omnifeed.trainer_adapter import FeedClient

    config = ServiceConfig(
        index=spec.index, feed=feed_config(spec, draft, processes), socket=str(Path(spec.work) / "unused.sock")
    )
    return _epoch(FeedClient.in_process(config))


def start_service(spec: RunSpec, work: Path, python: str = sys.executable) -> tuple[subprocess.Popen[bytes], str]:
    """`omnifeed serve` of ``spec``'s index and feed config in a child process, its files in ``work``;
    returns once it answers: the process and its socket."""
    import yaml

    from omnifeed.loader.service import MAX_SOCKET_PATH, wait_until_serving

    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o700)  # the service refuses a socket directory other users can enter
    socket, config = work / "feed.sock", work / "service.yaml"
    if len(os.fsencode(socket)) > MAX_SOCKET_PATH:  # a deep --out: the socket goes to a short private folder
        socket = Path(tempfile.mkdtemp(prefix="omnifeed-bench-")) / "feed.sock"
    config.write_text(
        yaml.safe_dump({"index": spec.index, "socket": str(socket), "feed": feed_config(spec).model_dump(mode="json")}),
        encoding="utf-8",
    )
    service = subprocess.Popen(
        [python, "-m", "omnifeed.tools", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_until_serving(
        str(socket),
        service,
        120.0,
        detail=lambda: service.stderr.read().decode() if service.poll() is not None and service.stderr else "",
    )
    return service, str(socket)


def run_omnifeed_service(spec: RunSpec) -> Iterable[dict[str, Any]]:
    """`omnifeed serve` in a child process and a FeedClient reading from it over shared memory."""
    from omnifeed.trainer_adapter import FeedClient

    service, socket = start_service(spec, Path(spec.work))

    def batches() -> Iterator[dict[str, Any]]:
        try:
            yield from _epoch(FeedClient(socket))
        finally:
            service.terminate()
            service.wait(timeout=60)

    return batches()


def _epoch(client: Any) -> Iterator[dict[str, Any]]:
    with client:
        yield from client


RUNNERS: dict[str, Callable[[RunSpec], Iterable[dict[str, Any]]]] = {
    "omnifeed": run_omnifeed,
    "omnifeed-draft": lambda spec: run_omnifeed(spec, draft=True),
    "omnifeed-processes": lambda spec: run_omnifeed(spec, processes=True),
    "omnifeed-service": run_omnifeed_service,
    "dataloader": run_dataloader,
    "webloader": run_webloader,
    "statefuldataloader": run_statefuldataloader,
    "streaming": run_streaming,
    "litdata": run_litdata,
    "dali": run_dali,
}
REQUIRES = {
    "webloader": "webdataset",
    "statefuldataloader": "torchdata",
    "streaming": "streaming",
    "litdata": "litdata",
    "dali": "nvidia.dali",
}


def batch_size_of(batch: Any) -> int:
    """Samples in a batch of any of the loaders."""
    if isinstance(batch, list):  # DALI: one dict per pipeline
        return int(batch[0]["pixels"].shape[0])
    return len(batch["__key__"])


def _cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _tree_cpu_seconds() -> float:
    """CPU seconds so far of this process and every live descendant (workers, the service and its workers)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def run(spec: RunSpec) -> dict[str, Any]:
    """One epoch of ``spec``: samples, time to the first batch, then the steady part after it (seconds and CPU
    seconds of this process tree, so start-up costs such as imports and worker spawning are apart)."""
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    batches = iter(RUNNERS[spec.loader](spec))
    samples, first_at, first_samples, first_cpu = 0, 0.0, 0, 0.0
    for batch in batches:
        n = batch_size_of(batch)
        if not samples:
            first_at, first_samples, first_cpu = time.perf_counter(), n, _tree_cpu_seconds()
        samples += n
        del batch
    end, end_cpu = time.perf_counter(), _tree_cpu_seconds()
    del batches  # workers joined before the whole run's CPU is counted
    return {
        "samples": samples,
        "first_batch_s": round(first_at - start, 3),
        "steady_s": round(end - first_at, 3),
        "steady_samples": samples - first_samples,
        "steady_cpu_s": round(end_cpu - first_cpu, 3),
        "cpu_s": round(_cpu_seconds() - cpu_start, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Child entry point: ``SPEC_JSON`` (``--prepare`` to write the converted format first)."""
    args = sys.argv[1:] if argv is None else argv
    spec = RunSpec(**json.loads(args[-1]))
    if "--prepare" in args:
        prepare(spec)
        print(json.dumps({"prepared": spec.converted}))
        return 0
    print(json.dumps({**run(spec), "spec": asdict(spec)["loader"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
