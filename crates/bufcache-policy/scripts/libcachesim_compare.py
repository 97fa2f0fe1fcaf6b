#!/usr/bin/env python3
"""Replays the traces dumped by `examples/miss_table.rs --dump DIR` through libCacheSim's
own implementations (PyPI package `libcachesim`) with unit object sizes, and prints their
miss ratios in the same layout, so POLICIES.md can put ours and theirs side by side.

Usage: python3 libcachesim_compare.py DIR   (DIR/manifest.txt lists "name capacity" lines)
"""
import sys

import libcachesim as lcs

POLICIES = [
    ("lru", lambda size: lcs.LRU(cache_size=size)),
    ("fifo", lambda size: lcs.FIFO(cache_size=size)),
    ("clock", lambda size: lcs.Clock(cache_size=size)),
    ("2q", lambda size: lcs.TwoQ(cache_size=size)),
    ("arc", lambda size: lcs.ARC(cache_size=size)),
    ("s3fifo(t=1)", lambda size: lcs.S3FIFO(cache_size=size, move_to_main_threshold=1)),
    ("s3fifo(t=2)", lambda size: lcs.S3FIFO(cache_size=size)),
    ("sieve", lambda size: lcs.Sieve(cache_size=size)),
]


def miss_ratio(make_cache, capacity, keys):
    cache = make_cache(capacity)
    request = lcs.Request()
    request.obj_size = 1
    misses = 0
    for key in keys:
        request.obj_id = key
        if not cache.get(request):
            misses += 1
    return misses / len(keys)


def main():
    directory = sys.argv[1]
    workloads = []
    with open(f"{directory}/manifest.txt") as manifest:
        for line in manifest:
            name, capacity = line.split()
            with open(f"{directory}/{name}.txt") as file:
                workloads.append((name, int(capacity), [int(key) for key in file]))
    header = " | ".join(f"{name} (c={capacity}) miss" for name, capacity, _ in workloads)
    print(f"| libCacheSim | {header} |")
    for policy, make_cache in POLICIES:
        ratios = [miss_ratio(make_cache, capacity, keys) for _, capacity, keys in workloads]
        print(f"| {policy} | " + " | ".join(f"{ratio:.4f}" for ratio in ratios) + " |")


if __name__ == "__main__":
    main()
