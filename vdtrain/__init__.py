"""vdtrain: train speculative-decoding drafters for visual AR models and measure their speed-ups."""
