"""Post-hoc analysis of pearl runs: event logs and Slurm accounting."""
