"""Tool environments behind one Gym-like protocol, registered by name (``docs/envs.md``).

Not pure: the sandbox spawns processes and the latency wrapper sleeps."""
