"""omnifeed.cache: the cache tiers (RAM, NVMe, remote) and the read-through chain over them."""

from ._chain import CacheChain, CacheTier
from ._config import CacheConfig, NvmeTierConfig, RamTierConfig, RemoteTierConfig
from ._errors import CacheError
from ._keys import entry_key
from ._nvme import NvmeTier
from ._ram import RamTier
from ._remote import TRANSIENT_ERRORS, LatencyMonitor, RemoteTier, is_local, is_transient

__all__ = [
    "CacheChain",
    "CacheConfig",
    "CacheError",
    "CacheTier",
    "LatencyMonitor",
    "NvmeTier",
    "NvmeTierConfig",
    "RamTier",
    "RamTierConfig",
    "RemoteTier",
    "RemoteTierConfig",
    "TRANSIENT_ERRORS",
    "entry_key",
    "is_local",
    "is_transient",
]
