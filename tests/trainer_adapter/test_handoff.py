"""The client's hand-off (`_segments.Handoff`) against batch frames the service's own code writes, over a socket pair.

Tensors of a kept segment are built once per layout and handed out again; these tests hold a
batch in every way a trainer can and check that it is never given back (so never overwritten)
while held, that it is given back once dropped, and that nothing keeps a segment mapped after
the client lets go of it.
"""

from __future__ import annotations

import gc
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from omnifeed.loader.service._arena import Segment, SegmentWriter, encode_batch
from omnifeed.loader.service._protocol import encode, send_frame
from omnifeed.trainer_adapter._segments import Handoff

SERVICE = "service-a"


class FakeService:
    """Writes batches into its segments and sends their frames as the service does (a descriptor the first time)."""

    def __init__(self) -> None:
        self.sock, self.client = socket.socketpair()
        self.segments: dict[int, Segment] = {}
        self.sent: set[tuple[int, int]] = set()
        self.seq = 0

    def send(self, slot: int, fill: int, rows: int = 4, extra: dict[str, Any] | None = None, tokens: int = 0) -> int:
        """A batch of ``rows`` images filled with ``fill`` in segment ``slot`` (-1: a one-off); its number. ``tokens``:
        first a text tensor ``[rows, tokens]`` (collated first, as the feed does text)."""
        segment = self.segments.get(slot) if slot >= 0 else None
        if segment is None:
            segment = Segment(slot, 0, 1 << 20)
            if slot >= 0:
                self.segments[slot] = segment
        writer = SegmentWriter(segment)
        text = {"text": {"tokens": writer.alloc((rows, tokens), np.dtype(np.int64))}} if tokens else {}
        pixels = writer.alloc((rows, 3, 8, 8), np.dtype(np.uint8))
        pixels[...] = fill
        index = writer.alloc((rows,), np.dtype(np.int64))
        index[...] = np.arange(rows)
        gain = writer.alloc((rows,), np.dtype(np.float32))
        gain[...] = fill
        batch = {
            "__key__": [f"k{fill}-{i}" for i in range(rows)],
            "__info__": {"step": fill},
            "image": {"pixels": pixels, "index": index},
            "meta": {"gain": gain},
            **text,
            **(extra or {}),
        }
        layout, rest = encode_batch(batch, segment)
        self.seq += 1
        name = (segment.slot, segment.generation)
        fds = [segment.fd] if slot < 0 or name not in self.sent else []
        self.sent.add(name)
        send_frame(
            self.sock,
            encode(
                {"op": "batch", "seq": self.seq, "segment": segment.name, "layout": layout, "batch": rest, "state": {}}
            ),
            fds,
        )
        if slot < 0:
            segment.close()
        return self.seq

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
        self.sock.close()
        self.client.close()


@pytest.fixture()
def service() -> Iterator[FakeService]:
    fake = FakeService()
    yield fake
    fake.close()


def take(handoff: Handoff, service: FakeService, slot: int, fill: int, **options: Any) -> tuple[int, dict[str, Any]]:
    seq = service.send(slot, fill, **options)
    return seq, handoff.receive(service.client, SERVICE)["batch"]


def segment_mappings(slot: int) -> int:
    """Mappings of this process of the service's segment memfd for ``slot``."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return sum(1 for line in maps if f"memfd:omnifeed-batch-{slot} " in line)


def test_a_batch_arrives_with_its_values_keys_and_key_order(service: FakeService) -> None:
    handoff = Handoff()
    _, batch = take(handoff, service, 0, 7)
    assert list(batch) == ["__key__", "__info__", "image", "meta"]
    assert list(batch["image"]) == ["pixels", "index"]
    assert batch["__key__"] == [f"k7-{i}" for i in range(4)]
    assert int(batch["image"]["pixels"].sum()) == 7 * 4 * 3 * 8 * 8
    assert batch["image"]["index"].tolist() == [0, 1, 2, 3] and batch["meta"]["gain"].dtype == torch.float32


def test_the_same_layout_in_the_same_segment_hands_out_the_same_tensors_and_fresh_dicts(service: FakeService) -> None:
    handoff = Handoff()
    seq, first = take(handoff, service, 0, 1)
    pixels, image = first["image"]["pixels"], first["image"]
    del first, image
    assert handoff.released_to(SERVICE) == []  # ``pixels`` is still bound here
    del pixels
    assert handoff.released_to(SERVICE) == [seq]
    _, again = take(handoff, service, 0, 2)
    assert int(again["image"]["pixels"][0, 0, 0, 0]) == 2  # the tensor shows the segment's new batch
    again["image"]["extra"] = 1  # the trainer's own dicts: nothing leaks into the next batch
    del again
    handoff.released_to(SERVICE)
    _, third = take(handoff, service, 0, 3)
    assert "extra" not in third["image"]


def test_a_batch_of_varying_text_length_reuses_the_tensors_of_the_other_fields(service: FakeService) -> None:
    handoff = Handoff()
    seen = []
    for fill, tokens in enumerate([3, 9, 5, 9]):  # padded text of another width each time, in the same segment
        _, batch = take(handoff, service, 0, fill, tokens=tokens)
        assert batch["text"]["tokens"].shape == (4, tokens) and int(batch["image"]["pixels"][0, 0, 0, 0]) == fill
        seen.append((id(batch["image"]["pixels"]), id(batch["meta"]["gain"]), id(batch["text"]["tokens"])))
        del batch
        assert handoff.released_to(SERVICE) == [service.seq]
    assert all(p == seen[0][0] and g == seen[0][1] for p, g, _ in seen), "the arrays after the text did not move"
    assert seen[3][2] == seen[1][2], "a width seen before: its tensor again"


HOLDS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "the batch": lambda b: b,
    "a tensor": lambda b: b["image"]["pixels"],
    "a view": lambda b: b["image"]["pixels"][1:],
    "a dtype view": lambda b: b["image"]["index"].view(torch.uint8),
    "a numpy array": lambda b: b["image"]["pixels"].numpy(),
    "a memoryview": lambda b: memoryview(b["image"]["pixels"].numpy()),
    "its storage": lambda b: b["image"]["pixels"].untyped_storage(),
    "a DLPack capsule": lambda b: torch.utils.dlpack.to_dlpack(b["image"]["index"]),
    "an autograd graph": lambda b: b["meta"]["gain"] * torch.ones(4, requires_grad=True),
    "a list of batches": lambda b: [b],
}


@pytest.mark.parametrize("hold", list(HOLDS))
def test_a_batch_held_in_any_way_is_not_given_back_until_dropped(service: FakeService, hold: str) -> None:
    handoff = Handoff()
    for fill in range(3):  # the layout's tensors are built, then reused
        seq, batch = take(handoff, service, 0, fill)
        held = HOLDS[hold](batch)
        del batch
        for _ in range(3):
            assert seq not in handoff.released_to(SERVICE), hold
        del held
        gc.collect()
        assert handoff.released_to(SERVICE) == [seq], hold


def test_tensors_changed_in_place_or_set_to_require_grad_are_built_afresh(service: FakeService) -> None:
    handoff = Handoff()
    _, batch = take(handoff, service, 0, 1)
    pixels, gain = batch["image"]["pixels"], batch["meta"]["gain"]
    pixels.unsqueeze_(0)
    del batch, pixels
    handoff.released_to(SERVICE)
    _, batch = take(handoff, service, 0, 2)
    assert batch["image"]["pixels"].shape == (4, 3, 8, 8)
    assert batch["meta"]["gain"] is not gain
    gain = batch["meta"]["gain"]
    gain.requires_grad_()
    del batch, gain
    handoff.released_to(SERVICE)
    _, batch = take(handoff, service, 0, 3)
    assert not batch["meta"]["gain"].requires_grad


def test_a_list_of_arrays_in_a_batch_is_held_like_its_layout(service: FakeService) -> None:
    handoff = Handoff()
    seq, batch = take(handoff, service, 0, 5, extra={"boxes": [np.zeros(0, np.float32)]})
    assert batch["boxes"][0].shape == (0,)
    box = batch["boxes"][0]
    del batch
    assert seq not in handoff.released_to(SERVICE)
    del box
    assert handoff.released_to(SERVICE) == [seq]


def test_a_one_off_segment_is_given_back_and_unmapped_when_its_last_tensor_goes(service: FakeService) -> None:
    gc.collect()  # clients of earlier tests
    before = segment_mappings(-1)
    handoff = Handoff()
    seq, batch = take(handoff, service, -1, 9)
    index = batch["image"]["index"]
    del batch
    assert segment_mappings(-1) == before + 1 and seq not in handoff.released_to(SERVICE)
    del index
    assert segment_mappings(-1) == before and handoff.released_to(SERVICE) == [seq]


def test_a_segment_the_client_lets_go_of_stays_mapped_only_while_a_batch_of_it_is_held(service: FakeService) -> None:
    gc.collect()  # clients of earlier tests
    before = segment_mappings(0)
    handoff = Handoff()
    seq, batch = take(handoff, service, 0, 4)
    pixels = batch["image"]["pixels"]
    del batch
    service.segments.pop(0).close()  # the service's side goes: what is left mapped is the client's
    handoff.forget_all()  # a new connection: the stream sends its segments anew
    assert segment_mappings(0) == before + 1 and int(pixels[0, 0, 0, 0]) == 4
    assert seq not in handoff.released_to(SERVICE)
    del pixels
    assert handoff.released_to(SERVICE) == [seq]
    gc.collect()
    assert segment_mappings(0) == before, "the reused tensors kept a dropped batch's memory mapped"
