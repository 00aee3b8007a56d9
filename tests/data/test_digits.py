from __future__ import annotations

import numpy as np
from conftest import compose_cfg

from normexp.data import build_classification_data
from normexp.data.digits import digits_arrays


def test_digits_are_the_real_sklearn_set_with_a_fixed_stratified_split():
    a = digits_arrays(img_size=32, val_fraction=0.2, split_seed=0)
    assert a["train_images"].shape[1:] == (32, 32)
    assert len(a["train_images"]) + len(a["val_images"]) == 1797
    assert len(a["val_images"]) == 360
    assert set(np.unique(a["val_labels"])) == set(range(10))
    b = digits_arrays(img_size=32, val_fraction=0.2, split_seed=0)
    assert np.array_equal(a["val_images"], b["val_images"])


def test_loaders_give_rgb_batches_at_the_configured_size():
    cfg = compose_cfg("data.img_size=24")
    data = build_classification_data(cfg.data, seed=0)
    images, labels = next(iter(data.train))
    assert images.shape == (64, 3, 24, 24) and labels.dtype.is_floating_point is False
    assert data.num_classes == 10 and len(data.train) == 1437 // 64  # full batches only
