"""normexp: reproducible experiments on normalization layers in vision transformers."""

from pathlib import Path

__version__ = "0.1.0"


def _config_dir() -> Path:
    """The Hydra config tree: shipped inside the package by a (non-editable) install, else the checkout's."""
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


CONFIG_DIR = _config_dir()
