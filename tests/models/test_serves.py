"""What a backbone serves (the contract's ``serves``): every registered model declares it, and a dense task
refuses, in one line, a backbone that serves no dense features, naming those that do."""

from __future__ import annotations

import typing

import pytest
import torch
from conftest import compose_cfg

from normexp.errors import UserError
from normexp.models import build_backbone, list_models, registry
from normexp.models.base import CLASSIFICATION, DENSE_FEATURES, DIFFUSION, NEEDS, Backbone, served
from normexp.models.registry import model_classes, serving
from normexp.tasks import get_task


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_declares_what_it_serves(name):
    """Its family declares ``serves`` (not the contract's default), with needs a task may ask; the registry
    knows the family without building the model."""
    hint = typing.get_type_hints(registry._MODELS[name])["return"]
    assert set(typing.get_args(hint) or (hint,)) == set(model_classes(name))  # read off, not built
    for cls in model_classes(name):
        declared = next(k for k in cls.__mro__ if "serves" in vars(k))
        assert declared is not Backbone, f"{cls.__name__} does not declare what it serves"
        assert cls.serves and set(cls.serves) <= set(NEEDS)
        assert set(getattr(cls, "dense_weights", ())) <= {"pyramid.", "feature_norms."}


def test_the_families_serve_what_the_tasks_ask():
    dense = serving(DENSE_FEATURES)
    assert {"vit_micro", "swin_micro", "pvt_v2_b0", "levit_micro", "convnext_micro", "resnet50"} <= set(dense)
    assert not any(name.startswith("dit_") for name in dense)
    assert set(serving(DIFFUSION)) == {n for n in list_models() if n.startswith("dit_")}
    assert set(serving(CLASSIFICATION)) == set(list_models()) - set(serving(DIFFUSION))


def test_a_plain_model_serves_dense_features_only_with_its_pyramid():
    cfg = compose_cfg("backbone=vit_micro")
    with torch.device("meta"):
        assert served(build_backbone(cfg.backbone, cfg.norm)) == {CLASSIFICATION}
        assert served(build_backbone(cfg.backbone, cfg.norm, dense=True)) == {CLASSIFICATION, DENSE_FEATURES}
        assert build_backbone(cfg.backbone, cfg.norm, dense=True).dense_weights == ("pyramid.",)


def test_a_dense_task_refuses_a_backbone_without_dense_features_in_one_line():
    """vit_micro_star (no dense block in its config) under task=detection: refused before any work."""
    cfg = compose_cfg("task=detection", "backbone=vit_micro_star")
    task = get_task(cfg.task.name)
    assert task.need == DENSE_FEATURES
    with pytest.raises(UserError) as refused, torch.device("meta"):
        task.build(task.prepare(cfg))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("backbone 'vit_micro_star' serves classification, not dense features (")
    assert message.endswith("backbones that serve dense features: convnext_*, levit_*, pvt_*, pvt_v2_*, "
                            "resnet50*, swin_*, t2t_vit_*, vgg19_bn*, vit_*")


class TinyClassifier(Backbone):
    """A classifier only (the contract's default): logits, no feature maps."""

    feature_channels: list[int] = []
    feature_strides: list[int] = []

    def __init__(self, num_classes: int = 10, **_: object) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, num_classes)


def test_a_classifier_only_backbone_is_refused_naming_what_it_serves(monkeypatch):
    def tiny_classifier(**kwargs: object) -> TinyClassifier:
        return TinyClassifier(**kwargs)

    monkeypatch.setitem(registry._MODELS, "tiny_classifier", tiny_classifier)
    assert "tiny_classifier" not in serving(DENSE_FEATURES)
    refusal = (r"^backbone 'tiny_classifier' serves classification, not dense features; "
               r"backbones that serve dense features: convnext_\*, .*vit_\*$")
    with pytest.raises(UserError, match=refusal):
        build_backbone({"name": "tiny_classifier"}, {"name": "ln"}, dense=True)
    build_backbone({"name": "tiny_classifier"}, {"name": "ln"})  # a classification task takes it
