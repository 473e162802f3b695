"""The catalogue of workloads a job may name. Each entry's metadata, hyperparameter schema and
epoch size are available without torch; its builder module is imported only inside a worker."""

from __future__ import annotations

from elastic.workloads.api import WorkloadInfo
from elastic.workloads.corpus import window_count
from elastic.workloads.hyperparameters import (
    CharTransformerHyperparameters,
    DigitsCNNHyperparameters,
    DigitsMLPHyperparameters,
)

DIGITS_SAMPLES = 1797
"""Images in scikit-learn's bundled digits data set."""
DIGITS_TRAIN_SAMPLES = 1437
"""The training split is the first 1437 images (80%); the rest is held out."""


def _digits_train_samples(hyperparameters: object) -> int:
    return DIGITS_TRAIN_SAMPLES


def _char_windows(hyperparameters: CharTransformerHyperparameters) -> int:
    return window_count(hyperparameters.block_size)


CATALOGUE: dict[str, WorkloadInfo] = {
    info.name: info
    for info in (
        WorkloadInfo(
            name="digits-mlp",
            title="Digits MLP",
            description=(
                "A one-hidden-layer perceptron classifying scikit-learn's bundled 8x8 "
                "handwritten digits (1,437 training images)."
            ),
            hyperparameters=DigitsMLPHyperparameters,
            samples_per_epoch=_digits_train_samples,
            builder="elastic.workloads.digits:build_mlp",
        ),
        WorkloadInfo(
            name="digits-cnn",
            title="Digits CNN",
            description=(
                "A small convolutional network with batch norm and dropout on scikit-learn's "
                "bundled 8x8 handwritten digits (1,437 training images)."
            ),
            hyperparameters=DigitsCNNHyperparameters,
            samples_per_epoch=_digits_train_samples,
            builder="elastic.workloads.digits:build_cnn",
        ),
        WorkloadInfo(
            name="char-transformer",
            title="Character transformer",
            description=(
                "A small causal transformer language model over characters, trained on the "
                "source of a few Python standard-library modules."
            ),
            hyperparameters=CharTransformerHyperparameters,
            samples_per_epoch=_char_windows,
            builder="elastic.workloads.chars:build_char_transformer",
        ),
    )
}
