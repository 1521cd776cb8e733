"""Example Flax model plug-ins (issue 26 items 2 and 4); needs the optional extra: pip install 'shuffledp[jax]'.

    [model]
    module = "shuffledp.models.examples.flax_models:cnn"   # or ":mlp"
    [model.args]
    channels = [8, 16]
    hidden = 32

cnn: two 3x3 convolutions (relu, 2x2 average pooling) and two dense layers over 28x28 grey images (MNIST: 26,698
parameters with the defaults above); mlp: dense layers only. Neither has batch norm: every per-user gradient
depends on that user's examples only. Copy this file into your own package to bring your own model.
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import linen as nn

from shuffledp.models import model_factory
from shuffledp.models.flax_adapter import FlaxModel, softmax_cross_entropy


class CNN(nn.Module):
    channels: Sequence[int] = (8, 16)
    hidden: int = 32
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        for c in self.channels:
            x = nn.relu(nn.Conv(c, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_classes)(x)


class MLP(nn.Module):
    widths: Sequence[int] = (32,)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        for w in self.widths:
            x = nn.tanh(nn.Dense(w)(x))
        return nn.Dense(self.num_classes)(x)


@model_factory
def cnn(
    num_features: int,
    num_classes: int,
    *,
    channels: Sequence[int] = (8, 16),
    hidden: int = 32,
    image_shape: Sequence[int] = (28, 28, 1),
    seed: int = 0,
) -> FlaxModel:
    """The CNN over images of image_shape (height, width, channels), flattened row-major in the data."""
    module = CNN(channels=tuple(channels), hidden=int(hidden), num_classes=num_classes)
    return FlaxModel(
        module,
        softmax_cross_entropy,
        num_features=num_features,
        num_classes=num_classes,
        input_shape=tuple(image_shape),
        seed=seed,
        per_user="scan",  # XLA CPU: a vmapped convolution's weight gradient is far slower (flax_model docstring)
    )


@model_factory
def mlp(num_features: int, num_classes: int, *, widths: Sequence[int] = (32,), seed: int = 0) -> FlaxModel:
    """Dense tanh layers of the given widths, then a dense layer to the classes."""
    module = MLP(widths=tuple(widths), num_classes=num_classes)
    return FlaxModel(module, softmax_cross_entropy, num_features=num_features, num_classes=num_classes, seed=seed)
