"""normexp: reproducible experiments on normalization layers in vision transformers."""

from pathlib import Path

__version__ = "0.1.0"
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"  # the Hydra config tree
