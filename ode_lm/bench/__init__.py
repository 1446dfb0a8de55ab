"""Benchmark and compiled-program analysis helpers."""
