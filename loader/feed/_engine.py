"""`DecodeEngine`: the decoding engine a `Feed` or a `FeedService` runs on, built in one place.

::

    DecodeEngine.build(index, FeedConfig, decoders=, on_error=, with_pools=)
        config   the feed config with the index's tokenizer (`with_index_tokenizer`): the decode config, once
        metrics  FeedMetrics
        reader   FieldReader: cache tiers and I/O threads; the decoders — a built-in per modality from
                 ``config.decode``, the user's over them — where each modality decodes is its one executor
                 choice (pools.<m>.executor: threads, processes, or the Ray actors of pools.<m>.remote)
        pools    DecodePools: worker threads per modality, shared ones, one per remote slot; None: each
                 pipeline makes its own (a `Feed` on its own engine)
    engine.shared(plan, handover, dealt) ─▶ SharedResources: what feeds on this engine share (the service's streams)
    engine.snapshot(buffers) ─▶ the engine's part of a metrics snapshot · engine.close(): pools, then reader

A `Feed` given no ``shared`` builds its own engine (without pools: each pipeline it runs makes
its own, from its first batch to a resize or close); a `FeedService` builds one, with pools, for
all its streams.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..decode import follow_index_tokenizer
from ..index import MixtureIndex, SampleIndex
from ..plan import Plan, open_mixture
from ._config import FeedConfig
from ._dealing import DealtSteps
from ._metrics import FeedMetrics
from ._pipeline import FieldReader, Handover
from ._pools import DecodePools


def open_feed_index(index: SampleIndex | MixtureIndex | str | Path | None, config: FeedConfig | None) -> SampleIndex:
    """The index a feed reads: ``index`` opened, or with none given the mixture ``config.plan.mixture`` names.

    Raises ValueError for no index and no mixture. (A `MixtureIndex` answers all a feed asks of a
    `SampleIndex`; it is typed as one here.)
    """
    if index is None:
        if config is None or config.plan.mixture is None:
            raise ValueError("give the feed an index (a SampleIndex or its directory), or a config with plan.mixture")
        return open_mixture(config.plan.mixture)  # type: ignore[return-value]
    if isinstance(index, (SampleIndex, MixtureIndex)):
        return index  # type: ignore[return-value]
    return SampleIndex(index)


def with_index_tokenizer(config: FeedConfig, index: SampleIndex, users_text_decoder: bool = False) -> FeedConfig:
    """``config`` with ``decode.text.tokenizer`` the index's when unset; ValueError when a set one differs from it."""
    decode = follow_index_tokenizer(config.decode, index.manifest, users_text_decoder)
    return config if decode is config.decode else config.model_copy(update={"decode": decode})


@dataclass(frozen=True)
class DecodeEngine:
    """Metrics, field reader (cache tiers, I/O threads, decoders, decode processes, Ray actors) and decode pools
    of one owner, from one feed config (``config``: the index's tokenizer filled in)."""

    config: FeedConfig
    metrics: FeedMetrics
    reader: FieldReader
    pools: DecodePools | None = None

    @classmethod
    def build(
        cls,
        index: SampleIndex,
        config: FeedConfig,
        *,
        decoders: Mapping[str, Callable[..., Any]] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        with_pools: bool = True,
    ) -> DecodeEngine:
        """The engine for ``index`` under ``config``; ``decoders``: the user's (`Feed`), ``on_error``: told of every
        decode task's exception (a log hook), ``with_pools``: start the decode pools now (else None).

        Raises ValueError for a tokenizer other than the index's, or a user transform that does not import.
        """
        config = with_index_tokenizer(config, index, "text" in (decoders or {}))
        metrics = FeedMetrics(index.names if isinstance(index, MixtureIndex) else ())  # a mixture: counts per source
        reader = FieldReader(config, metrics, index.fingerprint, decoders or {})
        try:
            pools = DecodePools(config, on_error, remote=reader.remote) if with_pools else None
        except BaseException:
            reader.close()
            raise
        return cls(config, metrics, reader, pools)

    def shared(self, plan: Plan, handover: Handover | None = None, dealt: DealtSteps | None = None) -> SharedResources:
        """What feeds on this engine share: ``plan``, the engine, and the service's hand-over and dealt steps."""
        return SharedResources(plan, self, handover, dealt)

    def snapshot(self, buffers: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The engine's part of a metrics snapshot: decode metrics over ``buffers``, caches, storage, read-ahead."""
        return {
            **self.metrics.snapshot(buffers),
            "cache": self.reader.source.stats(),
            "storage_degraded": self.reader.source.degraded,
            "read_ahead": self.reader.read_ahead(),
        }

    def close(self) -> None:
        """Stop the pools' workers, then the reader's threads, processes and actors (idempotent)."""
        if self.pools is not None:
            self.pools.close()
        self.reader.close()


@dataclass(frozen=True)
class SharedResources:
    """What the feeds of one owner share (the service's streams): its plan, its engine (field reader, metrics, decode
    pools), where a micro-batch a retired feed already decoded is taken from (``handover``), and the steps of the plan
    dealt once for all of them (``dealt``). Made by `DecodeEngine.shared`."""

    plan: Plan
    engine: DecodeEngine
    handover: Handover | None = None
    dealt: DealtSteps | None = None
