"""ONNX templates (export_template): names, metadata, int8 settings and refusals."""

from __future__ import annotations

import hashlib
import json
import uuid

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import models.onnx_template as onnx_template
from edge_client.errors import OnnxTemplateError
from edge_client.serve.checks import verify_template
from edge_client.serve.template import OnnxTemplate, never_trained
from models import Classifier, ModelError, build_classifier, classifier_names
from models.onnx_export import INPUT_NAME, OUTPUT_NAME, export_onnx
from models.onnx_template import export_template
from protocol.template_meta import EXPORTED_GRAPH
from protocol.template_meta import INT8_SCHEME as TEMPLATE_INT8_SCHEME

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


def _state(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.detach().cpu().numpy() for name, t in model.state_dict().items()}


def _quantized(proto: onnx.ModelProto) -> dict[str, tuple[onnx.TensorProto, ...]]:
    """state_dict name -> (int8 values, scale, zero point), found by structure alone.

    The k-th ConvInteger / MatMulInteger node quantizes the k-th weight of
    edgefl.int8_weights: its inputs 1 and 3 are the values and the zero point; the scale
    is the initializer in the Mul that scales its (Cast) output.
    """
    tensors = {t.name: t for t in proto.graph.initializer}
    producers = {name: node for node in proto.graph.node for name in node.output}
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in proto.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    names = json.loads(_metadata(proto)["edgefl.int8_weights"])
    integer = [n for n in proto.graph.node if n.op_type in ("ConvInteger", "MatMulInteger")]
    assert len(names) == len(integer)
    found: dict[str, tuple[onnx.TensorProto, ...]] = {}
    for name, node in zip(names, integer, strict=True):
        (cast,) = users[node.output[0]]
        (scaled,) = users[cast.output[0]]
        assert (cast.op_type, scaled.op_type) == ("Cast", "Mul")
        (scales_name,) = [i for i in scaled.input if i != cast.output[0]]
        (scale,) = [tensors[i] for i in producers[scales_name].input if i in tensors]
        found[name] = (tensors[node.input[1]], scale, tensors[node.input[3]])
    return found


def _rename(data: bytes, keep: set[str], how: str, seed: int = 0) -> tuple[bytes, dict[str, str]]:
    """``data`` with the initializers and tensors not in ``keep`` renamed (nodes follow).

    ``how="random"``: fresh random names for those initializers, the intermediate
    tensors and the nodes; ``how="shuffled"``: those initializers' names permuted among
    themselves, so a reader that trusted onnxruntime's names (``X_quantized``,
    ``X_scale``, ...) would pick another weight's tensors rather than fail. Returns the
    model and the map old -> new name.
    """
    proto = onnx.load_from_string(data)
    graph = proto.graph
    keep = keep | {v.name for v in graph.input} | {v.name for v in graph.output} | {""}
    old = [t.name for t in graph.initializer if t.name not in keep]
    rng = np.random.default_rng(seed)
    if how == "random":
        old += [o for n in graph.node for o in n.output if o not in keep]
        mapping = {name: f"t{uuid.UUID(bytes=rng.bytes(16)).hex}" for name in old}
        for node in graph.node:
            node.name = f"n{uuid.UUID(bytes=rng.bytes(16)).hex}"
    else:
        mapping = dict(zip(old, rng.permutation(old).tolist(), strict=True))
        assert any(a != b for a, b in mapping.items())
    for tensor in graph.initializer:
        tensor.name = mapping.get(tensor.name, tensor.name)
    for node in graph.node:
        node.input[:] = [mapping.get(name, name) for name in node.input]
        node.output[:] = [mapping.get(name, name) for name in node.output]
    onnx.checker.check_model(proto, full_check=True)
    return proto.SerializeToString(), mapping


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
        "edgefl.exported_graph": hashlib.sha256(proto.graph.SerializeToString()).hexdigest(),
    }


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_template_tells_it_holds_the_weights_it_was_exported_with(
    model: Classifier, templates: dict[str, bytes], precision: str
) -> None:
    """edgefl.exported_graph is the digest of the graph the device reads: the exported
    template is untrained to it, one rendered with other weights is not, and neither
    is a template made before the key existed."""
    data = templates[precision]
    proto = onnx.load_from_string(data)
    weights = {k: v.numpy() + 1.0 for k, v in model.state_dict().items()}
    entries = [(e.key, e.value) for e in proto.metadata_props]
    del proto.metadata_props[:]
    for key, value in entries:
        if key != EXPORTED_GRAPH:
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value

    assert never_trained(data)
    assert not never_trained(OnnxTemplate(data).render(weights))
    assert not never_trained(proto.SerializeToString())


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
    quantized = _quantized(proto)
    layers = {n for n, m in model.named_modules() if isinstance(m, nn.Conv2d | nn.Linear)}
    assert set(quantized) == {f"{n}.weight" for n in layers}
    assert not set(quantized) & set(tensors)  # no float copy left under the fleet name
    for name, module in model.named_modules():
        if not isinstance(module, nn.Conv2d | nn.Linear):
            continue
        q, scale_tensor, zero_point_tensor = quantized[f"{name}.weight"]
        scale = numpy_helper.to_array(scale_tensor)
        zero_point = numpy_helper.to_array(zero_point_tensor)
        assert q.data_type == onnx.TensorProto.INT8
        assert scale.dtype == np.float32 and zero_point.dtype == np.int8
        expected = module.weight.detach().numpy()
        if isinstance(module, nn.Linear):
            expected = expected.T
        dequantized = numpy_helper.to_array(q).astype(np.float32) * scale
        np.testing.assert_allclose(dequantized, expected, rtol=0, atol=0.501 * float(scale.max()))
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


@pytest.mark.parametrize("how", ["random", "shuffled"])
def test_rendering_does_not_rely_on_the_names_onnxruntime_gives_initializers(
    model: Classifier, templates: dict[str, bytes], how: str
) -> None:
    # Every initializer onnxruntime created (int8 weights, scales, zero points, shapes)
    # gets a random name, or another one's name; only the fleet's own names stay.
    torch.manual_seed(1)
    other = type(model)(model.config)  # the fleet's next weights, same architecture
    state = _state(other)
    renamed, mapping = _rename(templates["int8"], set(state), how)
    x = _images(model, batch=64)

    rendered = OnnxTemplate.from_bytes(renamed).render(state)

    # The right weights, bit for bit, in the right places: as quantize_dynamic writes
    # them for the new weights, under the renamed names.
    expected_template = export_template(other, other.input_shape, precision="int8")
    expected = {
        t.name: numpy_helper.to_array(t)
        for t in onnx.load_from_string(expected_template).graph.initializer
    }
    actual = {
        t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(rendered).graph.initializer
    }
    assert set(actual) == {mapping.get(name, name) for name in expected}
    for name, array in expected.items():
        np.testing.assert_array_equal(actual[mapping.get(name, name)], array, err_msg=name)
    # And the rendered model computes what the new fp32 model computes, within int8 error.
    logits = _logits(rendered, x)
    np.testing.assert_allclose(logits, _logits(expected_template, x), rtol=0, atol=1e-5)
    with torch.no_grad():
        fp32 = other.eval()(torch.from_numpy(x)).numpy()
    assert np.mean(logits.argmax(1) == fp32.argmax(1)) >= 0.9
    np.testing.assert_allclose(logits, fp32, rtol=0, atol=0.1 * float(np.abs(fp32).max()))


@pytest.mark.parametrize("how", ["random", "shuffled"])
def test_export_does_not_rely_on_the_names_onnxruntime_gives_initializers(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    model = _build("lenet5", seed=0)
    state = _state(model)
    reference = export_template(model, model.input_shape, precision="int8")
    quantize = onnx_template._quantize_template

    def quantize_then_rename(fp32: onnx.ModelProto) -> onnx.ModelProto:
        # Every name onnxruntime chose changes; the fp32 graph's activations keep theirs
        # (torch's exporter chose them): the export matches each integer node with the
        # fp32 node it replaces by the activations the two read and write.
        ours = set(state) | {name for node in fp32.graph.node for name in node.output}
        data, _ = _rename(quantize(fp32).SerializeToString(), ours, how, seed=3)
        return onnx.load_from_string(data)

    monkeypatch.setattr(onnx_template, "_quantize_template", quantize_then_rename)

    data = export_template(model, model.input_shape, precision="int8")

    meta = _metadata(onnx.load_from_string(data))
    assert (
        meta["edgefl.int8_weights"]
        == _metadata(onnx.load_from_string(reference))["edgefl.int8_weights"]
    )
    x = _images(model)
    np.testing.assert_allclose(_logits(data, x), _logits(reference, x), rtol=0, atol=1e-5)
    assert OnnxTemplate.from_bytes(data).render(state) == data


def _float_state(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's floating state_dict tensors as numpy arrays (what a template holds)."""
    return {
        name: tensor.detach().cpu().numpy()
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point()
    }


def _halve_int8_weights(proto: onnx.ModelProto) -> None:
    """Halve every int8 weight: a quantization other than the device's."""
    for tensor in proto.graph.initializer:
        if tensor.data_type == onnx.TensorProto.INT8 and len(tensor.dims) > 1:
            halved = (numpy_helper.to_array(tensor) // 2).astype(np.int8)
            tensor.CopyFrom(numpy_helper.from_array(halved, tensor.name))


def _drop_casts(proto: onnx.ModelProto) -> None:
    """Turn the Casts after the integer ops into another op: not quantize_dynamic's layout."""
    for node in proto.graph.node:
        if node.op_type == "Cast":
            node.op_type = "Identity"
            del node.attribute[:]


def _extra_float(proto: onnx.ModelProto) -> None:
    proto.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "stray"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_halve_int8_weights, "does not reproduce the template from the model's own weights"),
        (_drop_casts, "not the layout of onnxruntime's quantize_dynamic"),
        (_extra_float, "unexpected float initializer 'stray'"),
    ],
)
def test_a_quantizer_whose_output_the_device_cannot_render_fails_the_export(
    monkeypatch: pytest.MonkeyPatch, change: object, message: str
) -> None:
    # What a future onnxruntime might do differently must fail at export, loudly.
    model = _build("lenet5", seed=0)
    quantize = onnx_template._quantize_template

    def quantize_then_change(fp32: onnx.ModelProto) -> onnx.ModelProto:
        proto = quantize(fp32)
        change(proto)  # type: ignore[operator]
        return proto

    monkeypatch.setattr(onnx_template, "_quantize_template", quantize_then_change)

    with pytest.raises((ModelError, OnnxTemplateError), match=message):
        data = export_template(model, model.input_shape, precision="int8")
        verify_template(data, _float_state(model))


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
        export_template(model, (1, 0, 28))
