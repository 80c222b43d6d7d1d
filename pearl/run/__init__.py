"""`pearl run`: agentic RL end to end on one machine (docs/run.md)."""
