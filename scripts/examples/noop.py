"""Benchmark worker that does nothing: what remains is the launcher's own cost."""
