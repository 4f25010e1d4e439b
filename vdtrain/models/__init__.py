"""Pure network architectures (no loading policy, no training loop)."""
