"""Benchmarks: in-process load generators and reports. Never part of the test run."""
