#!/usr/bin/env python3
"""Prints the libCacheSim miss counts pinned in tests/libcachesim_parity.rs for the shipped
CloudPhysics trace (one unit-size object per request, keyed by lbn): ARC at several cache
sizes, and S3-FIFO, 2Q and CLOCK at non-default parameters, all at 4,897 objects unless said.

Usage: python3 libcachesim_parameters.py [shared/traces/cloudPhysicsIO.csv]
Needs PyPI `libcachesim` (0.3.5 produced the pinned values).
"""
import sys

import libcachesim as lcs

TRACE = sys.argv[1] if len(sys.argv) > 1 else "/work/shared/traces/cloudPhysicsIO.csv"
CAPACITY = 4_897

CASES = [
    *[(f"ARC {size}", lambda size=size: lcs.ARC(size)) for size in (100, 489, 4_897, 10_000, 16_000, 30_000)],
    ("S3FIFO default", lambda: lcs.S3FIFO(CAPACITY)),
    ("S3FIFO small 0.2 ghost 0.5 threshold 1",
     lambda: lcs.S3FIFO(CAPACITY, small_size_ratio=0.2, ghost_size_ratio=0.5, move_to_main_threshold=1)),
    ("S3FIFO small 0.05 ghost 2.0 threshold 3",
     lambda: lcs.S3FIFO(CAPACITY, small_size_ratio=0.05, ghost_size_ratio=2.0, move_to_main_threshold=3)),
    ("TwoQ default", lambda: lcs.TwoQ(CAPACITY)),
    ("TwoQ Ain 0.1 Aout 1.0", lambda: lcs.TwoQ(CAPACITY, a_in_size_ratio=0.1, a_out_size_ratio=1.0)),
    ("TwoQ Ain 0.5 Aout 0.25", lambda: lcs.TwoQ(CAPACITY, a_in_size_ratio=0.5, a_out_size_ratio=0.25)),
    *[(f"Clock {bits} bits", lambda bits=bits: lcs.Clock(CAPACITY, n_bit_counter=bits)) for bits in (1, 2, 3)],
]


def main():
    with open(TRACE) as trace:
        next(trace)  # header
        keys = [int(line.rsplit(",", 1)[1]) for line in trace if line.strip()]
    for name, make_cache in CASES:
        cache = make_cache()
        request = lcs.Request()
        request.obj_size = 1
        misses = 0
        for key in keys:
            request.obj_id = key
            if not cache.get(request):
                misses += 1
        print(f"{name}: {misses} misses of {len(keys)}")


if __name__ == "__main__":
    main()
