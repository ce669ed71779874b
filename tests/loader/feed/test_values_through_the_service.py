"""Through a real `omnifeed serve`: the same augmented pixels and meta values as the in-process feed, and the same
batches after a client resumes from a saved state (a user transform imported in the service's own process)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from feed_service import ServiceProcess, short_socket_dir, write_config
from labelled_data import index_of, write_labelled_tar

from omnifeed.loader import Feed, FeedConfig
from omnifeed.trainer_adapter import FeedClient

FEED: dict[str, Any] = {
    "plan": {"seed": 11, "batch_size": 4},
    "transforms": {
        "image": [
            {"random_resized_crop": {"size": 16, "scale": [0.2, 1.0]}},
            {"horizontal_flip": {"p": 0.5}},
            {"user": {"function": "service_augment:darken", "kwargs": {"by": 3}}},
        ]
    },
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, Path]]:
    folder = tmp_path_factory.mktemp("served-values")
    index = index_of([write_labelled_tar(folder / "a.tar", missing_label=3)], folder / "index")
    code = folder / "code"
    code.mkdir()
    (code / "service_augment.py").write_text(
        "import numpy as np\n"
        "def darken(value, key, epoch, rng, by=1):\n"
        "    return (value // by + rng.integers(0, 2)).astype(np.uint8)\n"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(code))  # the service imports the user's module in its own process
        patch.syspath_prepend(str(code))  # and so does the in-process reference feed
        socket = short_socket_dir() / "feed.sock"
        service = ServiceProcess(write_config(folder, index.path, socket=socket, feed=FEED), socket).start()
        try:
            yield service, index.path
        finally:
            assert service.stop() == 0, service.output()


def same(a: dict, b: dict) -> bool:
    """Equal keys, pixels and meta values (tensors compared by value)."""
    if a["__key__"] != b["__key__"] or not torch.equal(a["image"]["pixels"], b["image"]["pixels"]):
        return False
    for name, value in a["meta"].items():
        other = b["meta"][name]
        if isinstance(value, torch.Tensor) != isinstance(other, torch.Tensor):
            return False
        if (
            isinstance(value, torch.Tensor)
            and not torch.equal(value, other)
            or not isinstance(value, torch.Tensor)
            and value != other
        ):
            return False
    return a["meta"].keys() == b["meta"].keys()


def test_the_service_hands_out_the_in_process_feeds_values(served: tuple[ServiceProcess, Path]) -> None:
    service, index = served
    with Feed(index, FeedConfig(**FEED)) as feed, FeedClient(str(service.socket)) as client:
        expected = [b for _ in range(2) for b in feed]  # two epochs: two different crops
        got = [client.next_batch() for _ in range(len(expected))]
    assert all(same(a, b) for a, b in zip(got, expected))
    labels = [b["meta"]["cls"] for b in got]
    assert any(isinstance(v, torch.Tensor) and v.dtype == torch.int64 for v in labels)
    assert any(isinstance(v, list) and None in v for v in labels), "sample-03 has no label"
    assert all(isinstance(j, dict) for b in got for j in b["meta"]["json"])


def test_a_client_resumed_from_a_saved_state_gets_the_same_augmented_batches(
    served: tuple[ServiceProcess, Path],
) -> None:
    service, _ = served
    with FeedClient(str(service.socket), rank=0, world_size=1) as straight:
        reference = [straight.next_batch() for _ in range(6)]
    with FeedClient(str(service.socket), rank=0, world_size=1) as first:
        for _ in range(2):
            first.next_batch()
        state = first.state_dict()
    with FeedClient(str(service.socket), rank=0, world_size=1) as resumed:
        resumed.load_state_dict(state)
        assert all(same(resumed.next_batch(), expected) for expected in reference[2:])
