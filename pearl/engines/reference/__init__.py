"""The CPU reference inference engine: a Hugging Face model served over vLLM's HTTP protocol."""
