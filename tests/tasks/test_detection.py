"""task=detection: RetinaNet and Mask R-CNN over each backbone family, pretrained backbones, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import coco_jpeg_tree, compose_cfg, run_cli
from omegaconf import OmegaConf

from normexp import CONFIG_DIR
from normexp.data.coco import build_detection_data, detection_root
from normexp.engine.checkpoint import save_checkpoint
from normexp.errors import UserError
from normexp.models import build_backbone
from normexp.run import run
from normexp.tasks.detection import DetectionTrainer, build_detection_model, with_pretrained_backbone
from normexp.tracking.records import RunRecord, read_summary

TINY = ["data.canvas_size=64", "data.num_train=4", "data.num_val=2", "data.batch_size=2",
        "data.eval_batch_size=2", "logger=none", "trainer.progress=false"]
# one member per image-backbone family (DiT is a diffusion model)
FAMILIES = sorted(p.stem for p in (CONFIG_DIR / "backbone").glob("*_micro.yaml")
                  if not p.stem.startswith("dit_"))


def detection_cfg(*overrides):
    return compose_cfg("task=detection", *TINY, *overrides)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("detector,norm", [("retinanet", "ln"), ("mask_rcnn", "dtn")])
@pytest.mark.parametrize("backbone", FAMILIES)
def test_a_train_step_and_an_eval_step(tmp_path, backbone, detector, norm):
    """DTN runs its positional statistics on the canvas grids, bigger than any it was built for."""
    cfg = detection_cfg(f"backbone={backbone}", f"task.detector={detector}", f"norm={norm}")
    data = build_detection_data(cfg.data, cfg.seed, masks=detector == "mask_rcnn")
    model = build_detection_model(cfg, data.num_classes)
    images, targets = next(iter(data.train))
    model.train()
    losses = model(images, targets)
    expected = {"classification", "bbox_regression"} if detector == "retinanet" else \
        {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"}
    assert set(losses) == expected and all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    body_grads = [p.grad for p in model.backbone.body.parameters() if p.grad is not None]
    assert body_grads and all(torch.isfinite(g).all() for g in body_grads)
    assert any(g.abs().sum() > 0 for g in body_grads)  # the loss reaches the backbone
    record = RunRecord(tmp_path / "run", OmegaConf.to_container(cfg, resolve=True))
    trainer = DetectionTrainer(cfg.trainer, model, data, record)
    metrics = trainer.evaluate(model, "val")
    types = ("bbox", "segm") if detector == "mask_rcnn" else ("bbox",)
    assert {f"val/{t}_AP" for t in types} <= set(metrics)
    assert all(0 <= metrics[f"val/{t}_AP"] <= 1 for t in types)


def pretrained_run(tmp_path, backbone="pvt_v2_micro", norm="dtn", img_size=16):
    """A classification run directory as the trainer writes it: config.yaml + checkpoint.pth."""
    cfg = compose_cfg(f"backbone={backbone}", f"norm={norm}", f"data.img_size={img_size}")
    model = build_backbone(cfg.backbone, cfg.norm)
    with torch.no_grad():
        for p in model.parameters():  # weights no fresh build has
            p.add_(torch.randn_like(p))
    run = tmp_path / f"pretrained-{backbone}-{norm}"
    run.mkdir()
    config = OmegaConf.to_container(cfg, resolve=True)
    config["backbone"].pop("dense", None)  # as runs recorded before the dense settings existed
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    save_checkpoint(run / "checkpoint.pth", {"epoch": 1, "model": model.state_dict(), "config": config})
    return run, model


@pytest.mark.parametrize("backbone,norm",
                         [("pvt_v2_micro", "dtn"), ("vit_micro", "dyt"), ("swin_micro", "dtn")])
def test_pretrained_classification_weights_load_into_the_backbone(tmp_path, backbone, norm):
    run, classifier = pretrained_run(tmp_path, backbone, norm)
    cfg = with_pretrained_backbone(detection_cfg(f"task.pretrained={run}", "backbone.drop_path_rate=0.05"))
    assert (cfg.backbone.name, cfg.norm.name, cfg.backbone.img_size) == (backbone, norm, 16)  # the run's
    assert cfg.backbone.drop_path_rate == 0.05  # how it trains here is this run's choice
    model = build_detection_model(cfg, 11)
    loaded = model.backbone.body.state_dict()
    for name, weight in classifier.state_dict().items():
        assert torch.equal(loaded[name], weight), name
    added = set(loaded) - set(classifier.state_dict())  # a plain model's pyramid, Swin's stage-output norms
    assert added == {k for k in loaded if k.startswith(("pyramid.", "feature_norms."))}
    assert added or backbone.startswith("pvt")
    assert all(type(m).__name__ == type(model.backbone.body.norm).__name__
               for m in getattr(model.backbone.body, "feature_norms", None) or [])  # the run's normalizer
    # DTN's positional parameters were learnt on a 16 px grid; the detector runs them on 64 px canvases
    model.eval()
    with torch.no_grad():
        assert len(model([torch.rand(3, 64, 64)])) == 1


@pytest.mark.parametrize("reported", [True, False])
def test_the_backbone_starts_from_the_weights_its_classification_run_reports(tmp_path, reported):
    """A recipe that reports its EMA model (the DTN code's and T2T-ViT's validate model_ema) hands detection
    the EMA weights; the others their trained weights."""
    cfg = compose_cfg("backbone=pvt_v2_micro", "trainer.ema.enabled=true", f"trainer.ema.reported={reported}")
    trained, ema = (build_backbone(cfg.backbone, cfg.norm).state_dict() for _ in range(2))
    config = OmegaConf.to_container(cfg, resolve=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    save_checkpoint(run / "checkpoint.pth", {"epoch": 1, "model": trained, "ema": ema, "config": config})
    record = RunRecord(tmp_path / "detection", {})
    body = build_detection_model(with_pretrained_backbone(detection_cfg(f"task.pretrained={run}")), 11,
                                 record).backbone.body.state_dict()
    expected = ema if reported else trained
    assert all(torch.equal(body[k], v) for k, v in expected.items())
    assert record.summary["pretrained_weights"] == ("ema" if reported else "raw")


def test_pretrained_backbone_that_does_not_match_is_one_line(tmp_path):
    source, _ = pretrained_run(tmp_path)
    state = torch.load(source / "checkpoint.pth", weights_only=False)
    state["model"].pop(next(iter(state["model"])))
    bare = tmp_path / "bare.pth"
    torch.save({"model": state["model"]}, bare)  # a file without a config: the configured backbone is used
    cfg = with_pretrained_backbone(detection_cfg(f"task.pretrained={bare}",
                                                 "backbone=pvt_v2_micro"))
    with pytest.raises(UserError, match="does not match the backbone .*missing") as e:
        build_detection_model(cfg, 11)
    assert "\n" not in str(e.value)
    cfg = with_pretrained_backbone(detection_cfg(f"task.pretrained={bare}", "backbone=swin_micro"))
    with pytest.raises(UserError, match="does not match the backbone"):
        build_detection_model(cfg, 11)
    with pytest.raises(UserError, match="does not match the backbone .*missing"):  # before the record exists
        run(detection_cfg(f"task.pretrained={bare}", "backbone=pvt_v2_micro", "logger=none"),
            tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_demo_command_line_records_coco_metrics(tmp_path):
    out = run_cli("task=detection", *TINY, "data.num_train=8", "trainer.epochs=1", "trainer.eval_interval=1",
                  "logger=wandb", env={"NORMEXP_OUTPUT_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    run = next((tmp_path / "detection").glob("*/summary.json")).parent
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["task"] == "detection"
    final = summary["metrics"]["final"]
    assert {f"val/bbox_{k}" for k in ("AP", "AP50", "AP75", "APs", "APm")} <= set(final)
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["backbone"]["name"], config["data"]["name"], config["task"]["detector"]) == \
        ("pvt_v2_b0", "coco_digits", "retinanet")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "val/bbox_AP" in rows[-1]
    assert list(run.glob("wandb/offline-run-*"))
    assert "val/bbox_AP=" in out.stdout


def test_a_coco_tree_with_a_missing_and_an_unreadable_image_trains_and_counts_them(tmp_path):
    """``data=coco`` on a tiny COCO 2017 tree of JPEGs: a train image gone, a val image cut short."""
    cfg = detection_cfg()
    tree = coco_jpeg_tree(detection_root(cfg.data), tmp_path / "coco")
    missing, truncated = sorted((tree / "train2017").iterdir())[2], sorted((tree / "val2017").iterdir())[0]
    missing.unlink()
    truncated.write_bytes(truncated.read_bytes()[:300])
    cfg = compose_cfg("task=detection", "data=coco", f"data.root={tree}", "data.num_classes=10",
                      "data.img_size=64", "data.min_size=64", "data.max_size=64", "data.batch_size=2",
                      "data.eval_batch_size=2", "data.num_workers=0", "trainer.epochs=1",
                      "trainer.warmup_iters=2", "logger=none", "trainer.progress=false")
    summary = run(cfg, tmp_path / "run")
    assert summary["status"] == "completed", summary.get("error")
    assert summary["bad_images"] == 2 and summary["bad_image_files"] == sorted([str(missing), str(truncated)])
    assert 0 <= summary["metrics"]["final"]["val/bbox_AP"] <= 1


@pytest.mark.parametrize("overrides,message", [
    (["data=coco"], "data.root is not set"),
    (["data=coco", "data.root=/nowhere"], "COCO root '/nowhere' does not exist"),
    (["task.detector=yolo"], "unknown task.detector 'yolo'"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, overrides, message):
    with pytest.raises(UserError) as error:
        run(compose_cfg("task=detection", "logger=none", *overrides), tmp_path / "run")
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)
    assert not (tmp_path / "run").exists()


def test_bad_input_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    out = run_cli("task=detection", "logger=none", "task.detector=yolo",
                  env={"NORMEXP_OUTPUT_DIR": str(tmp_path)})
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith("error: unknown task.detector 'yolo'"), out.stderr[-1500:]


def test_paper_recipes():
    cfg = compose_cfg("experiment=retinanet_pvt_1x")
    t = cfg.trainer
    assert (cfg.task.name, cfg.task.detector, cfg.data.name, cfg.backbone.name) == \
        ("detection", "retinanet", "coco", "pvt_v2_b0")
    assert (t.epochs, t.opt, t.lr, t.weight_decay, list(t.decay_milestones), t.warmup_iters) == \
        (12, "adamw", 1e-4, 1e-4, [8, 11], 500)
    assert t.warmup_lr == pytest.approx(1e-3 * t.lr) and t.decay_norm_and_bias
    assert (cfg.data.min_size, cfg.data.max_size, cfg.data.hflip, cfg.data.batch_size) == (800, 1333, 0.5, 16)
    assert cfg.data.filter_empty_gt and cfg.data.min_image_size == 32 and t.global_batch == 16
    assert (cfg.task.fpn_channels, cfg.task.levels, cfg.task.anchor_scale) == (256, None, None)
    # mmdet retinanet_r50_fpn.py train_cfg / test_cfg
    assert (cfg.task.score_thresh, cfg.task.detections_per_img) == (0.05, 100)
    assert dict(cfg.task.retinanet) == dict(fg_iou_thresh=0.5, bg_iou_thresh=0.4, topk_candidates=1000,
                                            nms_thresh=0.5)
    mask = compose_cfg("experiment=mask_rcnn_pvt_1x")
    assert (mask.task.detector, mask.trainer.lr, mask.task.box_head_dim) == ("mask_rcnn", 2e-4, 1024)
    assert mask.trainer.warmup_lr == pytest.approx(1e-3 * mask.trainer.lr)
    # mmdet mask_rcnn_r50_fpn.py train_cfg / test_cfg
    assert mask.task.rpn_min_pos_iou == 0.3 and dict(mask.task.mask_rcnn) == dict(
        rpn_fg_iou_thresh=0.7, rpn_bg_iou_thresh=0.3, rpn_batch_size_per_image=256, rpn_positive_fraction=0.5,
        rpn_pre_nms_top_n_train=2000, rpn_post_nms_top_n_train=1000, rpn_pre_nms_top_n_test=1000,
        rpn_post_nms_top_n_test=1000, rpn_nms_thresh=0.7, box_fg_iou_thresh=0.5, box_bg_iou_thresh=0.5,
        box_batch_size_per_image=512, box_positive_fraction=0.25, box_nms_thresh=0.5,
        bbox_reg_weights=[10.0, 10.0, 5.0, 5.0])
    swin = compose_cfg("experiment=mask_rcnn_swin_1x")
    assert (swin.backbone.name, swin.trainer.weight_decay, swin.trainer.decay_norm_and_bias) == \
        ("swin_tiny", 0.05, False)
    assert (swin.trainer.lr, swin.trainer.warmup_lr, swin.backbone.drop_path_rate) == (1e-4, 1e-7, 0.1)
    assert list(swin.data.min_size) == list(range(480, 801, 32))
    assert dict(swin.task.mask_rcnn) == dict(mask.task.mask_rcnn)  # the same mmdet model config


def test_paper_levels_over_a_pyramid_of_four():
    cfg = compose_cfg("experiment=retinanet_pvt_1x", "data=coco_digits", "data.num_train=1")
    for detector, levels, strides in (("retinanet", [1, 2, 3], [8, 16, 32, 64, 128]),
                                      ("mask_rcnn", [0, 1, 2, 3], [4, 8, 16, 32, 64])):
        cfg.task.detector = detector
        model = build_detection_model(cfg, 11)
        assert (model.backbone.levels, model.backbone.strides) == (levels, strides)
    # RetinaNet's P6 comes from C5 (mmdet's 'on_input'), even when C5 is as wide as the FPN (256 here)
    cfg.task.detector = "retinanet"
    model = build_detection_model(cfg, 11)
    extra = model.backbone.fpn.extra_blocks
    assert extra.p6.in_channels == 256
    c5, p5 = torch.randn(1, 256, 4, 4), torch.randn(1, 256, 4, 4)
    p, names = extra([p5], [c5], ["p5"])
    assert names == ["p5", "p6", "p7"] and torch.equal(p[1], extra.p6(c5))
    assert torch.equal(p[2], extra.p7(p[1]))  # no ReLU before P7 (mmdet relu_before_extra_convs=False)


def test_mmdet_initialisation_and_unrounded_anchors():
    cfg = compose_cfg("experiment=mask_rcnn_pvt_1x", "data=coco_digits", "data.num_train=1")
    model = build_detection_model(cfg, 11)
    fpn = model.backbone.fpn
    convs = [m for m in fpn.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(not m.bias.any() for m in convs)
    for m in convs:  # Xavier-uniform: |w| <= sqrt(6 / (fan_in + fan_out))
        fan_in, fan_out = (m.weight.shape[i] * m.weight[0, 0].numel() for i in (1, 0))
        assert m.weight.abs().max() <= (6 / (fan_in + fan_out)) ** 0.5
    head = model.roi_heads.box_predictor
    assert head.cls_score.weight.std().item() == pytest.approx(0.01, rel=0.1)
    assert head.bbox_pred.weight.std().item() == pytest.approx(0.001, rel=0.1)
    # RetinaNet: 4 x stride x 2^(k/3) at ratios 0.5 / 1 / 2, not rounded (mmdet 2.x AnchorGenerator)
    cfg.task.detector = "retinanet"
    anchors = build_detection_model(cfg, 11).anchor_generator.cell_anchors[0]  # stride 8
    w = (anchors[:, 2] - anchors[:, 0]).tolist()
    expected = [32 * 2 ** (k / 3) / r ** 0.5 for r in (0.5, 1.0, 2.0) for k in range(3)]
    assert w == pytest.approx(expected, abs=1e-4) and any(v != round(v) for v in w)


def test_rpn_low_quality_matches_need_iou_0_3():
    from normexp.models.detection import MinIoUMatcher

    quality = torch.tensor([[0.25, 0.1, 0.0], [0.0, 0.35, 0.2]])  # 2 ground truths x 3 anchors
    matches = MinIoUMatcher(0.7, 0.3, 0.3)(quality)
    # gt 0's best anchor (0.25) stays negative; gt 1's (0.35) becomes its match; anchor 2 is negative
    assert matches.tolist() == [-1, 1, -1]


def test_roi_align_is_aligned_on_mmdets_levels():
    from torchvision.ops import roi_align

    from normexp.models.detection import AlignedRoIAlign

    pool = AlignedRoIAlign(["0", "1", "2", "3"], [4, 8, 16, 32], output_size=7)
    features = {str(i): torch.randn(1, 2, 128 // s, 128 // s) for i, s in enumerate([4, 8, 16, 32])}
    boxes = torch.tensor([[0.0, 0.0, 50.0, 50.0], [0.0, 0.0, 120.0, 120.0], [0.0, 0.0, 230.0, 230.0],
                          [0.0, 0.0, 500.0, 500.0]])
    out = pool(features, [boxes], [(128, 128)])
    for i, (level, stride) in enumerate([(0, 4), (1, 8), (2, 16), (3, 32)]):  # sqrt(wh) < 112, < 224, ...
        rois = torch.cat([torch.zeros(1, 1), boxes[i : i + 1]], dim=1)
        expected = roi_align(features[str(level)], rois, 7, 1 / stride, sampling_ratio=0, aligned=True)
        torch.testing.assert_close(out[i : i + 1], expected)


def test_unknown_torchvision_option_is_refused(tmp_path):
    cfg = detection_cfg("+task.retinanet.topk_candidate=10")
    with pytest.raises(UserError, match=r"task.retinanet has no option \['topk_candidate'\]"):
        build_detection_model(cfg, 11)
    build_detection_model(detection_cfg("+task.retinanet.topk_candidates=10"), 11)


@pytest.mark.demo
def test_demo_reaches_the_acceptance_ap(tmp_path):
    """The documented demo, as typed: RetinaNet, pvt_v2_b0, LN, coco_digits, from scratch (~5 min)."""
    out = run_cli("task=detection", "data=coco_digits", env={"NORMEXP_OUTPUT_DIR": str(tmp_path)},
                  timeout=1500)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = read_summary(next((tmp_path / "detection").glob("*/summary.json")).parent)
    final = summary["metrics"]["final"]
    print(f"detection demo: bbox AP {final['val/bbox_AP']:.3f} in {summary['wall_time_s']:.0f} s")
    assert final["val/bbox_AP"] >= 0.3


@pytest.mark.demo
def test_mask_rcnn_learns_masks(tmp_path):
    """A shortened Mask R-CNN demo (300 canvases, 4 epochs, ~1.5 min): boxes and masks both score."""
    out = run_cli("task=detection", "task.detector=mask_rcnn", "data.num_train=300", "trainer.epochs=4",
                  "trainer.decay_milestones=[3,4]", "trainer.eval_interval=4", "logger=none",
                  env={"NORMEXP_OUTPUT_DIR": str(tmp_path)}, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    final = read_summary(next((tmp_path / "detection").glob("*/summary.json")).parent)["metrics"]["final"]
    print(f"mask_rcnn short: bbox AP {final['val/bbox_AP']:.3f}, segm AP {final['val/segm_AP']:.3f}")
    assert final["val/bbox_AP"] > 0.05 and final["val/segm_AP"] > 0.05
