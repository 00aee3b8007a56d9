"""task=dit: a DiT run on the digits (training, class-balanced sampling in shards, the digits stand-in's
Frechet distance), sampling that continues from its finished shards, scoring a finished run on its own, the
Frechet distance and Inception Score against their formulas, ADM's crop, the VAE's latents, and bad input in
one line. Killed processes: tests/tasks/test_pretraining_processes.py."""

from __future__ import annotations

import contextlib
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.linalg
import torch
from conftest import quick_cfg
from omegaconf import open_dict
from PIL import Image
from torch.utils.data import TensorDataset

from normexp.analysis.core import analyse, load_run
from normexp.data.images import center_crop_arr
from normexp.data.loaders import default_cache_dir, make_loader
from normexp.diffusion import GaussianDiffusion
from normexp.errors import UserError
from normexp.metrics.fid import frechet_distance, inception_score, load_reference, statistics
from normexp.models import build_backbone
from normexp.models.features import DigitsFeatures, InceptionFeatures, as_uint8
from normexp.models.vae import LatentCodec, random_sd_vae
from normexp.run import run
from normexp.tasks import dit as dit_task
from normexp.tasks import dit_sampling
from normexp.tracking.records import read_config, read_metrics


def dit_cfg(*overrides: str, epochs: int = 2):
    """The DiT demo at the digits' 8 px (16 tokens), 40 samples in two shards of 10-step sampling."""
    return quick_cfg("task=dit", "task.fid.samples=40", "task.fid.batch_size=20", "task.sampling_steps=10",
                     "task.grid_per_class=2", *overrides, epochs=epochs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-epoch DiT run with DyT (DyT's recipe: no zero-init) and its evaluation-mode training loss: (its
    summary, its directory)."""
    run_dir = tmp_path_factory.mktemp("dit") / "run"
    return run(dit_cfg("norm=dyt", "task.eval_train_loss=true"), run_dir), run_dir


# ---------------------------------------------------------------- a run
def test_a_run_trains_samples_and_scores_its_ema_model(trained):
    summary, run_dir = trained
    assert summary["status"] == "completed"
    assert read_config(run_dir)["backbone"]["zero_init"] == "none"  # DyT's recipe, suggested by norm=dyt
    reported = summary["metrics"]["reported"]
    assert reported["weights"] == "ema" and set(reported) >= {"loss", "fd_digits", "class_top1"}
    assert reported["fd_digits"] > 0 and 0 <= reported["class_top1"] <= 100
    assert summary["metrics"]["final"]["ema/val/fd_digits"] == reported["fd_digits"]
    assert "fid" not in reported  # the stand-in is never called FID
    assert [r["epoch"] for r in read_metrics(run_dir) if "val/loss" in r] == [2]  # eval_interval 10: the last
    assert sorted(p.name for p in (run_dir / "shards").iterdir()) == ["shard-00000.npz", "shard-00001.npz"]
    shard = np.load(run_dir / "shards" / "shard-00001.npz")
    assert shard["labels"].tolist() == [i % 10 for i in range(20, 40)]  # class-balanced
    assert shard["features"].shape == (20, DigitsFeatures.dims) and "samples" not in shard.files
    assert (run_dir / "samples" / "epoch_0002.png").is_file()


def test_the_evaluation_mode_training_loss_is_the_diffusion_loss_on_100_batches(trained, monkeypatch):
    """Derf's App. E: the diffusion loss (MSE and, with a learned variance, the bound) of each model in eval
    mode on the first 100 training batches."""
    summary, run_dir = trained
    final = summary["metrics"]["final"]
    for prefix in ("train_eval", "ema/train_eval"):
        assert final[f"{prefix}/loss"] > final[f"{prefix}/mse"] > 0  # learn_sigma: the bound is added
    assert summary["metrics"]["reported"]["train_eval_loss"] == final["ema/train_eval/mse"]  # App. E's MSE
    seen = []
    monkeypatch.setattr(dit_task.DiTTrainer, "diffusion_loss",
                        lambda self, model, batches, generator: seen.append(len(list(batches))) or {})
    trainer = dit_task.DiTTrainer.__new__(dit_task.DiTTrainer)  # only what evaluate_train reads
    batches = make_loader(TensorDataset(torch.zeros(130)), 1, True, 0, 0)
    trainer.seed, trainer.data = 0, SimpleNamespace(train=batches)
    trainer.evaluate_train(None, "train_eval")
    assert seen == [dit_task.FIT_BATCHES] == [100]  # the first 100 training batches


def test_the_diffusion_loss_in_eval_mode_against_a_direct_computation():
    """Each batch noised at steps and with noise drawn in turn from the generator; the model in eval mode (DiT
    drops class labels only in training); the MSE of its epsilon and the loss averaged over the images."""
    cfg = dit_cfg()
    torch.manual_seed(0)
    model = build_backbone(cfg.backbone, cfg.norm)
    diffusion = GaussianDiffusion.create(1000, learn_sigma=model.learn_sigma)
    batches = [(torch.randn(5, 3, 8, 8), torch.randint(0, 10, (5,))) for _ in range(3)]
    trainer = dit_task.DiTTrainer.__new__(dit_task.DiTTrainer)  # only what diffusion_loss reads
    trainer.device, trainer.codec, trainer.diffusion = torch.device("cpu"), None, diffusion
    trainer.precision = SimpleNamespace(autocast=contextlib.nullcontext)
    scores = trainer.diffusion_loss(model, batches, torch.Generator().manual_seed(7))
    assert model.training  # back in training mode

    generator, mse, loss = torch.Generator().manual_seed(7), [], []
    model.eval()
    with torch.no_grad():
        for x, y in batches:
            t = torch.randint(0, 1000, (len(x),), generator=generator)
            noise = torch.randn(x.shape, generator=generator)
            a = torch.tensor(diffusion.alphas_cumprod, dtype=torch.float64)[t].float().view(-1, 1, 1, 1)
            eps, _ = model(a.sqrt() * x + (1 - a).sqrt() * noise, t, y).split(3, dim=1)
            mse.append(((eps - noise) ** 2).mean(dim=(1, 2, 3)))
            loss.append(diffusion.training_losses(model, x, t, noise, y=y)["loss"])
    assert scores["mse"] == pytest.approx(float(torch.cat(mse).mean()), rel=1e-5)
    assert scores["loss"] == pytest.approx(float(torch.cat(loss).mean()), rel=1e-5)
    assert scores["loss"] > scores["mse"]  # learned variance: the bound is added


def test_a_dit_without_learned_variance_trains_and_counts_its_parameters_as_dit(tmp_path):
    """backbone.learn_sigma=false trains with DiT's fixed variance; params counts the fixed position table
    (as DiT's train.py prints), trainable_params not."""
    summary = run(dit_cfg("backbone.learn_sigma=false", epochs=1), tmp_path / "run")
    assert summary["status"] == "completed" and summary["metrics"]["reported"]["fd_digits"] > 0
    model = build_backbone(dit_cfg("backbone.learn_sigma=false").backbone, {"name": "ln"})
    assert model.final_layer.linear.out_features == model.patch ** 2 * 3  # epsilon only
    assert summary["params"] - summary["trainable_params"] == model.pos_embed.numel() == 16 * 96


def test_reference_adm_is_adms_batch_in_the_cache_and_one_line_where_missing(tmp_path, monkeypatch):
    """task.fid.reference=adm (experiment=dit_imagenet's): ADM's VIRTUAL_imagenet<size>_labeled.npz, found in
    the reference cache; missing, one line naming the file and where ADM publishes it."""
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    cfg = dit_cfg("task.fid.reference=adm", "task.fid.features=inception")
    with pytest.raises(UserError) as error:
        dit_sampling.reference_source(cfg)
    message = str(error.value)
    assert "VIRTUAL_imagenet8_labeled.npz" in message and "\n" not in message
    assert "openaipublic.blob.core.windows.net/diffusion/jul-2021/ref_batches/imagenet/8/" in message
    (tmp_path / "VIRTUAL_imagenet8_labeled.npz").write_bytes(b"")
    assert dit_sampling.reference_source(cfg) == str(tmp_path / "VIRTUAL_imagenet8_labeled.npz")
    with pytest.raises(UserError, match="task.fid.reference=adm is ADM's ImageNet batch"):
        dit_sampling.reference_source(dit_cfg("task.fid.reference=adm"))  # the digits' features


def test_sampling_continues_from_its_finished_shards(trained, tmp_path, monkeypatch):
    """A job killed after its first shard: the next one makes only the second, the same numbers."""
    summary, run_dir = trained
    cfg = dit_cfg("norm=dyt")
    folder = tmp_path / "shards"
    folder.mkdir()
    shutil.copy(run_dir / "shards" / "shard-00000.npz", folder)
    (folder / ".shard-00001.npz.123.npz").write_bytes(b"half a shard")  # a writer killed mid-write
    model = build_backbone(cfg.backbone, cfg.norm)
    model.load_state_dict(torch.load(run_dir / "checkpoint.pth", weights_only=True)["ema"])
    made = []
    sampler = dit_sampling.Sampler(model, cfg.task, 10, (3, 8, 8), None, torch.device("cpu"), cfg.seed)
    real = sampler.images
    monkeypatch.setattr(sampler, "images", lambda labels, stream: made.append(stream) or real(labels, stream))
    extractor = dit_sampling.digits_features(cfg.data, default_cache_dir("feature_nets"))
    extractor.requires_grad_(False)
    paths = dit_sampling.generate_shards(sampler, extractor, folder, cfg.task.fid)
    assert made == [1] and not list(folder.glob(".*"))
    original = np.load(run_dir / "shards" / paths[1].name)["features"]
    np.testing.assert_array_equal(np.load(paths[1])["features"], original)


def test_a_finished_run_is_scored_on_its_own_to_the_same_numbers(trained, tmp_path):
    summary, run_dir = trained
    scored = run(dit_cfg(f"task.checkpoint={run_dir}"), tmp_path / "scored")
    assert scored["status"] == "completed"
    assert read_config(tmp_path / "scored")["norm"]["name"] == "dyt"  # the checkpoint's, not the configured
    for key in ("fd_digits", "class_top1"):
        assert scored["metrics"]["reported"][key] == summary["metrics"]["reported"][key]


def test_analyze_feeds_the_trained_dit_its_noised_images(trained):
    """DyT Fig. 2's DiT panel: the model rebuilt from its record (EMA weights), fed seeded validation images
    noised at seeded steps with their labels; its affine-free DyT slots lie on their own tanh(alpha x)."""
    loaded = load_run(trained[1])
    assert loaded.ema and loaded.backbone == "dit_micro"
    first = analyse(loaded, ["io", "alpha"], images=4, io_patterns=["blocks.*.norm1"])
    assert "noised at uniformly drawn diffusion steps" in first.inputs
    assert [n["slot"] for n in first.io_numbers] == [f"blocks.{i}.norm1" for i in range(4)]
    for numbers in first.io_numbers:
        assert numbers["layer"] == "DyT" and numbers["r2"] > 0.9999
        assert numbers["b"] == pytest.approx(numbers["layer_alpha"], rel=1e-3)
    assert len(first.alpha) == 2 * 4 + 1  # norm1, norm2 of 4 blocks and the final layer's norm
    again = analyse(loaded, ["io"], images=4, io_patterns=["blocks.*.norm1"])
    slot = "blocks.3.norm1"  # the same seed: the same images, steps and noise
    np.testing.assert_array_equal(again.io[slot].points["x"], first.io[slot].points["x"])


def test_a_dit_run_is_no_backbone_to_fine_tune(trained, tmp_path):
    with pytest.raises(UserError, match="is a dit run, whose checkpoint holds a diffusion model, no "
                                        "classification backbone to start from: give a run of "
                                        "classification, dino, mae"):
        run(quick_cfg(f"task.pretrained={trained[1]}"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the metrics
def test_frechet_distance_is_zero_for_identical_features_and_the_closed_form_for_two_gaussians():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(500, 8))
    assert abs(frechet_distance(statistics(features), statistics(features))) < 1e-9
    a, b = rng.normal(size=(8, 8)), rng.normal(size=(8, 8))
    first = {"mu": rng.normal(size=8), "sigma": a @ a.T + np.eye(8)}
    second = {"mu": rng.normal(size=8), "sigma": b @ b.T + np.eye(8)}
    root = scipy.linalg.sqrtm(first["sigma"] @ second["sigma"]).real
    closed = float(((first["mu"] - second["mu"]) ** 2).sum()
                   + np.trace(first["sigma"] + second["sigma"] - 2 * root))
    assert frechet_distance(first, second) == pytest.approx(closed, rel=1e-6)


def test_statistics_are_the_mean_and_unbiased_covariance():
    features = np.array([[0.0, 1.0], [2.0, 3.0], [4.0, 8.0]])
    stats = statistics(features)
    np.testing.assert_allclose(stats["mu"], [2.0, 4.0])
    np.testing.assert_allclose(stats["sigma"], np.cov(features.T))


def test_inception_score_of_confident_uniform_classes_is_their_count():
    logits = np.full((1000, 4), -30.0)
    logits[np.arange(1000), np.arange(1000) % 4] = 30.0  # certain of one class each, classes balanced
    mean, std = inception_score(logits, splits=10)
    assert mean == pytest.approx(4.0, rel=1e-4) and std < 1e-4
    assert inception_score(np.zeros((100, 4)), splits=2)[0] == pytest.approx(1.0)
    logits = np.random.default_rng(0).normal(size=(200, 5)) * 3
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    scores = [np.exp((s * np.log(s / s.mean(0))).sum(1).mean()) for s in (p[:100], p[100:])]
    assert inception_score(logits, splits=2) == pytest.approx((np.mean(scores), np.std(scores)), rel=1e-9)


def test_reference_statistics_of_another_resolution_or_size_are_one_line(tmp_path):
    adm = tmp_path / "VIRTUAL_imagenet64_labeled.npz"
    np.savez(adm, arr_0=np.zeros((2, 64, 64, 3), np.uint8), mu=np.zeros(2048), sigma=np.eye(2048))
    assert load_reference(adm, 64, 2048)["mu"].shape == (2048,)
    with pytest.raises(UserError, match="are of 64 px images, the samples of 256 px") as error:
        load_reference(adm, 256, 2048)
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match=r"mu has shape \(2048,\) and sigma \(2048, 2048\), ours \(64,\)"):
        load_reference(adm, 64, 64)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(UserError, match="not reference statistics"):
        load_reference(tmp_path / "other.npz", 64, 2048)


# ---------------------------------------------------------------- data and latents
def test_adms_centre_crop():
    image = Image.new("RGB", (300, 200), (0, 0, 0))
    image.paste((255, 0, 0), (140, 90, 160, 110))  # a red square at the centre
    crop = center_crop_arr(image, 32)  # box-halved to 150x100, bicubic to 48x32, centre 32x32
    assert crop.size == (32, 32)
    pixels = np.asarray(crop)
    assert pixels[16, 16, 0] > 200 and pixels[0, 0, 0] < 10


def test_as_uint8_is_dits_quantisation():
    assert as_uint8(torch.tensor([-1.0, 0.0, 1.0, 2.0])).tolist() == [0, 128, 255, 255]


def test_a_random_weight_sd_vae_round_trips_shapes():
    """The SD VAE's layout (four blocks: 8x down, 4 latent channels) at small widths; no download."""
    torch.manual_seed(0)
    codec = LatentCodec(random_sd_vae(block_out_channels=(8, 16, 16, 16), norm_num_groups=8))
    latents = codec.encode(torch.rand(2, 3, 32, 32) * 2 - 1)
    assert latents.shape == (2, 4, 4, 4)
    assert codec.decode(latents).shape == (2, 3, 32, 32)


@pytest.mark.slow
def test_a_latent_run_denoises_the_vaes_latents_from_a_cache_encoded_once(tmp_path):
    torch.manual_seed(0)
    random_sd_vae(block_out_channels=(8, 16, 16, 16), norm_num_groups=8).save_pretrained(tmp_path / "vae")
    cache = tmp_path / "cache"
    overrides = [f"task.vae={tmp_path / 'vae'}", "data.img_size=16", "task.fid.samples=10",
                 "task.fid.batch_size=10", f"task.latent_cache={cache}", "task.latent_cache_shard=500",
                 "task.hflip=0.5"]
    summary = run(dit_cfg(*overrides, epochs=1), tmp_path / "run")
    assert summary["status"] == "completed"
    backbone = read_config(tmp_path / "run")["backbone"]
    assert backbone["input_size"] == 2 and backbone["in_chans"] == 4
    assert summary["metrics"]["reported"]["fd_digits"] > 0
    (folder,) = cache.iterdir()
    shards = sorted(folder.glob("shard-*.npz"))
    assert len(shards) == 3  # 1,437 training images in shards of 500
    first = np.load(shards[0])
    assert first["moments"].shape == (500, 8, 2, 2) and first["mirrored"].shape == (500, 8, 2, 2)
    assert first["moments"].dtype == np.float16
    # an encoding killed after its first shards continues with the missing one only; a second run reads it
    shards[2].unlink()
    times = {p.name: p.stat().st_mtime_ns for p in shards[:2]}
    assert run(dit_cfg(*overrides, "seed=1", epochs=1), tmp_path / "again")["status"] == "completed"
    assert {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("shard-*.npz"))[:2]} == times
    assert len(list(folder.glob("shard-*.npz"))) == 3
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "img_size": 32}))
    with pytest.raises(UserError, match="holds other latents \\(differs in img_size\\)"):
        run(dit_cfg(*overrides, "seed=2", epochs=1), tmp_path / "third")


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("overrides,message", [
    (["task.vae=/nowhere/vae"], "task.vae=/nowhere/vae: no diffusers AutoencoderKL there"),
    (["task.fid.features=inception", "task.fid.inception_weights=/nowhere/w.pth"],
     "task.fid.inception_weights=/nowhere/w.pth does not exist"),
    (["data.num_classes=5"], "data.num_classes=5, but data=digits has 10 classes"),
    (["task.sampling_steps=2000"], "task.sampling_steps=2000: cannot take 2000 steps"),
    (["task.sampling_steps=0"], "task.sampling_steps=0: '0' keeps no steps"),
    (["backbone=vit_micro"], "backbone=vit_micro serves classification, dense features (for task="),
    (["task.vae=/nowhere/vae", "data.img_size=12"], "data.img_size=12: the VAE needs a multiple of 8"),
    (["task.checkpoint=/nowhere/run"], "no checkpoint at"),
    (["task.latent_cache=/tmp/cache"], "task.latent_cache keeps the VAE's latents: set task.vae too"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, overrides, message):
    with pytest.raises(UserError) as error:
        run(dit_cfg(*overrides), tmp_path / "run")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


def test_a_reference_of_the_wrong_resolution_stops_before_training(tmp_path):
    reference = tmp_path / "ref.npz"
    np.savez(reference, mu=np.zeros(64), sigma=np.eye(64), resolution=32)
    cfg = dit_cfg(f"task.fid.reference={reference}")
    with open_dict(cfg):
        cfg.trainer.epochs = 1
    with pytest.raises(UserError, match="are of 32 px images, the samples of 8 px"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


class RunsCodeWhenUnpickled:
    """A pickle's side effect: unpickling it creates ``marker`` (what a hostile weights file does)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def inception_layout() -> dict[str, torch.Tensor]:
    """Zeros in the layout of torch-fidelity's Inception-v3 (no download: its loading is skipped)."""
    from unittest import mock

    from torch_fidelity import feature_extractor_inceptionv3 as fidelity

    with mock.patch.object(torch.nn.Module, "load_state_dict"), \
            mock.patch.object(fidelity, "load_state_dict_from_url"), torch.device("meta"):
        net = fidelity.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in net.state_dict().items()}


def test_inception_weights_are_read_as_tensors_and_checked_before_training(tmp_path):
    """A pickle with a side effect never runs; a file of other tensors is one line; Inception's layout
    builds the extractor from our safe read."""
    marker, hostile = tmp_path / "ran", tmp_path / "hostile.pth"
    torch.save({"fc.weight": RunsCodeWhenUnpickled(marker)}, hostile)
    other = tmp_path / "other.pth"
    torch.save({"weight": torch.zeros(3)}, other)
    for weights in (hostile, other):
        with pytest.raises(UserError) as error:
            run(dit_cfg("task.fid.features=inception", f"task.fid.inception_weights={weights}"),
                tmp_path / "run")
        assert f"inception_weights={weights} is not torch-fidelity's Inception-v3 weights" in str(error.value)
        assert "weights_only" not in str(error.value)  # torch's advice to unpickle it anyway
        assert "\n" not in str(error.value) and not (tmp_path / "run").exists()
    assert not marker.exists()
    genuine = tmp_path / "inception.pth"
    layout = inception_layout()
    layout["fc.bias"] += 1
    torch.save(layout, genuine)
    extractor = InceptionFeatures(str(genuine))
    assert torch.equal(extractor.net.fc.bias, layout["fc.bias"]) and not marker.exists()


@pytest.mark.parametrize("defect,mu,sigma,message", [
    ("nan", np.full(64, np.nan), np.eye(64), "they hold NaN or infinite values"),
    ("inf", np.zeros(64), np.diag(np.full(64, np.inf)), "they hold NaN or infinite values"),
    ("shape", np.zeros(64), np.eye(63), "mu has shape (64,) and sigma (63, 63), ours (64,) and (64, 64)"),
    ("asymmetric", np.zeros(64), np.eye(64) + np.triu(np.ones((64, 64)), 1), "sigma is not symmetric"),
    ("negative", np.zeros(64), -np.eye(64), "sigma has a negative eigenvalue, -1"),
])
def test_a_reference_that_is_no_mean_and_covariance_stops_before_training(tmp_path, defect, mu, sigma,
                                                                          message):
    reference = tmp_path / f"{defect}.npz"
    np.savez(reference, mu=mu, sigma=sigma, resolution=8)
    with pytest.raises(UserError) as error:
        run(dit_cfg(f"task.fid.reference={reference}"), tmp_path / "run")
    assert f"reference statistics {reference} are no mean and covariance of 64 features ({message})" \
        in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()
