"""models.optim against torch.optim: the same steps within float rounding."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from models import build_classifier
from models.optim import SGD, Adam, adam_update_, sgd_update_


def _train(model: nn.Module, optimizer: object, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 1, 28, 28, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        optimizer.zero_grad()  # type: ignore[attr-defined]
        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()  # type: ignore[attr-defined]
    return [p.detach().clone() for p in model.parameters()]


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = build_classifier("lenet5", num_classes=10, in_channels=1, image_size=28)
    twin = build_classifier("lenet5", num_classes=10, in_channels=1, image_size=28)
    twin.load_state_dict(model.state_dict())
    return model, twin


@pytest.mark.parametrize(
    ("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.9, 5e-4), (0.0, 1e-3)]
)
def test_sgd_takes_torch_optim_sgd_steps(momentum: float, weight_decay: float) -> None:
    model, twin = _pair()
    ours = SGD(model.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    theirs = torch.optim.SGD(
        twin.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay
    )

    got, want = _train(model, ours, 20), _train(twin, theirs, 20)

    start = _pair()[0]
    assert any(not torch.equal(a, b) for a, b in zip(got, start.parameters(), strict=True))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adam_takes_torch_optim_adam_steps() -> None:
    model, twin = _pair()
    ours = Adam(model.parameters(), lr=3e-3, betas=(0.5, 0.99))
    theirs = torch.optim.Adam(twin.parameters(), lr=3e-3, betas=(0.5, 0.99))

    got, want = _train(model, ours, 30), _train(twin, theirs, 30)

    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours.steps == [30] * len(ours.params)
    for ours_m, p in zip(ours.exp_avg, twin.parameters(), strict=True):
        torch.testing.assert_close(ours_m, theirs.state[p]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_a_parameter_without_a_gradient_is_left_alone() -> None:
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    optimizer = Adam([a, b], lr=0.1)
    a.grad = torch.ones(3)

    optimizer.step()

    assert optimizer.steps == [1, 0]
    assert torch.equal(b.detach(), torch.ones(3)) and not torch.equal(a.detach(), torch.ones(3))


def test_stacked_updates_are_each_rows_own_update() -> None:
    """A cohort's stacked tensors step as N separate optimizers, each with its own count."""
    gen = torch.Generator().manual_seed(0)
    params, grads = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    m, v = torch.rand(3, 4, 5, generator=gen), torch.rand(3, 4, 5, generator=gen)
    steps = torch.tensor([1.0, 4.0, 9.0])
    rows = [(params[i].clone(), m[i].clone(), v[i].clone()) for i in range(3)]
    buf = m.clone()
    sgd_rows = [(params[i].clone(), buf[i].clone()) for i in range(3)]

    adam_update_(params, grads, m, v, steps.view(3, 1, 1), lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    stacked = torch.stack([p for p, _ in sgd_rows])
    sgd_update_(stacked, grads, buf, lr=0.1, momentum=0.9, weight_decay=1e-2)

    for i, (p, mi, vi) in enumerate(rows):
        adam_update_(p, grads[i], mi, vi, float(steps[i]), lr=0.01, betas=(0.9, 0.999), eps=1e-8)
        torch.testing.assert_close(params[i], p)
        torch.testing.assert_close(m[i], mi)
        p_sgd, b_sgd = sgd_rows[i]
        sgd_update_(p_sgd, grads[i], b_sgd, lr=0.1, momentum=0.9, weight_decay=1e-2)
        torch.testing.assert_close(stacked[i], p_sgd)
        torch.testing.assert_close(buf[i], b_sgd)


def test_stepping_and_the_memory_check_do_not_import_torchs_compiler() -> None:
    """What the module is for: torch.optim imports torch._dynamo (seconds, tens of MB).

    The device's start-time memory check (and the sim's cohort sizing) is on the same
    path: an estimate run on the meta device imports it too (torch._refs).
    """
    code = (
        "import sys, torch\n"
        "from models import build_classifier\n"
        "from models.optim import SGD, Adam\n"
        "from edge_client.train.resources import check_memory, estimate_training\n"
        "p = torch.zeros(2, requires_grad=True)\n"
        "for opt in (SGD([p], lr=0.1, momentum=0.9), Adam([p], lr=0.1)):\n"
        "    p.grad = torch.ones(2); opt.step()\n"
        "for name in ('lenet5', 'resnet8'):\n"
        "    model = build_classifier(name)\n"
        "    check_memory(estimate_training(model, model.input_shape, 64), budget_bytes=2**40)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
