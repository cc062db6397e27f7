"""Fidelity benchmarks: what the exactness guarantees (batch invariance, keyed sampling, coupled verification) cost."""
