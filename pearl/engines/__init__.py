"""Inference engines pearl ships (the CPU reference engine)."""
