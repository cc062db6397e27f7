"""Training benchmarks: how well the trained drafts (models/) draft."""
