"""The storage tiers: chunk keys (`keys`) and the local CPU tier L1 (`l1`), whose one leaf
lock guards its index and accounting; the Redis tier and the tier manager come here next."""
