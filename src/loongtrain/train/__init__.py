"""Training: the step mechanics, the trainer, its checkpoints and its launcher."""
