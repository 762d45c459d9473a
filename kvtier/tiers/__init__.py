"""Secondary tiers: the contract, the registry, the process runner and the built-in tiers."""
