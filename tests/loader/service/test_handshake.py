"""The handshake alone: a hello becomes a typed `Hello` or a refusal of the right kind, checked in order, before
anything is planned; a length request is bounded the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omnifeed.loader import FeedConfig, PlanConfig
from omnifeed.loader.index import SampleIndex
from omnifeed.loader.plan import Plan
from omnifeed.loader.service import PROTOCOL, ServiceConfig
from omnifeed.loader.service._handshake import Handshake, epoch_micro_batches
from omnifeed.loader.service._protocol import RequestError

PLAN = PlanConfig(seed=3, batch_size=4)  # the demo index: 48 samples, 12 micro-batches an epoch


@pytest.fixture(scope="module")
def handshake(index_dir: Path) -> Handshake:
    plan = Plan.from_index(SampleIndex(index_dir), PLAN)
    return Handshake(plan, ServiceConfig(index=str(index_dir), feed=FeedConfig(plan=PLAN), max_clients=8))


def hello(**fields: Any) -> dict[str, Any]:
    return {
        "op": "hello",
        "protocol": PROTOCOL,
        "rank": 0,
        "world_size": 1,
        "dp_rank": 0,
        "dp_world_size": 1,
        "grad_accum": 1,
        "state": None,
        **fields,
    }


def test_a_hello_becomes_a_typed_hello(handshake: Handshake) -> None:
    checked = handshake.hello(hello(rank=5, world_size=8, dp_rank=1, dp_world_size=2, grad_accum=3), "connection-1")
    assert (checked.key, checked.group, checked.rank) == ((2, 1, 3), 4, 5)
    assert checked.token == "connection-1" and checked.resume == "start" and checked.attempt is None
    assert checked.position.key == (0, 0) and checked.position.to_dict()["format"] == "omnifeed.feed-state/1"
    kept = handshake.hello(
        hello(
            token="me",
            resume="digest",
            attempt="digest-1",
            state=checked.position.to_dict(),
            world_size=2,
            dp_world_size=2,
            dp_rank=1,
        ),
        "connection-2",
    )
    assert (kept.token, kept.resume, kept.attempt) == ("me", "digest", "digest-1")


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"protocol": 99}, "protocol", "protocol version 99"),
        ({"index_fingerprint": "f" * 32}, "fingerprint", "index_fingerprint"),
        ({"rank": "0"}, "protocol", "'rank' must be an integer"),
        ({"rank": True}, "protocol", "'rank'"),
        ({"dp_rank": 1}, "protocol", "'dp_rank'"),
        ({"world_size": 3, "dp_world_size": 2}, "topology", "not a multiple"),
        ({"world_size": 16}, "topology", "max_clients"),
        ({"dp_world_size": 4, "world_size": 4, "grad_accum": 4}, "topology", "an epoch of"),
        ({"state": {"format": "omnifeed.feed-state/1", "plan": {"step": 1}, "accum_done": 0}}, "state", "not usable"),
        ({"token": ""}, "protocol", "'token'"),
        ({"resume": 7}, "protocol", "'resume'"),
        ({"attempt": "x" * 65}, "protocol", "'attempt'"),
    ],
)
def test_a_bad_hello_is_refused_with_its_kind(
    handshake: Handshake, fields: dict[str, Any], code: str, words: str
) -> None:
    with pytest.raises(RequestError) as refused:
        handshake.hello(hello(**fields), "connection-1")
    assert refused.value.code == code and words in str(refused.value)


def test_the_first_failed_check_is_the_one_reported(handshake: Handshake) -> None:
    with pytest.raises(RequestError) as refused:  # a wrong protocol and a bad rank: the protocol is checked first
        handshake.hello(hello(protocol=0, rank=-1, token=""), "connection-1")
    assert refused.value.code == "protocol" and "protocol version 0" in str(refused.value)


def test_a_length_request_counts_an_epochs_micro_batches_within_the_bounds(handshake: Handshake) -> None:
    assert epoch_micro_batches(handshake.plan)[0] == 12 == handshake.max_step
    assert handshake.length({"op": "length", "state": None, "dp_world_size": 2, "grad_accum": 2}) == 6
    with pytest.raises(RequestError) as refused:
        handshake.length({"op": "length", "state": None, "dp_world_size": 13, "grad_accum": 1})
    assert refused.value.code == "topology"
