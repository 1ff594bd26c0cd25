"""Training: crash-safe checkpoints (``tierflow.train.checkpoint``)."""
