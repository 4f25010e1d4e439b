"""Training the drafter: losses, training-time signals and the training loop."""
