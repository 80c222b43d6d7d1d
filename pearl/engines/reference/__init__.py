"""The CPU reference engine: a small real model served over vLLM's HTTP protocol."""
