"""`DecodeActor`: the Ray actor of a remote decode pool — reads a field through its own cache chain, decodes it.

It runs the decoders the service's local workers run (`make_decoder` with the same
``DecodeConfig``), so a value decoded here is the value a local worker would have made, byte
for byte. It decodes only: the transforms (random per epoch, maybe user code) stay in the
service. It only ever reports success; any failure comes back as ``("failed", why)`` and the
service decodes the field itself, so a bad sample fails with exactly the local reason.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ...cache import CacheConfig
from ..decode import DecodeConfig, make_decoder
from ..index import FieldLocation, IndexedSample
from ._field_source import FieldSource

Answer = tuple[str, Any, int]
"""("ok", decoded value, bytes the actor read) or ("failed", why, 0)."""


class DecodeActor:
    """One remote decode worker: ``decode`` answers one field of one sample (run as a Ray actor)."""

    def __init__(self, decode_json: str, cache_json: str, namespace: str) -> None:
        self._decode = DecodeConfig.model_validate_json(decode_json)
        cache = CacheConfig.model_validate_json(cache_json)
        # The RAM tier is the service node's shared memory: an actor elsewhere keeps only its disk tier.
        self._source = FieldSource(cache.model_copy(update={"ram": None}), namespace, self._decode)
        self._decoders: dict[str, Any] = {}

    def ready(self) -> dict[str, Any]:
        """Where this actor runs, once it is constructed: Ray node id, node IP, host and process id."""
        import ray

        try:
            node, ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001  not in a Ray worker (or an older Ray): the host stands for the node
            node, ip = socket.gethostname(), ""
        return {"node": str(node), "ip": str(ip), "host": socket.gethostname(), "pid": os.getpid()}

    def decode(self, sample: IndexedSample, location: FieldLocation, data: bytes | None) -> Answer:
        """The decoder's output for the field (before any transform), from ``data`` or read here when None."""
        try:
            read = 0
            if data is None:
                kind, payload = self._source.load(sample, location)
                if kind == "decoded":
                    return "ok", payload, 0
                data, read = payload, len(payload)
            decoder = self._decoders.get(location.modality)
            if decoder is None:
                decoder = self._decoders[location.modality] = make_decoder(location.modality, self._decode)
            value = decoder(data, sample.key)
            if read:
                self._source.remember(sample, location, value)
            return "ok", value, read
        except Exception as exc:  # noqa: BLE001  the service decodes the field again and reports it
            return "failed", f"{type(exc).__name__}: {exc}", 0

    def close(self) -> None:
        """Close the cache chain (before the actor is killed)."""
        self._source.close()
