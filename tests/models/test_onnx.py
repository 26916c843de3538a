"""ONNX export, parity and int8 quantization of every registry classifier."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import models.onnx_export as onnx_export
from models import Classifier, ModelError, build_classifier, classifier_names
from models.onnx_export import (
    INPUT_NAME,
    OUTPUT_NAME,
    export_onnx,
    onnx_parity,
    quantize_onnx_int8,
    top1_agreement,
)
from sim.datasets import make_synthetic

# resnet8 at its FedDF widths keeps the suite fast; the FedKF widths get one export test.
SMALL_OPTIONS: dict[str, dict[str, object]] = {"resnet8": {"widths": (16, 32, 64)}}


def _random_images(model: Classifier, batch: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.random((batch, *model.input_shape), dtype=np.float32)


@pytest.fixture(scope="module", params=classifier_names())
def exported(request: pytest.FixtureRequest) -> tuple[Classifier, bytes]:
    torch.manual_seed(0)
    model = build_classifier(request.param, **SMALL_OPTIONS.get(request.param, {}))
    return model, export_onnx(model, model.input_shape)


@pytest.fixture(scope="module")
def trained_lenet() -> tuple[Classifier, np.ndarray, np.ndarray]:
    """A lenet5 trained briefly on synthetic data, with held-out images and labels."""
    data = make_synthetic(seed=3, train_samples=1024, test_samples=512)
    torch.manual_seed(0)
    model = build_classifier("lenet5")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y)
    model.train()
    for _ in range(5):  # epochs of 16 steps
        for start in range(0, len(x), 64):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x[start : start + 64]), y[start : start + 64])
            loss.backward()
            optimizer.step()
    assert data.test is not None
    return model, data.test.x, data.test.y


def test_every_registry_classifier_exports_a_valid_model_with_symbolic_batch(
    exported: tuple[Classifier, bytes],
) -> None:
    model, data = exported

    proto = onnx.load_from_string(data)

    onnx.checker.check_model(proto, full_check=True)
    assert [i.name for i in proto.graph.input] == [INPUT_NAME]
    assert [o.name for o in proto.graph.output] == [OUTPUT_NAME]
    in_dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert in_dims[0].dim_param != ""
    assert tuple(d.dim_value for d in in_dims[1:]) == model.input_shape
    out_dims = proto.graph.output[0].type.tensor_type.shape.dim
    assert out_dims[0].dim_param != ""
    assert out_dims[1].dim_value == model.num_classes


@pytest.mark.parametrize("batch", [1, 7])
def test_onnx_logits_match_torch_at_any_batch_size(
    exported: tuple[Classifier, bytes], batch: int
) -> None:
    model, data = exported
    x = _random_images(model, batch, seed=batch)

    diff = onnx_parity(model, data, x)

    assert diff <= 1e-5
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {INPUT_NAME: x})
    assert logits.shape == (batch, model.num_classes)


def test_parity_detects_a_model_that_differs_from_its_export() -> None:
    torch.manual_seed(0)
    model = build_classifier("mlp")
    data = export_onnx(model, model.input_shape)
    with torch.no_grad():
        model.head.bias.add_(1.0)  # the torch model moves on, the export does not

    diff = onnx_parity(model, data, _random_images(model, 3, seed=0))

    assert diff == pytest.approx(1.0, abs=1e-4)


def test_fedkf_width_resnet8_exports_with_parity() -> None:
    torch.manual_seed(0)
    model = build_classifier("resnet8", widths=(64, 128, 256), in_channels=3, image_size=32)

    data = export_onnx(model, model.input_shape)

    assert onnx_parity(model, data, _random_images(model, 2, seed=1)) <= 1e-5


def test_export_restores_training_mode_and_uses_eval_mode() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Dropout(0.9), nn.Linear(4, 3))
    model.train()

    data = export_onnx(model, (1, 2, 2))

    assert model.training
    model.eval()  # dropout off: a traced-in-train-mode graph would not match
    x = np.ones((5, 1, 2, 2), dtype=np.float32)
    assert onnx_parity(model, data, x) <= 1e-6


def test_export_rejects_a_bad_shape_and_wraps_exporter_failures() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))

    with pytest.raises(ModelError, match="input_shape"):
        export_onnx(model, (4, 0, 1))
    with pytest.raises(ModelError, match="export"):
        export_onnx(model, (1, 3, 3))  # 9 features into a Linear(4, ...)


def test_int8_lenet5_is_under_0_3x_fp32_and_agrees_with_it(
    trained_lenet: tuple[Classifier, np.ndarray, np.ndarray],
) -> None:
    model, x_test, y_test = trained_lenet
    fp32 = export_onnx(model, model.input_shape)
    calibration = x_test[:128]

    int8 = quantize_onnx_int8(fp32, calibration)

    assert len(int8) <= 0.3 * len(fp32)
    proto = onnx.load_from_string(int8)
    onnx.checker.check_model(proto)
    ops = {node.op_type for node in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    held_out = x_test[128:]
    fp32_accuracy = np.mean(
        ort.InferenceSession(fp32, providers=["CPUExecutionProvider"])
        .run(None, {INPUT_NAME: held_out})[0]
        .argmax(axis=1)
        == y_test[128:]
    )
    assert fp32_accuracy >= 0.5  # the model learned something: agreement is not trivial
    assert top1_agreement(fp32, int8, held_out) >= 0.97


def test_per_tensor_quantization_is_smaller_than_per_channel(
    trained_lenet: tuple[Classifier, np.ndarray, np.ndarray],
) -> None:
    model, x_test, _ = trained_lenet
    fp32 = export_onnx(model, model.input_shape)

    per_channel = quantize_onnx_int8(fp32, x_test[:64], per_channel=True)
    per_tensor = quantize_onnx_int8(fp32, x_test[:64], per_channel=False)

    assert len(per_tensor) < len(per_channel)
    assert top1_agreement(fp32, per_tensor, x_test[64:]) >= 0.95


def test_top1_agreement_is_low_between_unrelated_models(
    trained_lenet: tuple[Classifier, np.ndarray, np.ndarray],
) -> None:
    model, x_test, _ = trained_lenet
    torch.manual_seed(1)
    untrained = build_classifier("lenet5")

    same = top1_agreement(export_onnx(model, (1, 28, 28)), export_onnx(model, (1, 28, 28)), x_test)
    other = top1_agreement(
        export_onnx(model, (1, 28, 28)), export_onnx(untrained, (1, 28, 28)), x_test
    )

    assert same == 1.0
    assert other < 0.5


def test_quantization_and_agreement_reject_bad_arrays() -> None:
    torch.manual_seed(0)
    model = build_classifier("mlp")
    fp32 = export_onnx(model, model.input_shape)
    uint8_images = np.zeros((4, 1, 28, 28), dtype=np.uint8)

    with pytest.raises(ModelError, match="float32"):
        quantize_onnx_int8(fp32, uint8_images)
    with pytest.raises(ModelError, match="shape"):
        quantize_onnx_int8(fp32, np.zeros((0, 1, 28, 28), dtype=np.float32))
    with pytest.raises(ModelError, match="quantization failed"):
        quantize_onnx_int8(fp32, np.zeros((4, 1, 14, 14), dtype=np.float32))
    with pytest.raises(ModelError, match="not a valid ONNX"):
        quantize_onnx_int8(b"not onnx", np.zeros((4, 1, 28, 28), dtype=np.float32))
    with pytest.raises(ModelError, match="shape"):
        top1_agreement(fp32, fp32, np.zeros(28, dtype=np.float32))


def test_short_activation_names_never_collide_with_kept_names() -> None:
    # The int8 model's activations get short names a0, a1, ...; weights keep the names
    # the exporter and the quantizer gave them, whatever those are.
    helper = onnx.helper
    ones = np.ones((1, 3), dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Add", [INPUT_NAME, "a0"], ["t"]),
            helper.make_node("Relu", ["t"], ["u"]),
            helper.make_node("Add", ["u", "_a1"], ["v"]),
            helper.make_node("Add", ["v", "a1"], [OUTPUT_NAME]),
        ],
        "g",
        [helper.make_tensor_value_info(INPUT_NAME, onnx.TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info(OUTPUT_NAME, onnx.TensorProto.FLOAT, ["batch", 3])],
        [
            onnx.numpy_helper.from_array(ones, "a0"),
            onnx.numpy_helper.from_array(2 * ones, "a1"),
            onnx.numpy_helper.from_array(3 * ones, "_a1"),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.array([[-5.0, 0.0, 1.0]], dtype=np.float32)

    onnx_export._strip_for_deployment(proto)

    onnx.checker.check_model(proto, full_check=True)
    names = [name for node in proto.graph.node for name in node.output]
    assert len(set(names)) == len(names)
    assert not set(names) & {"a0", "a1", "_a1"}
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {INPUT_NAME: x})[0], [[5.0, 6.0, 7.0]])
