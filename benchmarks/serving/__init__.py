"""Serving benchmarks: the service over HTTP on a local Ray cluster, and the helpers that drive it."""
