"""A mixture of real indexes through the feed, the drop-in and `omnifeed serve`: keys by source, filters counted,
each source's samples exactly as planned across a resize, the same batches in-process and through the service."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from feed_service import ServiceProcess, short_socket_dir

from omnifeed.loader import DataLoader, Feed, FeedConfig, IndexConfig, build_index
from omnifeed.loader.plan import read_delivery_logs, verify_mixture
from omnifeed.loader.service import ServiceConfig
from omnifeed.trainer_adapter import FeedClient

MIXTURE = {
    "sources": {
        "tars": {"index": "tar-index", "weight": 0.7},
        "table": {"index": "parquet-index", "weight": 0.3, "where": {"text_tokens": [1, 30]}},
    }
}
PHASED = {
    **MIXTURE,
    "phases": [{"until_samples": 40, "weights": {"tars": 0.2, "table": 0.8}}, {"weights": {"tars": 0.9, "table": 0.1}}],
}


@pytest.fixture(scope="module")
def folder(index_dir: Path, demo_parquet: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding two indexes of the demo data (its tar shards, its Parquet file), named as a config names
    them."""
    out = tmp_path_factory.mktemp("mixture")
    (out / "tar-index").symlink_to(index_dir)
    build_index([str(demo_parquet)], out / "parquet-index", IndexConfig(workers=1), progress=False)
    return out


def feed_config(folder: Path, mixture: dict, name: str = "feed.yaml") -> FeedConfig:
    """A feed config read from YAML in ``folder``: the sources' paths are relative to it."""
    path = folder / name
    path.write_text(yaml.safe_dump({"plan": {"seed": 4, "batch_size": 4, "mixture": mixture}}))
    return FeedConfig.from_yaml(path)


def test_a_mixture_epoch_delivers_each_source_as_planned_with_keys_by_source_and_the_filter_counted(
    folder: Path, tmp_path: Path
) -> None:
    config = feed_config(folder, MIXTURE)
    with Feed(None, config, audit_log=tmp_path / "audit.jsonl") as feed:
        keys = [key for _ in range(len(feed)) for key in feed.next_batch()["__key__"]]
        index, plan = feed.index, feed.plan
    assert {k.split("/")[0] for k in keys} == {"tars", "table"}
    report = verify_mixture(index, plan, 0, read_delivery_logs([tmp_path / "audit.jsonl"]))
    assert report.ok, report
    table = report.sources["table"]
    assert table.removed_by_filter > 0 and table.planned == sum(k.startswith("table/") for k in keys)
    assert abs(report.sources["tars"].share - 0.7) < 0.03  # 48 + kept samples: shares to within one sample


def test_a_phased_mixture_resized_from_two_ranks_to_three_mid_epoch_delivers_each_source_as_planned(
    folder: Path, tmp_path: Path
) -> None:
    config, logs = feed_config(folder, PHASED), []
    feeds = [Feed(None, config, world_size=2, rank=r, audit_log=tmp_path / f"a{r}.jsonl") for r in range(2)]
    logs += [tmp_path / f"a{r}.jsonl" for r in range(2)]
    for _ in range(3):
        for feed in feeds:
            feed.next_batch()
    state = feeds[0].state_dict()
    index, plan = feeds[0].index, feeds[0].plan
    for feed in feeds:
        feed.close()
    grown = [Feed(index, config, world_size=3, rank=r, audit_log=tmp_path / f"b{r}.jsonl") for r in range(3)]
    logs += [tmp_path / f"b{r}.jsonl" for r in range(3)]
    for feed in grown:
        feed.load_state_dict(state)
    while not all(feed.epoch > 0 for feed in grown):
        for feed in grown:
            feed.next_batch()
    for feed in grown:
        feed.close()
    report = verify_mixture(index, plan, 0, read_delivery_logs(logs))
    assert report.ok, report
    assert plan.mixture is not None
    first = plan.mixture.sources(0, 0, 40).tolist()
    assert first.count(index.names.index("table")) == 32  # the first phase: 80 % from the table


def test_the_drop_in_reads_a_mixture_given_no_dataset(folder: Path) -> None:
    config = feed_config(folder, MIXTURE)
    loader = DataLoader(None, feed_config=config)
    with Feed(None, config) as feed:
        expected = [b["__key__"] for b in feed]  # one epoch
    got = [b["__key__"] for b in loader]
    assert got == expected and len(got) == len(loader)
    assert {k.split("/")[0] for b in got for k in b} == {"tars", "table"}


def test_the_service_serves_a_mixture_named_in_its_config_as_the_in_process_feed_does(folder: Path) -> None:
    socket = short_socket_dir() / "feed.sock"
    path = folder / "service.yaml"
    path.write_text(
        yaml.safe_dump({"socket": str(socket), "feed": {"plan": {"seed": 4, "batch_size": 4, "mixture": MIXTURE}}})
    )
    service = ServiceProcess(path, socket).start()
    try:
        with FeedClient(str(socket)) as client, Feed(None, feed_config(folder, MIXTURE)) as feed:
            got = [client.next_batch()["__key__"] for _ in range(6)]
            expected = [feed.next_batch()["__key__"] for _ in range(6)]
    finally:
        assert service.stop() == 0, service.output()
    assert got == expected


def test_new_weights_for_a_checkpointed_feed_are_refused_unless_allowed_then_no_source_repeats_or_skips(
    folder: Path,
) -> None:
    from omnifeed.loader import StateMismatchError

    old, new = (
        feed_config(folder, MIXTURE, "old.yaml"),
        feed_config(folder, {**PHASED, "phases": [PHASED["phases"][1]]}),
    )
    with Feed(None, old) as feed:
        keys = [k for _ in range(5) for k in feed.next_batch()["__key__"]]
        state, index = feed.state_dict(), feed.index
    with Feed(index, new) as changed:
        with pytest.raises(StateMismatchError, match="allow_mixture_change"):
            changed.load_state_dict(state)
        changed.load_state_dict(state, allow_mixture_change=True)
        while changed.epoch == 0:
            keys += changed.next_batch()["__key__"]
        plan = changed.plan
    assert plan.mixture is not None and plan.mixture.change_at is not None
    positions = index.positions_of(keys)
    source, _ = index.locate(positions)
    for s, size in enumerate(index.sizes.tolist()):  # each source: the first of its own order, none skipped, none twice
        mine = positions[source == s]
        k = np.arange(mine.size)
        expected = index.offsets[s] + plan.mixture.schedule._samples(np.full(mine.size, s), k)  # noqa: SLF001
        assert sorted(mine.tolist()) == sorted(expected.tolist())


def test_through_the_service_new_weights_for_a_checkpoint_are_refused_unless_the_client_allows_them(
    folder: Path,
) -> None:
    from omnifeed.loader.service import ServiceError

    changed_mixture = {**PHASED, "phases": [PHASED["phases"][1]]}

    def serve(mixture: dict, name: str) -> tuple[ServiceProcess, Path]:
        socket = short_socket_dir() / "feed.sock"
        path = folder / name
        path.write_text(
            yaml.safe_dump({"socket": str(socket), "feed": {"plan": {"seed": 4, "batch_size": 4, "mixture": mixture}}})
        )
        return ServiceProcess(path, socket).start(), socket

    service, socket = serve(MIXTURE, "old-service.yaml")
    try:
        with FeedClient(str(socket)) as client:
            keys = [k for _ in range(5) for k in client.next_batch()["__key__"]]
            state = client.state_dict()
    finally:
        assert service.stop() == 0, service.output()
    service, socket = serve(changed_mixture, "new-service.yaml")
    try:
        with FeedClient(str(socket)) as client:
            with pytest.raises(ServiceError, match="allow_mixture_change"):
                client.load_state_dict(state)
                client.next_batch()
        with FeedClient(str(socket)) as client:
            client.load_state_dict(state, allow_mixture_change=True)
            while len(keys) < 88:  # the rest of mixture epoch 0 (48 + 40 samples)
                keys += client.next_batch()["__key__"]
    finally:
        assert service.stop() == 0, service.output()
    with Feed(None, feed_config(folder, changed_mixture, "changed.yaml")) as feed:
        index, plan = feed.index, feed.plan
    positions = index.positions_of(keys)
    source, _ = index.locate(positions)
    for s in range(len(index.names)):  # each source: the first of its own order, none skipped, none twice
        mine = positions[source == s]
        expected = index.offsets[s] + plan.mixture.schedule._samples(np.full(mine.size, s), np.arange(mine.size))  # noqa: SLF001
        assert sorted(mine.tolist()) == sorted(expected.tolist())


def test_a_budgeted_mixture_written_ahead_feeds_in_process_and_through_the_service_what_live_planning_does(
    folder: Path,
) -> None:
    """`plan.mixture.plans` (relative to the config file) holds the mixture's epochs written ahead: the feed deals
    from them (nothing planned), the service finds them from its own config, both the batches of planning live."""
    from omnifeed.loader import Plan
    from omnifeed.loader.plan import open_mixture, planned_epochs, write_planned_epochs

    budget = {"budget": 3e4, "overlong": "alone"}
    (folder / "live.yaml").write_text(yaml.safe_dump({"plan": {"seed": 4, "bucketing": budget, "mixture": MIXTURE}}))
    live_config = FeedConfig.from_yaml(folder / "live.yaml")
    written = {"seed": 4, "bucketing": budget, "mixture": {**MIXTURE, "plans": "written-plans"}}
    (folder / "written.yaml").write_text(yaml.safe_dump({"plan": written}))
    config = FeedConfig.from_yaml(folder / "written.yaml")
    assert config.plan.mixture is not None and config.plan.mixture.plans == str(folder / "written-plans")
    plan = Plan.from_index(open_mixture(config.plan.mixture), config.plan)
    write_planned_epochs(plan, None, range(3))
    with Feed(None, live_config, world_size=2, rank=1) as live:
        expected = [b["__key__"] for b in live]
    with Feed(None, config, world_size=2, rank=1) as feed:
        assert planned_epochs(feed.plan) is not None
        assert [b["__key__"] for b in feed] == expected and feed.plan.work == 0
    socket = short_socket_dir() / "feed.sock"
    path = folder / "written-service.yaml"
    path.write_text(yaml.safe_dump({"socket": str(socket), "feed": {"plan": written}}))
    service = ServiceProcess(path, socket).start()
    try:
        with FeedClient(str(socket), world_size=2, rank=1) as client:
            got = [client.next_batch()["__key__"] for _ in range(len(expected))]
    finally:
        assert service.stop() == 0, service.output()
    assert got == expected and "serving the mixture of table, tars" in service.output()  # as YAML sorted them
    served = ServiceConfig.from_yaml(path).feed.plan.mixture
    assert served is not None and served.plans == str(folder / "written-plans")
