"""The batched form's stacking tools: N stacked optimizers step as N separate ones."""

from __future__ import annotations

import torch

from edge_client.train.batched import StackedAdam, select_rows, stacked, write_back
from models.optim import Adam


def test_stacked_adam_steps_each_row_as_its_own_adam() -> None:
    torch.manual_seed(0)
    modules = [torch.nn.Linear(3, 2) for _ in range(3)]
    separate = [torch.nn.Linear(3, 2) for _ in range(3)]
    for module, twin in zip(modules, separate, strict=True):
        twin.load_state_dict(module.state_dict())
    names = [n for n, _ in modules[0].named_parameters()]
    optimizers = [Adam(m.parameters(), lr=0.1) for m in modules]
    twins = [Adam(m.parameters(), lr=0.1) for m in separate]
    cpu = torch.device("cpu")
    params = stacked(modules, names, cpu)
    adam = StackedAdam(optimizers, names, cpu)
    # every row steps, then rows 0 and 2 only
    for index in (None, torch.tensor([0, 2])):
        rows = [0, 1, 2] if index is None else [0, 2]
        grads = {n: torch.randn(len(rows), *params[n].shape[1:]) for n in names}
        chosen = select_rows(index, params)
        adam.update(chosen, grads, index)
        if index is not None:
            for name, value in chosen.items():
                params[name][index] = value
        for j, i in enumerate(rows):
            for k, p in enumerate(separate[i].parameters()):
                p.grad = grads[names[k]][j].clone()
            twins[i].step()
    write_back(modules, params)
    adam.write_back()

    for module, twin, optimizer, reference in zip(
        modules, separate, optimizers, twins, strict=True
    ):
        for p, q in zip(module.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q)
        assert optimizer.steps == reference.steps
        for a, b in zip(optimizer.exp_avg_sq, reference.exp_avg_sq, strict=True):
            torch.testing.assert_close(a, b)
