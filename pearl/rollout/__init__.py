"""The rollout ledger (pure): prompts and GRPO groups, admission under the staleness bound,
batch assembly, what an update does to trajectories past the bound, and the policy version
of every generated token span. Run by the simulator and by the real rollout manager."""
