"""The catalogue of workloads a job may name: the tasks shipped in `examples/`. Each entry's
metadata, hyperparameter schema and epoch size are available without torch; the task module is
imported only inside a worker."""

from __future__ import annotations

from typing import Any

from elastic.workloads.api import WorkloadInfo, example_module

DIGITS_SAMPLES = 1797
"""Images in scikit-learn's bundled digits data set."""
DIGITS_TRAIN_SAMPLES = 1437
"""The training split is the first 1437 images (80%); the rest is held out."""

_digits = example_module("digits", "hyperparameters")
_chars = example_module("chars", "hyperparameters")
_corpus = example_module("chars", "corpus")


def _digits_train_samples(hyperparameters: object) -> int:
    return DIGITS_TRAIN_SAMPLES


def _char_windows(hyperparameters: Any) -> int:
    return int(_corpus.window_count(hyperparameters.block_size))


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
            directory="digits",
            entrypoint="task:DigitsMLP",
            hyperparameters=_digits.DigitsMLPHyperparameters,
            samples_per_epoch=_digits_train_samples,
        ),
        WorkloadInfo(
            name="digits-cnn",
            title="Digits CNN",
            description=(
                "A small convolutional network with batch norm and dropout on scikit-learn's "
                "bundled 8x8 handwritten digits (1,437 training images)."
            ),
            directory="digits",
            entrypoint="task:DigitsCNN",
            hyperparameters=_digits.DigitsCNNHyperparameters,
            samples_per_epoch=_digits_train_samples,
        ),
        WorkloadInfo(
            name="char-transformer",
            title="Character transformer",
            description=(
                "A small causal transformer language model over characters, trained on the "
                "source of a few Python standard-library modules."
            ),
            directory="chars",
            entrypoint="task:CharLanguageModel",
            hyperparameters=_chars.CharTransformerHyperparameters,
            samples_per_epoch=_char_windows,
        ),
    )
}
