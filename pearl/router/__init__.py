"""The HTTP router over pearl/serving's rules: turns to instances, live plan steps, migration."""
