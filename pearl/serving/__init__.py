"""Serving rules (pure): requests and their continuations, and the routing rules that send
a turn to an inference instance. Run by the simulator's fleet (``pearl.sim.fleet``) and,
later, by the HTTP router; nothing here does I/O or reads a clock."""
