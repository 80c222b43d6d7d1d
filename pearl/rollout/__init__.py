"""The rollout ledger (pure): prompts and GRPO groups, admission under the staleness bound,
batch assembly, what an update does to trajectories past the bound, and the policy version
of every generated token span; and what a coordinator's predictor observes of the rollout
(``observed``: turn statistics, a running tool's time left, the turns left, each
trajectory's progress, the snapshot). Run by the simulator and by the real rollout manager."""
