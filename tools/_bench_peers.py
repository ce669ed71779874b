"""The peer loaders of `omnifeed bench`, each as its users would run it over the same samples: DataLoader and
StatefulDataLoader (map-style over the folder), WebLoader (the shards), MosaicML Streaming and LitData (their
own formats, written by `prepare`), DALI's CPU pipeline (images). The Python ones decode and collate with
`_bench_spec`'s code."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack

from omnifeed.loader.feed import Decoded

from ._bench_spec import RunSpec, SampleDecoder, collate_samples, decode_config, folder_samples


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
