"""Cache tiers below the device (the cache-tier family's implementations): host memory (L2)."""
