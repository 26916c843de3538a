"""Generators: shapes, value range, conditioning on labels, parameter counts, builders,
the sample generator for series and feature vectors (and its stacked form)."""

from __future__ import annotations

import pytest
import torch

from models import (
    ImageGenerator,
    ImageGeneratorConfig,
    LatentGenerator,
    ModelConfigError,
    ModelInputError,
    SampleGenerator,
    SampleGeneratorConfig,
    UnknownModelError,
    build_classifier,
    build_generator,
    build_sample_generator,
    generator_kinds,
    sample_generator_config,
)
from models.stacked import StackedModule


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_generator_kinds() -> None:
    assert generator_kinds() == ("image", "latent", "sample")


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


@pytest.mark.parametrize(
    ("shape", "kind"),
    [
        ((1, 28, 28), ImageGeneratorConfig),
        ((3, 32, 32), ImageGeneratorConfig),
        ((1, 30, 30), SampleGeneratorConfig),  # a side no multiple of 4
        ((3, 32, 16), SampleGeneratorConfig),  # not square
        ((9, 6), SampleGeneratorConfig),  # a series, (T, C)
        ((30,), SampleGeneratorConfig),  # a feature vector
    ],
)
def test_the_generator_for_a_sample_shape_makes_that_shape(
    shape: tuple[int, ...], kind: type[object]
) -> None:
    config = sample_generator_config(shape, noise_dim=16, width=4)
    assert isinstance(config, kind)
    torch.manual_seed(0)
    generator = build_sample_generator(config)
    samples = generator.sample(5)
    assert tuple(samples.shape) == (5, *shape) == (5, *generator.output_shape)
    assert torch.isfinite(samples).all()
    samples.sum().backward()
    assert all(p.grad is not None for p in generator.parameters())


def test_sample_generator_parameter_count_seed_and_unbounded_output() -> None:
    torch.manual_seed(0)
    a = build_generator("sample", sample_shape=(9, 6))
    torch.manual_seed(0)
    b = build_generator("sample", sample_shape=(9, 6))
    assert isinstance(a, SampleGenerator)
    # 100 -> 256 -> 128 -> 54, two BatchNorm1d layers: the count the docstring states
    assert n_params(a) == (100 * 256 + 256) + 2 * 256 + (256 * 128 + 128) + 2 * 128 + (
        128 * 54 + 54
    )
    assert n_params(a) == 66_486
    z = torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    out = a(z)
    torch.testing.assert_close(out, b(z))
    assert out.min() < 0 < out.max()  # standardised samples, not [0, 1] pixels
    with pytest.raises(ModelInputError, match=r"expected z \(B, 100\)"):
        a(torch.zeros(2, 99))
    with pytest.raises(ModelConfigError, match="sample_shape"):
        build_generator("sample", sample_shape=(9, 0))


def test_sample_generator_stacks_as_its_rows_compute() -> None:
    """Its layers all have stacked forms, so FedKF's batched engine runs it batched:
    each row computes what that device's own generator computes."""
    shape = (9, 6)
    rows = []
    for seed in range(3):
        torch.manual_seed(seed)
        rows.append(build_generator("sample", sample_shape=shape, noise_dim=8, width=4))
    stacked_module = StackedModule(rows[0])
    assert not stacked_module.unstackable
    tensors = [dict(r.named_parameters()) | dict(r.named_buffers()) for r in rows]
    state = {name: torch.stack([t[name].detach() for t in tensors]) for name in tensors[0]}
    z = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))
    out = stacked_module(state, z)
    assert tuple(out.shape) == (3, 5, *shape)
    for i, row in enumerate(rows):
        torch.testing.assert_close(out[i], row(z[i]), rtol=1e-5, atol=1e-5)
