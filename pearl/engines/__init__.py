"""Rollout engines: the client that drives them, their launch commands, and the test fake."""
