"""Structured-output benchmarks: the shared JSON-schema suite and the grammar libraries measured on it."""
