"""edge_client.train.resources: memory limits from fake /proc and cgroup trees, the training
estimate (hand counts, linearity, the model left alone) and the start-time check."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from edge_client.errors import EdgeClientError
from edge_client.train.resources import (
    NO_LIMIT,
    MemoryEstimate,
    MemoryLimit,
    ResourceError,
    check_memory,
    current_rss,
    estimate_training,
    memory_limit,
)
from models import build_classifier, classifier_names

MiB = 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 reports with 4 KiB pages


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fake_proc(
    tmp_path: Path,
    *,
    cgroup: str | None = "0::/system.slice/edgefl.service\n",
    rss_pages: int = 1000,
    available_kb: int | None = 8 * 1024 * 1024,  # 8 GiB
) -> Path:
    proc = tmp_path / "proc"
    write(proc / "self" / "statm", f"5000 {rss_pages} 300 10 0 900 0\n")
    meminfo = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\n"
    if available_kb is not None:
        meminfo += f"MemAvailable:   {available_kb} kB\n"
    write(proc / "meminfo", meminfo + "Buffers:           20000 kB\n")
    if cgroup is not None:
        write(proc / "self" / "cgroup", cgroup)
    return proc


# ------------------------------------------------------------------------ limits


def test_current_rss_reads_statm(tmp_path: Path) -> None:
    assert current_rss(proc=fake_proc(tmp_path, rss_pages=1234)) == 1234 * PAGE


def test_current_rss_of_this_process_is_plausible(tmp_path: Path) -> None:
    assert 10 * MiB < current_rss() < 64 * 1024 * MiB
    # Without statm: the peak from getrusage, still plausible.
    assert 10 * MiB < current_rss(proc=tmp_path / "missing") < 64 * 1024 * MiB


def test_cgroup_v2_limit(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    cg = tmp_path / "cgroup"
    service = write(cg / "system.slice" / "edgefl.service" / "memory.max", f"{256 * MiB}\n")
    write(cg / "system.slice" / "memory.max", "max\n")
    limit = memory_limit(proc=proc, cgroup_root=cg)
    assert limit == MemoryLimit(256 * MiB, f"cgroup memory.max ({service})")


def test_cgroup_v2_max_means_no_limit(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, rss_pages=1000, available_kb=4096)
    cg = tmp_path / "cgroup"
    write(cg / "system.slice" / "edgefl.service" / "memory.max", "max\n")
    write(cg / "system.slice" / "memory.max", "max\n")
    assert memory_limit(proc=proc, cgroup_root=cg) == MemoryLimit(
        1000 * PAGE + 4096 * 1024, "MemAvailable"
    )


def test_cgroup_v2_takes_the_smallest_limit_of_the_parents(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, cgroup="0::/a/b/c\n")
    cg = tmp_path / "cgroup"
    write(cg / "a" / "b" / "c" / "memory.max", "max\n")
    parent = write(cg / "a" / "b" / "memory.max", f"{100 * MiB}\n")
    write(cg / "a" / "memory.max", f"{300 * MiB}\n")
    assert memory_limit(proc=proc, cgroup_root=cg) == MemoryLimit(
        100 * MiB, f"cgroup memory.max ({parent})"
    )


def test_cgroup_v2_path_missing_under_the_mount_uses_the_mount(tmp_path: Path) -> None:
    # A container whose own cgroup is mounted at /sys/fs/cgroup, or a path outside our
    # cgroup namespace ("/../.."), reads the mount's own memory.max.
    cg = tmp_path / "cgroup"
    root = write(cg / "memory.max", f"{64 * MiB}\n")
    for line in ("0::/docker/abc\n", "0::/../../elsewhere\n", "0::/\n"):
        proc = fake_proc(tmp_path, cgroup=line)
        assert memory_limit(proc=proc, cgroup_root=cg) == MemoryLimit(
            64 * MiB, f"cgroup memory.max ({root})"
        )


def test_memavailable_wins_when_smaller_than_the_cgroup_limit(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, rss_pages=10, available_kb=1024)  # about 1 MiB
    cg = tmp_path / "cgroup"
    write(cg / "system.slice" / "edgefl.service" / "memory.max", f"{256 * MiB}\n")
    limit = memory_limit(proc=proc, cgroup_root=cg)
    assert limit == MemoryLimit(10 * PAGE + 1024 * 1024, "MemAvailable")


def test_cgroup_v1_limit_and_hybrid_layout(tmp_path: Path) -> None:
    # Hybrid hierarchy: the memory controller is on v1, the v2 line names "/".
    proc = fake_proc(
        tmp_path,
        cgroup="9:pids:/x\n4:memory:/system.slice/edgefl.service\n1:cpu,cpuacct:/x\n0::/\n",
    )
    cg = tmp_path / "cgroup"
    own = write(
        cg / "memory" / "system.slice" / "edgefl.service" / "memory.limit_in_bytes",
        f"{200 * MiB}\n",
    )
    write(cg / "memory" / "system.slice" / "memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
    write(cg / "memory" / "memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
    write(cg / "unified" / "cgroup.procs", "")
    assert memory_limit(proc=proc, cgroup_root=cg) == MemoryLimit(
        200 * MiB, f"cgroup memory.limit_in_bytes ({own})"
    )


def test_cgroup_v1_parent_limit_and_unlimited_value(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, cgroup="4:memory:/a/b\n", available_kb=None)
    cg = tmp_path / "cgroup"
    write(cg / "memory" / "a" / "b" / "memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
    parent = write(cg / "memory" / "a" / "memory.limit_in_bytes", f"{512 * MiB}\n")
    assert memory_limit(proc=proc, cgroup_root=cg) == MemoryLimit(
        512 * MiB, f"cgroup memory.limit_in_bytes ({parent})"
    )
    parent.write_text(f"{V1_UNLIMITED}\n")
    assert memory_limit(proc=proc, cgroup_root=cg) == MemoryLimit(NO_LIMIT, "none")


def test_missing_or_broken_files_fall_back_without_raising(tmp_path: Path) -> None:
    # Not Linux at all.
    nowhere = memory_limit(proc=tmp_path / "no-proc", cgroup_root=tmp_path / "no-cgroup")
    assert nowhere == MemoryLimit(NO_LIMIT, "none")
    # /proc/self/cgroup present but the cgroup files missing: MemAvailable only.
    proc = fake_proc(tmp_path, rss_pages=5, available_kb=2048)
    assert memory_limit(proc=proc, cgroup_root=tmp_path / "no-cgroup") == MemoryLimit(
        5 * PAGE + 2048 * 1024, "MemAvailable"
    )
    # Garbage everywhere: ignored.
    cg = tmp_path / "cgroup"
    write(cg / "system.slice" / "edgefl.service" / "memory.max", "lots\n")
    write(proc / "self" / "cgroup", "garbage without colons\n0::/system.slice/edgefl.service\n")
    write(proc / "meminfo", "MemAvailable: many kB\n")
    assert memory_limit(proc=proc, cgroup_root=cg) == MemoryLimit(NO_LIMIT, "none")


def test_memory_limit_of_this_machine_does_not_raise() -> None:
    limit = memory_limit()
    assert limit.bytes > 0
    assert limit.source == "none" or limit.source == "MemAvailable" or "cgroup" in limit.source


# ---------------------------------------------------------------------- estimate


def test_estimate_matches_a_hand_count_for_a_small_mlp() -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
    numel = 10 * 20 + 20 + 20 * 3 + 3  # 283
    batch = 7
    estimate = estimate_training(model, (10,), batch)
    assert estimate == MemoryEstimate(
        model="Sequential",
        batch_size=batch,
        parameters=4 * numel,
        gradients=4 * numel,
        optimizer=4 * numel,
        activations=2 * 4 * batch * (20 + 20 + 3),
        model_copies=4 * 4 * numel,
    )
    assert estimate.total == 4 * numel * (1 + 1 + 1 + 4) + 2 * 4 * batch * 43
    # Frozen parameters have no gradient or optimizer state; copies are configurable.
    model[0].requires_grad_(False)
    frozen = estimate_training(model, (10,), batch, model_copies=1, optimizer_slots=2)
    assert frozen.gradients == 4 * (20 * 3 + 3)
    assert frozen.optimizer == 2 * 4 * (20 * 3 + 3)
    assert frozen.model_copies == 4 * numel


def test_estimate_counts_floating_buffers_as_parameters() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    estimate = estimate_training(model, (4,), 3)
    params = 4 * 8 + 8 + 8 + 8  # linear, bn weight and bias
    buffers = 8 + 8  # running mean and var; num_batches_tracked is an integer
    assert estimate.parameters == 4 * (params + buffers)
    assert estimate.gradients == 4 * params
    assert estimate.activations == 2 * 4 * 3 * (8 + 8)


def test_lenet5_parameters_and_gradients_are_four_bytes_per_element() -> None:
    model = build_classifier("lenet5")
    numel = sum(p.numel() for p in model.parameters())
    assert numel == 61_706
    estimate = estimate_training(model, model.input_shape, 64)
    assert estimate.model == "lenet5"
    assert estimate.parameters == estimate.gradients == estimate.optimizer == 4 * numel
    assert estimate.model_copies == 4 * 4 * numel


def test_estimate_grows_linearly_in_the_batch_size() -> None:
    model = build_classifier("lenet5")
    e1, e2, e5 = (estimate_training(model, model.input_shape, b) for b in (1, 2, 5))
    assert e2.activations == 2 * e1.activations
    assert e5.activations == 5 * e1.activations
    fixed = e1.total - e1.activations
    assert e5.total - e1.total == 4 * e1.activations
    assert e5.total - e5.activations == fixed


def test_estimate_is_cheap_at_any_batch_and_leaves_the_model_alone() -> None:
    model = build_classifier("lenet5")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    started = time.perf_counter()
    huge = estimate_training(model, model.input_shape, 1_000_000_000)  # ~ 110 TiB for real
    assert time.perf_counter() - started < 10  # generous; it takes milliseconds
    assert (
        huge.activations
        == 1_000_000_000 * estimate_training(model, model.input_shape, 1).activations
    )
    assert not model.training
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", classifier_names())
def test_one_sample_times_the_batch_is_what_a_real_training_forward_outputs(name: str) -> None:
    """The estimate runs one sample in eval mode; every leaf of the built-in classifiers
    computes each sample on its own, so a training-mode forward of a whole batch has
    exactly that many output elements per leaf."""
    model = build_classifier(name)
    batch = 5
    outputs = 0

    def count(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
        nonlocal outputs
        outputs += output.numel()

    handles = [
        m.register_forward_hook(count) for m in model.modules() if next(m.children(), None) is None
    ]
    model.train()
    with torch.no_grad():
        model(torch.randn(batch, *model.input_shape))
    for handle in handles:
        handle.remove()

    assert estimate_training(model, model.input_shape, batch).activations == 2 * 4 * outputs


def test_estimate_keeps_training_flags_statistics_hooks_and_random_state() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model.train()
    model[2].eval()  # mixed flags come back as they were
    stats = {k: v.clone() for k, v in model[1].state_dict().items()}
    rng = torch.get_rng_state()

    estimate = estimate_training(model, (4,), 3)

    assert estimate.activations == 2 * 4 * 3 * (8 + 8 + 8 + 2)
    assert [m.training for m in model] == [True, True, False, True] and model.training
    for key, value in model[1].state_dict().items():  # running stats, batches tracked
        assert torch.equal(value, stats[key]), key
    assert all(not m._forward_hooks for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_a_failing_forward_still_restores_the_model() -> None:
    model = nn.Sequential(nn.Linear(10, 2), nn.Dropout())
    model.train()
    with pytest.raises(ResourceError, match=r"RuntimeError"):
        estimate_training(model, (11,), 4)
    assert model.training and all(m.training for m in model)
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_estimate_runs_the_sample_where_the_model_is() -> None:
    model = build_classifier("lenet5")
    on_cpu = estimate_training(model, model.input_shape, 64)
    assert estimate_training(model.cuda(), model.input_shape, 64) == on_cpu


@pytest.mark.parametrize("name", classifier_names())
def test_every_registered_classifier_can_be_estimated(name: str) -> None:
    model = build_classifier(name)
    estimate = estimate_training(model, model.input_shape, 32)
    assert estimate.model == name
    assert estimate.activations > 0
    assert estimate.total > estimate.activations


def test_estimate_rejects_bad_arguments_and_unrunnable_models() -> None:
    model = nn.Sequential(nn.Linear(10, 2))
    with pytest.raises(ResourceError, match="batch_size"):
        estimate_training(model, (10,), 0)
    with pytest.raises(ResourceError, match="model_copies"):
        estimate_training(model, (10,), 1, model_copies=-1)
    with pytest.raises(ResourceError, match=r"cannot estimate the activations of Sequential"):
        estimate_training(model, (11,), 4)  # wrong input width


def test_estimated_activations_match_a_real_forward_and_backward() -> None:
    """lenet5 at batch 64: the activations estimate vs the tensors a real step keeps.

    Measured: every tensor autograd saves for backward (unique storages, weights
    excluded), plus the gradients of every leaf module's output.
    """
    torch.manual_seed(0)
    model = build_classifier("lenet5")
    batch = 64
    estimate = estimate_training(model, model.input_shape, batch)

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    output_grads = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def count_grad(grad: torch.Tensor) -> None:
        nonlocal output_grads
        output_grads += grad.numel() * grad.element_size()

    def on_output(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
        output.register_hook(count_grad)  # type: ignore[no-untyped-call]

    handles = [
        m.register_forward_hook(on_output)
        for m in model.modules()
        if next(m.children(), None) is None
    ]
    x = torch.randn(batch, *model.input_shape)
    y = torch.randint(0, model.num_classes, (batch,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    for handle in handles:
        handle.remove()

    measured = sum(saved.values()) + output_grads
    assert sum(saved.values()) > 0 and output_grads > 0
    assert measured / 3 <= estimate.activations <= measured * 3
    # Gradients of the outputs are exactly half of the estimate (float32, same shapes).
    assert output_grads * 2 == estimate.activations


# ------------------------------------------------------------------------- check


def lenet_estimate(batch: int = 64) -> MemoryEstimate:
    model = build_classifier("lenet5")
    return estimate_training(model, model.input_shape, batch)


def test_check_memory_raises_with_the_numbers_and_the_source() -> None:
    estimate = lenet_estimate()
    source = "cgroup memory.max (/sys/fs/cgroup/system.slice/edgefl.service/memory.max)"
    with pytest.raises(ResourceError) as caught:
        check_memory(estimate, limit=MemoryLimit(256 * MiB, source), rss=250 * MiB)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("not enough memory for lenet5 training at batch 64: ")
    needed = (250 * MiB + estimate.total) / MiB
    assert f"needs about {needed:.0f} MiB (RSS 250 MiB now + parameters 0.24 MiB" in message
    assert "activations 7.2 MiB" in message
    assert f"but the limit is 256 MiB ({source})" in message
    assert message.endswith(
        "lower the batch size, use a smaller model or raise MemoryMax in the systemd unit"
    )
    assert isinstance(caught.value, EdgeClientError)
    assert isinstance(caught.value, ValueError)


def test_check_memory_names_memavailable_and_budget() -> None:
    estimate = lenet_estimate()
    with pytest.raises(ResourceError, match=r"^not enough memory for lenet5 FedProx at batch 64"):
        check_memory(estimate, budget_bytes=1, rss=0, what="lenet5 FedProx")
    with pytest.raises(ResourceError, match=r"RSS \+ MemAvailable.*free memory on the device"):
        check_memory(estimate, limit=MemoryLimit(100 * MiB, "MemAvailable"), rss=100 * MiB)
    with pytest.raises(ResourceError, match=r"the limit is 50.0 MiB \(the configured budget\)"):
        check_memory(
            estimate,
            budget_bytes=50 * MiB,
            limit=MemoryLimit(NO_LIMIT, "none"),  # the explicit budget wins
            rss=45 * MiB,
        )


def test_check_memory_passes_when_it_fits() -> None:
    estimate = lenet_estimate()
    check_memory(estimate, budget_bytes=10 * 1024 * MiB)
    check_memory(estimate, limit=MemoryLimit(NO_LIMIT, "none"))
    # The boundary: exactly the budget fits, one byte less does not.
    check_memory(estimate, budget_bytes=100 * MiB + estimate.total, rss=100 * MiB)
    with pytest.raises(ResourceError):
        check_memory(estimate, budget_bytes=100 * MiB + estimate.total - 1, rss=100 * MiB)


def test_check_memory_with_the_real_limit_and_rss() -> None:
    check_memory(lenet_estimate(batch=1))  # this test machine can train lenet5 at batch 1
    with pytest.raises(ResourceError, match="lower the batch size"):
        check_memory(lenet_estimate(batch=10**9))  # about 110 TiB
