"""Other systems made to run beside kvtier in our benchmarks (our code, on their public APIs)."""
