"""Eviction policies on training-shaped access: LRU, SIEVE and S3-FIFO against the RAM tier's own policy.

Replays the same traces, with variable entry sizes and a byte budget, through reference
implementations of LRU, SIEVE and S3-FIFO and through the real `RamTier` (shared memory,
frequency-guarded FIFO). Reports hit ratios; hit ratios do not depend on machine noise.

    .venv/bin/python benchmarks/bench_cache_policy.py
"""

from __future__ import annotations

import json
import random
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path

from omnifeed.cache import RamTier, RamTierConfig, entry_key

Trace = list[int]


def lru(trace: Trace, size: Callable[[int], int], capacity: int) -> float:
    cache: OrderedDict[int, int] = OrderedDict()
    used = hits = 0
    for k in trace:
        if k in cache:
            cache.move_to_end(k)
            hits += 1
            continue
        cache[k] = size(k)
        used += cache[k]
        while used > capacity:
            used -= cache.popitem(last=False)[1]
    return hits / len(trace)


def sieve(trace: Trace, size: Callable[[int], int], capacity: int) -> float:
    """SIEVE (Zhang et al., NSDI '24): a FIFO with visited bits and a hand that sweeps from old to new."""
    order: list[int] = []  # oldest first
    visited: dict[int, bool] = {}
    used = hits = hand = 0
    for k in trace:
        if k in visited:
            visited[k] = True
            hits += 1
            continue
        used += size(k)
        while used > capacity and order:
            if hand >= len(order):
                hand = 0
            victim = order[hand]
            if visited[victim]:
                visited[victim] = False
                hand += 1
            else:
                order.pop(hand)
                del visited[victim]
                used -= size(victim)
        order.append(k)
        visited[k] = False
    return hits / len(trace)


def s3fifo(trace: Trace, size: Callable[[int], int], capacity: int) -> float:
    """S3-FIFO (Yang et al., SOSP '23): small FIFO (10 %), main FIFO with reinsertion, ghost queue."""
    small: deque[int] = deque()
    main: deque[int] = deque()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}
    small_cap = capacity // 10
    used = {"small": 0, "main": 0}
    hits = 0

    def evict_main() -> None:
        while main:
            v = main.popleft()
            if freq[v] > 0:
                freq[v] -= 1
                main.append(v)
            else:
                del freq[v]
                used["main"] -= size(v)
                return

    def evict_small() -> None:
        while small:
            v = small.popleft()
            used["small"] -= size(v)
            if freq[v] > 1:
                main.append(v)
                used["main"] += size(v)
                while used["main"] > capacity - small_cap and main:
                    evict_main()
            else:
                del freq[v]
                ghost[v] = None
                if len(ghost) > 4 * len(main) + 16:
                    ghost.popitem(last=False)
                return

    for k in trace:
        if k in freq:
            freq[k] = min(freq[k] + 1, 3)
            hits += 1
            continue
        while used["small"] + used["main"] + size(k) > capacity and (small or main):
            if used["small"] >= small_cap or not main:
                evict_small()
            else:
                evict_main()
        freq[k] = 0
        if k in ghost:
            del ghost[k]
            main.append(k)
            used["main"] += size(k)
        else:
            small.append(k)
            used["small"] += size(k)
    return hits / len(trace)


def ram_tier(trace: Trace, size: Callable[[int], int], capacity: int) -> float:
    """The real RamTier: get, and put after a miss."""
    name = f"bench-{uuid.uuid4().hex[:10]}"
    tier = RamTier(RamTierConfig(name=name, capacity_bytes=capacity, max_entry_fraction=0.5))
    hits = 0
    try:
        for k in trace:
            key = entry_key("bench", str(k), "f", "raw")
            if tier.get(key) is not None:
                hits += 1
            else:
                tier.put(key, bytes(size(k) - 32))  # the tier's own per-entry header is 24-32 bytes
    finally:
        tier.unlink()
    return hits / len(trace)


def epochs(n: int, count: int, rng: random.Random) -> Trace:
    trace: Trace = []
    for _ in range(count):
        order = list(range(n))
        rng.shuffle(order)
        trace += order
    return trace


def zipf_with_scans(n: int, rng: random.Random) -> Trace:
    """Popular items (Zipf 0.9) interleaved with one-pass scans (a pre-caching job, an evaluation pass)."""
    weights = [1 / (i + 1) ** 0.9 for i in range(n)]
    trace: Trace = []
    for block in range(10):
        trace += rng.choices(range(n), weights, k=2500)
        trace += list(range(n + block * 1500, n + (block + 1) * 1500))
    return trace


def main() -> None:
    rng = random.Random(0)
    n = 3000
    sizes = {k: rng.randint(2_000, 30_000) for k in range(n + 20_000)}
    size = sizes.__getitem__
    total = sum(sizes[k] for k in range(n))
    cases = {
        "epochs, cache = 25 % of the data": (epochs(n, 4, rng), total // 4),
        "epochs, cache = 50 % of the data": (epochs(n, 4, rng), total // 2),
        "zipf + scans, cache = 10 %": (zipf_with_scans(n, rng), total // 10),
    }
    policies = {"lru": lru, "sieve": sieve, "s3fifo": s3fifo, "omnifeed RamTier": ram_tier}
    results = {}
    for case, (trace, capacity) in cases.items():
        results[case] = {name: round(policy(trace, size, capacity), 4) for name, policy in policies.items()}
        row = results[case]
        print(
            f"{case:36s} "
            + "  ".join(f"{name} {row[name]:.3f}" for name in policies)
            + f"   RamTier/LRU {row['omnifeed RamTier'] / max(row['lru'], 1e-9):.2f}x"
        )
    Path(__file__).with_name("results-cache-policy.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
