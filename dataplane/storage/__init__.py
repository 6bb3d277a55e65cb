"""Storage tiers: L1 (local CPU); the remote tier plugs in behind it."""
