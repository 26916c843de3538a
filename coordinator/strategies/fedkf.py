"""FedKF (knowledge distillation and fusion, "Handling Data Heterogeneity in Federated
Learning via Knowledge Distillation and Fusion"): the server keeps the ACA and OCA
models and sends them as the devices' student and teacher; the devices distil through a
local image generator (the device side: :mod:`edge_client.train`). Its fleet settings
(``downlink``, ``teacher_budget``): :mod:`coordinator.strategies.fedkf_settings`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from coordinator.strategies.base import Arrays, Scalar, Strategy
from protocol.sets import STUDENT_SET, TEACHER_SET

__all__ = ["FedKF"]


class FedKF(Strategy):
    """FedKF: ACA + OCA on the server, distillation through a local image generator on
    the devices (the paper's Algorithm 1).

    Downlink ``dual``: ``student`` = ACA, ``teacher`` = OCA (two models, twice FedAvg's
    downlink bytes at the same precision; the teacher travels as a delta against the
    student within ``teacher_budget``). ``single`` (FedKF-): ``student`` only, which
    devices also use as the teacher. Defaults from the paper: E = 10, B = 64; the
    device's cost settings (``generator_every``, ``sample_reuse``, 16 generated samples
    per step) are the runtime's, cheaper than the paper's (docs/modes.md, "FedKF's cost").
    """

    name = "fedkf"
    uses_oca = True
    training_defaults: ClassVar[Mapping[str, int]] = {
        "local_epochs": 10,
        "batch_size": 64,
        "generator_batch_size": 16,
    }
    delta_sets: ClassVar[Mapping[str, str]] = {TEACHER_SET: STUDENT_SET}

    def task_settings(self, round_number: int) -> dict[str, Scalar]:
        t = self.training
        return {
            **super().task_settings(round_number),
            "gamma": t.gamma,
            "lambda1": t.lambda1,
            "lambda2": t.lambda2,
            "generator_lr": t.generator_lr,
            "generator_width": t.generator_width,
            "generator_every": t.generator_every,
            "sample_reuse": t.sample_reuse,
            "generator_batch_size": t.generator_batch_size or 0,
        }

    def downlink(self, models: Mapping[str, Arrays]) -> dict[str, Arrays]:
        if self.config.downlink == "single":
            return {STUDENT_SET: models["aca"]}
        return {STUDENT_SET: models["aca"], TEACHER_SET: models["oca"]}
