"""Benchmarks behind `lorastream bench`."""
