"""Discrete-event simulator of pearl (pure: no I/O, virtual clock)."""
