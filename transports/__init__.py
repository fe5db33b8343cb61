"""Storage and network transports for tiers below memory."""
