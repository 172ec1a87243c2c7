"""Benchmarks behind `rollart bench`."""
