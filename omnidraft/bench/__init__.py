"""Benchmark: our modes side by side with the target alone and transformers' assisted generation."""
