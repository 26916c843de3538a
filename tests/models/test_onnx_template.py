"""ONNX templates (export_template): names, metadata, int8 settings and refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from models import Classifier, ModelError, build_classifier, classifier_names
from models.onnx_export import (
    INPUT_NAME,
    OUTPUT_NAME,
    TEMPLATE_INT8_SCHEME,
    export_onnx,
    export_template,
)

# Small inputs and resnet8 at its FedDF widths keep the suite fast (lenet5 needs 28 or 32).
SMALL_OPTIONS: dict[str, dict[str, object]] = {
    "resnet8": {"widths": (16, 32, 64), "image_size": 16},
    "mlp": {"image_size": 16},
    "fedgen_cnn": {"image_size": 16},
}
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}


def _build(name: str, seed: int) -> Classifier:
    torch.manual_seed(seed)
    return build_classifier(name, **SMALL_OPTIONS.get(name, {}))


def _metadata(proto: onnx.ModelProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in proto.metadata_props}


def _images(model: Classifier, batch: int = 32) -> np.ndarray:
    return np.random.default_rng(0).random((batch, *model.input_shape), dtype=np.float32)


def _logits(data: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {INPUT_NAME: x})[0])


@pytest.fixture(scope="module", params=classifier_names())
def model(request: pytest.FixtureRequest) -> Classifier:
    return _build(request.param, seed=0)


@pytest.fixture(scope="module")
def templates(model: Classifier) -> dict[str, bytes]:
    return {
        precision: export_template(
            model, model.input_shape, precision=precision, model_name=model.architecture
        )
        for precision in ("fp32", "int8")
    }


def test_fp32_template_keeps_every_weight_under_its_state_dict_name(
    model: Classifier, templates: dict[str, bytes]
) -> None:
    proto = onnx.load_from_string(templates["fp32"])
    onnx.checker.check_model(proto, full_check=True)

    state = model.state_dict()
    floats = {
        t.name: numpy_helper.to_array(t)
        for t in proto.graph.initializer
        if t.data_type in FLOAT_TYPES
    }
    assert set(floats) == {k for k, v in state.items() if v.is_floating_point()}
    for name, array in floats.items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, state[name].numpy(), err_msg=name)
    assert [i.name for i in proto.graph.input] == [INPUT_NAME]
    assert [o.name for o in proto.graph.output] == [OUTPUT_NAME]
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param != ""
    assert _metadata(proto) == {
        "edgefl.template": "1",
        "edgefl.precision": "fp32",
        "edgefl.model": model.architecture,
    }


def test_fp32_template_computes_what_export_onnx_computes(
    model: Classifier, templates: dict[str, bytes]
) -> None:
    x = _images(model)

    expected = _logits(export_onnx(model, model.input_shape), x)

    np.testing.assert_allclose(_logits(templates["fp32"], x), expected, atol=1e-5, rtol=0)


def test_int8_template_quantizes_conv_and_linear_weights_dynamically(
    model: Classifier, templates: dict[str, bytes]
) -> None:
    proto = onnx.load_from_string(templates["int8"])
    onnx.checker.check_model(proto, full_check=True)
    tensors = {t.name: t for t in proto.graph.initializer}
    ops = {node.op_type for node in proto.graph.node}
    meta = _metadata(proto)

    assert meta["edgefl.precision"] == "int8"
    assert meta["edgefl.quantization"] == TEMPLATE_INT8_SCHEME
    assert "DynamicQuantizeLinear" in ops and "MatMulInteger" in ops
    assert "Gemm" not in ops  # every nn.Linear became MatMulInteger
    assert not ops & {"QuantizeLinear", "DequantizeLinear"}  # no calibrated activations
    transposed = json.loads(meta["edgefl.transposed"])
    linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(transposed) == {f"{n}.weight" for n in linear}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Conv2d | nn.Linear):
            continue
        q = tensors[f"{name}.weight_quantized"]
        scale = numpy_helper.to_array(tensors[f"{name}.weight_scale"])
        zero_point = numpy_helper.to_array(tensors[f"{name}.weight_zero_point"])
        assert q.data_type == onnx.TensorProto.INT8
        assert not zero_point.any()  # symmetric
        if isinstance(module, nn.Linear):  # stored transposed, one scale per output
            assert tuple(q.dims) == tuple(module.weight.shape[::-1])
            assert scale.shape == (module.out_features,)
        else:  # ConvInteger: per tensor whatever per_channel says
            assert tuple(q.dims) == tuple(module.weight.shape)
            assert scale.shape == ()
        if module.bias is not None:
            assert tensors[f"{name}.bias"].data_type == onnx.TensorProto.FLOAT


def test_int8_template_runs_on_the_cpu_provider_and_agrees_with_fp32(
    model: Classifier, templates: dict[str, bytes]
) -> None:
    x = _images(model, batch=64)

    fp32, int8 = _logits(templates["fp32"], x), _logits(templates["int8"], x)

    assert int8.shape == fp32.shape
    assert np.mean(fp32.argmax(axis=1) == int8.argmax(axis=1)) >= 0.9


def test_template_export_leaves_the_model_unchanged(model: Classifier) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()

    export_template(model, model.input_shape, precision="int8")

    assert model.training
    model.eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_lenet5_template_sizes() -> None:
    model = _build("lenet5", seed=0)

    fp32 = export_template(model, model.input_shape, precision="fp32")
    int8 = export_template(model, model.input_shape, precision="int8")

    params = sum(p.numel() for p in model.parameters())
    assert 4 * params < len(fp32) < 4 * params + 32_000
    assert len(int8) < len(fp32) / 3


def test_equal_weights_are_not_merged_into_one_initializer() -> None:
    # Fresh GroupNorm weights are all ones: the exporter's default de-duplication would
    # keep one of them and drop the others' names.
    model = _build("resnet8", seed=0)
    norms = [k for k in model.state_dict() if ".norm" in k and k.endswith(".weight")]
    assert len(norms) > 1

    proto = onnx.load_from_string(export_template(model, model.input_shape))

    assert set(norms) <= {t.name for t in proto.graph.initializer}


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.spare = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))  # type: ignore[no-any-return]


class _FloatConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("offset", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1) + self.offset)  # type: ignore[no-any-return]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x.flatten(1)))  # type: ignore[no-any-return]


class _Double(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1).double()).float()  # type: ignore[no-any-return]


class _NoWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1) * self.scale


@pytest.mark.parametrize(
    ("module", "precision", "message"),
    [
        (_Unused(), "fp32", r"spare\.weight.*not initializers"),
        (_Double(), "fp32", r"'fc\.weight' is DOUBLE"),
        (_NoWeights(), "int8", r"no Conv or Linear weight"),
    ],
)
def test_models_a_template_cannot_represent_are_refused(
    module: nn.Module, precision: str, message: str
) -> None:
    with pytest.raises(ModelError, match=message):
        export_template(module, (1, 2, 2), precision=precision)  # type: ignore[arg-type]


def test_constants_that_are_not_state_dict_tensors_stay_graph_constants() -> None:
    module = _FloatConstant()
    x = np.random.default_rng(0).random((3, 1, 2, 2), dtype=np.float32)

    data = export_template(module, (1, 2, 2))

    names = {t.name for t in onnx.load_from_string(data).graph.initializer}
    assert names == {"fc.weight", "fc.bias"}  # the buffer is a Constant node
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(_logits(data, x), expected, atol=1e-6)


def test_tied_weights_need_one_initializer_and_no_int8() -> None:
    module = _Tied()
    x = np.random.default_rng(0).random((3, 1, 2, 2), dtype=np.float32)

    data = export_template(module, (1, 2, 2))

    names = {t.name for t in onnx.load_from_string(data).graph.initializer}
    assert names == {"a.weight", "a.bias", "b.bias"}
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(_logits(data, x), expected, atol=1e-6)
    # quantize_dynamic would transpose the shared Gemm weight twice: refused.
    with pytest.raises(ModelError, match=r"'a\.weight' is used by 2 nodes"):
        export_template(module, (1, 2, 2), precision="int8")


def test_invalid_arguments_are_refused() -> None:
    model = _build("lenet5", seed=0)

    with pytest.raises(ModelError, match="precision"):
        export_template(model, model.input_shape, precision="int4")  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="input_shape"):
        export_template(model, (1, 28))  # type: ignore[arg-type]
