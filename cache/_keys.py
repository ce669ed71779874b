"""Entry keys: a 16-byte digest of (namespace, sample key, field, transform version)."""

from __future__ import annotations

import xxhash


def entry_key(namespace: str, sample_key: str, field: str, version: str) -> bytes:
    """The cache key of one field of one sample under one transform.

    ``namespace`` names the data (the index fingerprint), ``version`` the transform ("raw"
    for the stored bytes, or a digest of the decode settings), so a changed source or a
    changed decode setting never meets an old entry. Parts are length-prefixed: no two
    different tuples share an encoding.
    """
    digest = xxhash.xxh3_128()
    for part in (namespace, sample_key, field, version):
        data = part.encode()
        digest.update(len(data).to_bytes(4, "little"))
        digest.update(data)
    return digest.digest()
