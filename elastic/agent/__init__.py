"""The agent: one per host; registers, heartbeats and runs the worker."""
