"""Network architectures: ``<family>.py`` holds the modules (no loading policy, no training loop) and
``<family>_io.py`` reads that family's released files into them."""
