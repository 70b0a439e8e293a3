"""Power cuts under big writes, racing trims, shrinks under writes, deletes with clones.

See gaps.py. Also checks that the pool file and the space the store counts as used stay
bounded across the cuts (no space leaks from crashes).
"""

from tests.torture import gaps

CUTS = 120


def test_big_writes_racing_trims_and_shrinks_survive_power_cuts():
    stats, growth, seed = gaps.run(CUTS)
    print(f"\n{stats.line()}; pool {growth.pool_bytes[0]}..{max(growth.pool_bytes)} bytes")  # noqa: T201
    assert stats.cycles == CUTS
    assert stats.acked_writes > 100 * CUTS
    assert stats.violations == [], "\n".join(stats.violations[:40])
    # used space is what the maps hold plus the log: never more than a few MiB over it
    for used, live in zip(growth.used_bytes, growth.live_bytes, strict=True):
        assert used - live < 4 << 20, f"seed {seed}: {used} bytes used for {live} live"
    assert max(growth.pool_bytes) < 2 * max(growth.live_bytes) + (8 << 20), f"seed {seed}"
