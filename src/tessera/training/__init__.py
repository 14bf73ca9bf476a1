"""Training: launch, the step, the loop, metrics."""
