"""Benchmarks of `make bench`: each runs our path and a baseline in the same run and records the ratio."""
