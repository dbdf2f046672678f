"""Model-building code shared by stages, benchmarks and tests."""
