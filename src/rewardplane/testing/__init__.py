"""Helpers that start real rewardplane processes, shared by the tests, the benchmarks and the examples."""
