"""The multi-turn agent loop (and, to come, the rollout manager that runs pearl/rollout)."""
