"""Generators: shapes, value range, conditioning on labels, parameter counts, builders."""

from __future__ import annotations

import pytest
import torch

from models import (
    ImageGenerator,
    LatentGenerator,
    ModelConfigError,
    ModelInputError,
    UnknownModelError,
    build_classifier,
    build_generator,
    generator_kinds,
)


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_generator_kinds() -> None:
    assert generator_kinds() == ("image", "latent")


def test_latent_generator_defaults_and_parameter_count() -> None:
    generator = build_generator("latent")

    assert isinstance(generator, LatentGenerator)
    assert (generator.noise_dim, generator.num_classes, generator.latent_dim) == (32, 10, 32)
    assert n_params(generator) == 19_744
    assert sum(b.numel() for b in generator.buffers()) == 513


def test_latent_generator_output_shape_matches_classifier_latent() -> None:
    torch.manual_seed(0)
    generator = build_generator("latent")
    classifier = build_classifier("fedgen_cnn")
    y = torch.tensor([0, 3, 9, 3])

    latents = generator(torch.randn(4, 32), y)
    logits = classifier.head(latents)

    assert latents.shape == (4, classifier.latent_dim)
    assert logits.shape == (4, 10)


def test_latent_generator_is_conditional_on_labels() -> None:
    torch.manual_seed(0)
    generator = build_generator("latent").eval()
    eps = torch.randn(1, 32).repeat(3, 1)
    y = torch.tensor([0, 1, 2])

    out = generator(eps, y)

    assert not torch.allclose(out[0], out[1])
    assert not torch.allclose(out[1], out[2])
    torch.testing.assert_close(generator(eps[:1], y[:1]), out[:1])


def test_latent_generator_sample_is_seedable_and_differentiable() -> None:
    torch.manual_seed(0)
    generator = build_generator("latent", noise_dim=8, hidden_dim=16, latent_dim=4)
    y = torch.tensor([1, 2, 3, 4, 5])

    first = generator.sample(y, generator=torch.Generator().manual_seed(7))
    second = generator.sample(y, generator=torch.Generator().manual_seed(7))
    other = generator.sample(y, generator=torch.Generator().manual_seed(8))
    (grad,) = torch.autograd.grad(first.sum(), generator.fc1.weight)

    assert first.shape == (5, 4)
    torch.testing.assert_close(first, second)
    assert not torch.allclose(first, other)
    assert grad.abs().sum() > 0


def test_latent_generator_rejects_mismatched_inputs() -> None:
    generator = build_generator("latent")

    with pytest.raises(ModelInputError):
        generator(torch.randn(4, 16), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ModelInputError):
        generator(torch.randn(4, 32), torch.zeros(4, 1, dtype=torch.int64))
    with pytest.raises(ModelInputError):
        generator.sample(torch.zeros(2, 2, dtype=torch.int64))


@pytest.mark.parametrize(
    ("size", "channels", "expected_params"), [(28, 1, 856_065), (32, 3, 1_051_139)]
)
def test_image_generator_shapes_range_and_parameter_count(
    size: int, channels: int, expected_params: int
) -> None:
    torch.manual_seed(0)
    generator = build_generator("image", image_size=size, channels=channels)
    z = torch.randn(4, 100) * 10  # large noise drives the sigmoid towards its ends

    images = generator(z)

    assert isinstance(generator, ImageGenerator)
    assert n_params(generator) == expected_params
    assert generator.output_shape == (channels, size, size)
    assert images.shape == (4, channels, size, size)
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert images.std() > 0


def test_image_generator_feeds_a_classifier_and_is_seedable() -> None:
    torch.manual_seed(0)
    generator = build_generator("image", image_size=32, channels=3, noise_dim=16)
    classifier = build_classifier("resnet8", in_channels=3, image_size=32)

    images = generator.sample(2, generator=torch.Generator().manual_seed(3))
    again = generator.sample(2, generator=torch.Generator().manual_seed(3))
    classifier(images).logsumexp(dim=1).mean().backward()

    torch.testing.assert_close(images, again)
    assert generator.project.weight.grad is not None


def test_image_generator_rejects_wrong_noise_width() -> None:
    generator = build_generator("image")

    with pytest.raises(ModelInputError):
        generator(torch.randn(2, 99))


def test_build_generator_errors() -> None:
    with pytest.raises(UnknownModelError) as info:
        build_generator("gan")
    assert "latent" in str(info.value) and "image" in str(info.value)

    with pytest.raises(ModelConfigError, match="image_size"):
        build_generator("image", image_size=30)
    with pytest.raises(ModelConfigError, match="depth"):
        build_generator("latent", depth=3)


def test_build_generator_same_seed_same_weights() -> None:
    torch.manual_seed(5)
    first = build_generator("image", device=torch.device("cpu"))
    torch.manual_seed(5)
    second = build_generator("image", device="cpu")

    assert all(
        torch.equal(a, b)
        for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )
