"""Training: the loss and step mechanics (and, later, the trainer)."""
