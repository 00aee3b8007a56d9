"""task=mae: masking, patches, the loss on masked patches, the sin-cos embedding, every normalizer in every
slot of encoder and decoder, a pre-training run and a fine-tuning run from it, layer-wise lr decay, exact
resume, and bad input in one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import CONFIG_DIR, compose_cfg, quick_cfg
from omegaconf import OmegaConf

from normexp.engine.checkpoint import load_checkpoint
from normexp.engine.trainer import Trainer
from normexp.errors import UserError
from normexp.models import build_backbone
from normexp.models.mae import masked_loss, patch_targets, patchify, random_masking, unpatchify
from normexp.models.positions import sincos_2d
from normexp.norms.registry import get_norm_class
from normexp.run import run
from normexp.tasks.classification import start_from
from normexp.tasks.mae import build_mae
from normexp.tracking.records import RunRecord, read_metrics

NORMS = sorted(p.stem for p in (Path(CONFIG_DIR) / "norm").glob("*.yaml"))


def mae_cfg(*overrides: str, epochs: int = 3):
    """The MAE demo at the digits' 8 px (4 x 4 patches, 4 visible), a few epochs."""
    return quick_cfg("task=mae", "trainer.warmup_epochs=1", *overrides, epochs=epochs)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A three-epoch MAE run with DyT: (its summary, its directory)."""
    run_dir = tmp_path_factory.mktemp("mae") / "run"
    return run(mae_cfg("norm=dyt"), run_dir), run_dir


# ---------------------------------------------------------------- the pieces, against their formulas
def test_masking_keeps_the_same_count_per_sample_and_ids_restore_undoes_the_shuffle():
    x = torch.randn(5, 64, 8)
    kept, mask, ids_restore, ids_keep = random_masking(x, 0.75)
    assert kept.shape == (5, 16, 8)  # int(64 x 0.25), as MAE's random_masking
    assert mask.sum(dim=1).tolist() == [48] * 5
    assert torch.equal(kept, torch.stack([x[i, ids_keep[i]] for i in range(5)]))
    assert not torch.equal(ids_keep[0].sort().values, ids_keep[1].sort().values)  # a mask per sample
    # the kept tokens and placeholders, unshuffled with ids_restore, are x where the mask is 0
    shuffled = torch.cat([kept, torch.zeros(5, 48, 8)], dim=1)
    restored = torch.gather(shuffled, 1, ids_restore[..., None].expand(-1, -1, 8))
    assert torch.equal(restored[mask == 0], x[mask == 0]) and (restored[mask == 1] == 0).all()
    assert int(64 * (1 - 0.7)) == len(random_masking(x, 0.7)[3][0])  # 19.2 -> 19 kept


def test_patches_are_row_major_pixels_channels_last_and_unpatchify_inverts():
    images = torch.randn(2, 3, 8, 12)
    patches = patchify(images, 4)
    assert patches.shape == (2, 6, 48)
    assert torch.equal(patches[1, 4].view(4, 4, 3), images[1, :, 4:8, 4:8].permute(1, 2, 0))  # row 1, col 1
    assert torch.equal(unpatchify(patches, 4, (2, 3)), images)


def test_the_loss_is_on_masked_patches_only_with_norm_pix_targets():
    torch.manual_seed(0)
    images, prediction = torch.randn(2, 3, 8, 8), torch.randn(2, 4, 48)
    mask = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0]])
    expected, count = 0.0, 0
    for n in range(2):
        for p in range(4):
            if mask[n, p]:
                row, col = divmod(p, 2)
                pixels = images[n, :, 4 * row:4 * row + 4, 4 * col:4 * col + 4].permute(1, 2, 0).reshape(-1)
                target = (pixels - pixels.mean()) / math.sqrt(pixels.var().item() + 1e-6)
                expected += float(((prediction[n, p] - target) ** 2).mean())
                count += 1
    loss = masked_loss(prediction, patch_targets(images, 4, norm_pix_loss=True), mask)
    assert loss.item() == pytest.approx(expected / count, rel=1e-5)
    changed = prediction.clone()
    changed[mask == 0] += 5.0  # the visible patches' predictions do not count
    assert masked_loss(changed, patch_targets(images, 4, True), mask).item() == pytest.approx(loss.item())


def test_the_sincos_embedding_is_the_papers_formula():
    dim, grid = 16, (3, 4)
    emb = sincos_2d(dim, grid, cls_token=True)[0].double()
    assert emb.shape == (13, 16) and (emb[0] == 0).all()
    quarter = dim // 4
    for token in range(12):
        row, col = divmod(token, 4)
        for k in range(quarter):
            omega = 1 / 10000 ** (k / quarter)
            # columns in the first half, rows in the second (MAE's get_2d_sincos_pos_embed); sin then cos
            assert emb[1 + token, k] == pytest.approx(math.sin(col * omega), abs=1e-6)
            assert emb[1 + token, quarter + k] == pytest.approx(math.cos(col * omega), abs=1e-6)
            assert emb[1 + token, 2 * quarter + k] == pytest.approx(math.sin(row * omega), abs=1e-6)
            assert emb[1 + token, 3 * quarter + k] == pytest.approx(math.cos(row * omega), abs=1e-6)


# ---------------------------------------------------------------- the model, every normalizer
@pytest.mark.parametrize("norm", NORMS)
def test_every_normalizer_fills_every_slot_of_encoder_and_decoder_and_trains_a_step(norm):
    cfg = mae_cfg(f"norm={norm}")
    torch.manual_seed(0)
    model = build_mae(cfg)
    placed = [name for name, m in model.named_modules() if isinstance(m, get_norm_class(norm))]
    depth, decoder_depth = len(model.encoder.blocks), len(model.decoder_blocks)
    assert len(placed) == 2 * depth + 1 + 2 * decoder_depth + 1  # every block's two, both final norms
    assert {"encoder.norm", "decoder_norm", "encoder.blocks.0.norm1", "decoder_blocks.1.norm2"} <= set(placed)
    images = torch.randn(4, 3, 8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss, prediction, mask = model(images)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and prediction.shape == (4, 16, 12) and mask.sum() == 4 * 12
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_dtn_in_the_encoder_takes_its_statistics_over_the_visible_tokens():
    """The encoder's DTN layers see 1 + 4 tokens of a 4 x 4 grid: P over those tokens, from their offsets --
    the same numbers as the full-grid DTN on the same tokens when every token is visible."""
    model = build_mae(mae_cfg("norm=dtn"))
    layer = model.encoder.blocks[0].norm1
    seen = {}
    layer.register_forward_hook(lambda m, args, out: seen.update(x=args[0], positions=m.layout.positions))
    model(torch.randn(2, 3, 8, 8))
    assert seen["x"].shape == (2, 5, 96) and seen["positions"].shape == (2, 4)
    assert model.encoder.token_layout.positions is None  # cleared once the encoder has run


# ---------------------------------------------------------------- a run, and fine-tuning from it
def test_a_pretraining_run_logs_its_loss_and_pictures(pretrained):
    summary, run_dir = pretrained
    assert summary["status"] == "completed"
    losses = [r["val/loss"] for r in read_metrics(run_dir) if "val/loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert summary["metrics"]["best"]["val/loss"] == min(losses)  # the best is the lowest
    assert sorted(p.name for p in (run_dir / "reconstructions").iterdir()) == \
        ["epoch_0001.png", "epoch_0002.png", "epoch_0003.png"]
    assert any(k.startswith("alpha/encoder.blocks.0") for k in read_metrics(run_dir)[-1])  # DyT's alpha


def test_fine_tuning_loads_every_encoder_weight_and_keeps_the_normalizer(pretrained, tmp_path):
    _, run_dir = pretrained
    cfg = quick_cfg(f"task.pretrained={run_dir}", "backbone.global_pool=avg", "task.head_init_std=2e-5")
    from normexp.tasks import prepare_config

    cfg = prepare_config(cfg)
    assert cfg.norm.name == "dyt"  # the pre-training's normalizer
    model = build_backbone(cfg.backbone, cfg.norm)
    record = RunRecord(tmp_path / "run", {}, writes=False)
    start_from(model, cfg, record)
    encoder = {k.removeprefix("encoder."): v for k, v in load_checkpoint(run_dir)["model"].items()
               if k.startswith("encoder.")}
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in encoder.items() if k in own)
    report = record.summary["pretrained"]
    assert report["task"] == "mae" and report["weights"] == "encoder"
    assert sorted(report["fresh"]) == ["fc_norm.alpha", "fc_norm.bias", "fc_norm.weight", "head.bias",
                                       "head.weight"]
    assert sorted(report["dropped"]) == ["norm.alpha", "norm.bias", "norm.weight"]  # fc_norm replaces it
    assert model.head.weight.std().item() < 1e-4  # MAE's head init


def test_fine_tuning_refuses_another_backbone_or_a_run_without_one(pretrained, tmp_path):
    _, run_dir = pretrained
    from normexp.tasks import prepare_config

    with pytest.raises(UserError, match="a run of backbone=vit_micro; this run builds backbone=vit_micro_st"):
        prepare_config(quick_cfg(f"task.pretrained={run_dir}", "backbone=vit_micro_star"))
    with pytest.raises(UserError, match="no checkpoint at"):
        run(quick_cfg(f"task.pretrained={tmp_path / 'nowhere'}"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    detection = tmp_path / "detection"  # its checkpoint holds a detector, no backbone to start from
    detection.mkdir()
    (detection / "config.yaml").write_text(yaml.safe_dump({
        "task": {"name": "detection"}, "backbone": {"name": "vit_micro"}, "norm": {"name": "ln"},
        "data": {"name": "coco_digits"}}))
    with pytest.raises(UserError, match="is a detection run, whose checkpoint holds no backbone to start "
                                        "from: give a run of classification, dino, mae"):
        prepare_config(quick_cfg(f"task.pretrained={detection}"))


def test_layer_decay_gives_each_block_the_mae_scale(tmp_path):
    """MAE's lr_decay.py: layer 0 (embeddings) decay^(L+1), block i (1..L) decay^(L+1-i), the head 1."""
    cfg = quick_cfg("trainer.layer_decay=0.65", "backbone.global_pool=avg")
    model = build_backbone(cfg.backbone, cfg.norm)
    from normexp.data import build_classification_data

    trainer = Trainer(cfg.trainer, model, build_classification_data(cfg.data, 0),
                      RunRecord(tmp_path / "run", OmegaConf.to_container(cfg, resolve=True)))
    depth = len(model.blocks)
    scale_of = {id(p): g["lr_scale"] for g in trainer.optimizer.param_groups for p in g["params"]}
    for name, parameter in model.named_parameters():
        if name.startswith("blocks."):
            layer = int(name.split(".")[1]) + 1
        elif name.startswith(("patch_embed", "cls_token", "pos_embed")):
            layer = 0
        else:
            layer = depth + 1
        assert scale_of[id(parameter)] == pytest.approx(0.65 ** (depth + 1 - layer)), name


@pytest.mark.parametrize("overrides,message", [
    (["task.mask_ratio=1.0"], "task.mask_ratio=1.0: must be < 1"),
    (["task.decoder.heads=5"], "cannot build MAE over backbone 'vit_micro' with norm 'ln': decoder_heads=5 "
                               "must divide decoder_dim=64"),
    # issue 47 (14, 22): a mask that keeps no patch "completed"; a string and a ConvNeXt were misread
    (["task.mask_ratio=0.99"], "task.mask_ratio=0.99 keeps none of the 16 patches of backbone=vit_micro at "
                               "data.img_size=8: use at most 0.9375"),
    (["task.mask_ratio='0.5'"], "task.mask_ratio='0.5' is a string: must be a number (give it unquoted)"),
    (["backbone=convnext_micro"], "MAE needs a ViT backbone (got convnext_micro): its encoder sees the "
                                  "visible patches as tokens; pick backbone=vit_*"),
    (["backbone=swin_micro"], "MAE needs a ViT backbone (got swin_micro)"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, overrides, message):
    with pytest.raises(UserError) as error:
        run(mae_cfg(*overrides), tmp_path / "run")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


def test_views_are_maes_crops(tmp_path):
    """The training images are random resized crops: two epochs see different pixels of the same image."""
    cfg = compose_cfg("task=mae", "logger=none", "data.img_size=8", "task.crop_scale=[0.2,1.0]")
    from normexp.data import build_classification_data
    from normexp.tasks.mae import mae_views

    data = build_classification_data(cfg.data, 0, train_transform=mae_views((0.2, 1.0), 0.0))
    image, _ = data.train.dataset[0]
    again, _ = data.train.dataset[0]
    assert image.shape == (3, 8, 8) and not torch.equal(image, again)
    assert np.isfinite(image.numpy()).all()
