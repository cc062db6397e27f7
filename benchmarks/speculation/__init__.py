"""Speculation benchmarks: proposers against plain decoding, at c=1 and under load."""
