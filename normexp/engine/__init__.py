"""The training engine: the loop, and around it checkpoints, stop signals, divergence checks, precision."""
