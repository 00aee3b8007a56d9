"""Backbones (and DiT, the diffusion model), one file per family, behind one registry."""

from . import convnext, dit, levit, pvt, pvt_v2, swin, t2t, torchvision_cnn, vit  # noqa: F401  (importing registers)
from .build import backbone_arguments, build_backbone, build_model
from .registry import create_model, list_models, register_model
from .timm_registry import timm_name  # importing registers normexp_<name> in timm's model registry

__all__ = ["backbone_arguments", "build_backbone", "build_model", "create_model",
           "list_models", "register_model", "timm_name"]
