"""Checkpoints: storage (local paths, later gs://) and Orbax wiring."""
