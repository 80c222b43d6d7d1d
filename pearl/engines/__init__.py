"""pearl's inference engines: vLLM's HTTP protocol, one client, the CPU reference engine, the vLLM backend."""
