"""normexp: reproducible experiments on normalization layers in vision transformers."""

__version__ = "0.1.0"
