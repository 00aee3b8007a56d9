"""``data.train_fraction``: a seeded, class-stratified share of the training images, on the digits (an
ImageNet-style folder: tests/data/test_imagenet.py); a bad value is one line."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import quick_cfg

from normexp.data import build_classification_data
from normexp.data.loaders import stratified_subset
from normexp.errors import UserError
from normexp.run import run


def test_a_subset_keeps_each_class_share_and_is_the_same_for_the_same_seed():
    labels = np.repeat([0, 1, 2], [100, 50, 10])
    subset = stratified_subset(labels, 0.3, seed=1)
    assert Counter(labels[subset].tolist()) == {0: 30, 1: 15, 2: 3}
    assert np.array_equal(subset, stratified_subset(labels, 0.3, seed=1))
    assert not np.array_equal(subset, stratified_subset(labels, 0.3, seed=2))
    assert Counter(labels[stratified_subset(labels, 0.01, seed=1)].tolist()) == {0: 1, 1: 1, 2: 1}  # >= 1
    assert np.array_equal(stratified_subset(labels, 1.0, seed=1), np.arange(len(labels)))


def test_the_digits_train_on_their_subset_and_validate_on_every_image():
    whole = build_classification_data(quick_cfg().data, seed=0, eval_train=True)
    part = build_classification_data(quick_cfg("data.train_fraction=0.1").data, seed=0, eval_train=True)
    labels = whole.train.dataset.tensors[1].numpy()
    kept = part.train.dataset.tensors[1].numpy()
    assert len(kept) == sum(round(0.1 * n) for n in np.bincount(labels))
    assert np.abs(np.bincount(kept) / len(kept) - np.bincount(labels) / len(labels)).max() < 0.01
    assert len(part.train_eval.dataset) == len(kept)  # the training set is the subset, evaluated too
    assert len(part.val.dataset) == len(whole.val.dataset)
    # the inputs are standardised with the whole split's statistics: the subset's images are the same tensors
    images = {tuple(x.flatten()[:20].tolist()) for x in whole.train.dataset.tensors[0]}
    assert all(tuple(x.flatten()[:20].tolist()) in images for x in part.train.dataset.tensors[0][:10])


@pytest.mark.parametrize("value", ["0.0", "1.5"])
def test_a_bad_fraction_is_one_line(tmp_path, value):
    with pytest.raises(UserError, match=rf"^data.train_fraction={value}: must be") as error:
        run(quick_cfg(f"data.train_fraction={value}"), tmp_path / "run")
    assert "\n" not in str(error.value) and not (tmp_path / "run").exists()
