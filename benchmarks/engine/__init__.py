"""Engine benchmarks: the engine in process against HF `generate`, and its kernels."""
