"""OnnxTemplate: rendering fleet weights into ONNX templates without torch or onnx.

Real parts throughout: templates come from torch's exporter and onnxruntime's
quantize_dynamic (models.onnx_template.export_template), results are parsed with the
onnx package and run with onnxruntime.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import edge_client.serve.template as onnx_model
from edge_client.errors import EdgeClientError, OnnxTemplateError
from edge_client.serve.checks import verify_template
from edge_client.serve.template import OnnxTemplate
from models import Classifier, ModelError, build_classifier, classifier_names
from models.onnx_export import INPUT_NAME, export_onnx
from models.onnx_template import export_template
from protocol.template_meta import EXPORTED_GRAPH

ROOT = Path(__file__).resolve().parents[3]
# Small inputs and resnet8 at its FedDF widths keep the suite fast (lenet5 needs 28 or 32).
SMALL_OPTIONS: dict[str, dict[str, object]] = {
    "resnet8": {"widths": (16, 32, 64), "image_size": 16},
    "mlp": {"image_size": 16},
    "fedgen_cnn": {"image_size": 16},
}
PRECISIONS = ("fp32", "int8")
# onnxruntime < 1.31 computes a weight's range max - min in float32, which overflows to
# inf for |w| > 1.7e38 (scale inf, every value 0); 1.31 and the device compute it in
# float64. Only the "huge" edge case below tells the two apart.
ORT_FLOAT64_RANGE = tuple(int(part) for part in ort.__version__.split(".")[:2]) >= (1, 31)


def _build(name: str, seed: int) -> Classifier:
    torch.manual_seed(seed)
    return build_classifier(name, **SMALL_OPTIONS.get(name, {}))


def _state(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.detach().cpu().numpy() for name, t in model.state_dict().items()}


def _template(model: nn.Module, precision: str, input_shape: tuple[int, int, int]) -> bytes:
    return export_template(model, input_shape, precision=precision, model_name="m")


def _rendered_from(exported: bytes, template: bytes) -> bytes:
    """``exported`` (the template of other weights) as rendering ``template`` with those
    weights gives it: the same bytes but for the record of the graph a template was
    exported with (``edgefl.exported_graph``), which a rendering keeps as it was."""
    digests = [
        {e.key: e.value for e in onnx.load_from_string(data).metadata_props}[EXPORTED_GRAPH]
        for data in (exported, template)
    ]
    assert exported.count(digests[0].encode()) == 1
    return exported.replace(digests[0].encode(), digests[1].encode())


def _initializers(data: bytes) -> dict[str, np.ndarray]:
    proto = onnx.load_from_string(data)
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}


def _logits(data: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {INPUT_NAME: x})[0])


class Fleet:
    """Model A (the template's) and model B (the fleet's new weights) of one architecture."""

    def __init__(self, name: str) -> None:
        self.a = _build(name, seed=1)
        self.b = _build(name, seed=2)
        self.name = name
        shape = self.a.input_shape
        self.templates = {p: export_template(self.a, shape, precision=p) for p in PRECISIONS}
        self.expected = {  # template A rendered with B's weights, byte for byte
            p: _rendered_from(export_template(self.b, shape, precision=p), self.templates[p])
            for p in PRECISIONS
        }
        self.images = np.random.default_rng(0).random((64, *shape), dtype=np.float32)


@pytest.fixture(scope="module", params=classifier_names())
def fleet(request: pytest.FixtureRequest) -> Fleet:
    return Fleet(request.param)


@pytest.fixture(scope="module")
def lenet() -> Fleet:
    return Fleet("lenet5")


# -- rendering every registry classifier -------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_template_reports_its_precision_and_the_fleet_weights_it_needs(
    fleet: Fleet, precision: str
) -> None:
    template = OnnxTemplate.from_bytes(fleet.templates[precision])

    assert template.precision == precision
    assert template.model_name == ""
    expected = {
        name: (tuple(t.shape), np.dtype(np.float32))
        for name, t in fleet.b.state_dict().items()
        if t.is_floating_point()
    }
    assert template.weights == expected
    assert template.nbytes == len(fleet.templates[precision])


def test_fp32_render_matches_export_onnx_of_the_new_weights(fleet: Fleet) -> None:
    rendered = OnnxTemplate.from_bytes(fleet.templates["fp32"]).render(_state(fleet.b))

    onnx.checker.check_model(onnx.load_from_string(rendered), full_check=True)
    expected = _logits(export_onnx(fleet.b, fleet.b.input_shape), fleet.images)
    np.testing.assert_allclose(_logits(rendered, fleet.images), expected, atol=1e-5, rtol=0)
    assert rendered == fleet.expected["fp32"]  # byte for byte the template of B


def test_int8_render_reproduces_quantize_dynamic_bit_for_bit(fleet: Fleet) -> None:
    rendered = OnnxTemplate.from_bytes(fleet.templates["int8"]).render(_state(fleet.b))

    onnx.checker.check_model(onnx.load_from_string(rendered), full_check=True)
    actual, expected = _initializers(rendered), _initializers(fleet.expected["int8"])
    assert actual.keys() == expected.keys()
    for name, array in expected.items():
        assert actual[name].dtype == array.dtype, name
        assert actual[name].shape == array.shape, name
        np.testing.assert_array_equal(actual[name], array, err_msg=name)
    logits = _logits(rendered, fleet.images)
    np.testing.assert_array_equal(
        logits.argmax(1), _logits(fleet.expected["int8"], fleet.images).argmax(1)
    )
    assert rendered == fleet.expected["int8"]  # byte for byte the template of B
    fp32 = _logits(export_onnx(fleet.b, fleet.b.input_shape), fleet.images)
    assert np.mean(logits.argmax(1) == fp32.argmax(1)) >= 0.9


@pytest.mark.parametrize("precision", PRECISIONS)
def test_rendering_the_template_weights_gives_back_the_template(
    lenet: Fleet, precision: str
) -> None:
    data = lenet.templates[precision]

    assert OnnxTemplate.from_bytes(data).render(_state(lenet.a)) == data


def test_weights_of_other_dtypes_are_converted_and_extra_names_ignored(lenet: Fleet) -> None:
    template = OnnxTemplate.from_bytes(lenet.templates["fp32"])
    state = {k: v.astype(np.float64) for k, v in _state(lenet.b).items()}
    state["unrelated.tensor"] = np.zeros(3)

    assert template.render(state) == lenet.expected["fp32"]


class _Tiny(nn.Module):
    """A Conv and two Linear layers whose weights we set to edge values."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 2)
        self.fc = nn.Linear(12, 4)
        self.head = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.conv(x).flatten(1))))  # type: ignore[no-any-return]


def _edge_weights(case: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    conv = rng.normal(size=(3, 1, 2, 2)).astype(np.float32)
    fc = rng.normal(size=(4, 12)).astype(np.float32)
    head = rng.normal(size=(4, 4)).astype(np.float32)
    if case == "zeros":
        conv[:], fc[1], head[:] = 0.0, 0.0, 0.0  # zero tensor, zero channel
    elif case == "denormal":
        conv[:], fc[2] = 1e-40, 3e-39  # scale below float32 tiny: scale 1, values 0
    elif case == "huge":
        conv *= np.float32(1e37)
        fc[0] = 3.0e38
    elif case == "one_sign":
        conv, fc, head = np.abs(conv), -np.abs(fc), np.abs(head) + 1
    elif case == "ties":  # max |w| = 127 makes the scale 1: halves round to even
        halves = [127, 2.5, -3.5, 0.5, 1.5, -0.5, -2.5, 126.5, -126.5, 3.5, 4.5, -127]
        conv = np.array(halves, dtype=np.float32).reshape(3, 1, 2, 2)
        head = np.array(halves[:4] * 4, dtype=np.float32).reshape(4, 4)
    return {
        "conv.weight": conv,
        "conv.bias": rng.normal(size=3).astype(np.float32),
        "fc.weight": fc,
        "fc.bias": rng.normal(size=4).astype(np.float32),
        "head.weight": head,
    }


@pytest.mark.parametrize("case", ["zeros", "denormal", "huge", "one_sign", "ties"])
def test_int8_quantization_is_bit_identical_on_edge_values(case: str) -> None:
    weights = _edge_weights(case)
    model = _Tiny()
    template = _template(model, "int8", (1, 3, 3))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})

    rendered = OnnxTemplate.from_bytes(template).render(weights)

    if case == "huge" and not ORT_FLOAT64_RANGE:
        # This onnxruntime quantizes these weights otherwise (inf scale): the export
        # refuses them rather than write a template the device would not reproduce.
        with pytest.raises((ModelError, OnnxTemplateError), match="does not reproduce"):
            verify_template(_template(model, "int8", (1, 3, 3)), weights)
        scales = [v for v in _initializers(rendered).values() if v.dtype == np.float32]
        assert all(np.isfinite(v).all() for v in scales)
        return
    assert rendered == _rendered_from(_template(model, "int8", (1, 3, 3)), template)


# -- refusals ----------------------------------------------------------------------------


def test_a_missing_tensor_is_named(lenet: Fleet) -> None:
    state = _state(lenet.b)
    del state["features.conv2.bias"]

    with pytest.raises(OnnxTemplateError, match=r"'features\.conv2\.bias' is missing"):
        OnnxTemplate.from_bytes(lenet.templates["int8"]).render(state)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_wrong_shape_is_named(lenet: Fleet, precision: str) -> None:
    state = _state(lenet.b)
    state["head.weight"] = state["head.weight"].T  # the stored int8 layout is no excuse

    with pytest.raises(OnnxTemplateError, match=r"'head\.weight' has shape \(84, 10\)"):
        OnnxTemplate.from_bytes(lenet.templates[precision]).render(state)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e39])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_non_finite_weight_is_named(lenet: Fleet, precision: str, bad: float) -> None:
    state = {k: v.astype(np.float64) for k, v in _state(lenet.b).items()}
    state["features.fc.weight"][3, 7] = bad

    with pytest.raises(OnnxTemplateError, match=r"'features\.fc\.weight' has non-finite"):
        OnnxTemplate.from_bytes(lenet.templates[precision]).render(state)


@pytest.mark.parametrize(
    "value", [np.zeros((6,), dtype=complex), np.array(["a"] * 6), np.zeros(6, dtype=bool)]
)
def test_a_weight_that_is_not_real_numbers_is_named(lenet: Fleet, value: np.ndarray) -> None:
    state = _state(lenet.b)
    state["features.conv1.bias"] = value

    with pytest.raises(OnnxTemplateError, match=r"'features\.conv1\.bias' has dtype"):
        OnnxTemplate.from_bytes(lenet.templates["fp32"]).render(state)


def test_malformed_bytes_are_refused_with_the_package_error(lenet: Fleet) -> None:
    data = lenet.templates["int8"]
    rng = random.Random(0)
    cases = [data[:n] for n in (0, 1, 2, 10, 100, len(data) // 2, len(data) - 1)]
    cases += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))) for _ in range(200)]
    cases += [
        b"\x3a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # graph of length 2**64 - 1
        b"\x3a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # 12-byte varint
        b"\x3a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f",  # varint past 64 bits
        b"\x3b\x00",  # a group (wire type 3)
        b"\x00\x00",  # field number 0
        b"\x08",  # truncated varint
        b"",
    ]
    for case in cases:
        with pytest.raises(OnnxTemplateError):
            OnnxTemplate.from_bytes(case)


def test_a_huge_length_inside_the_graph_is_refused(lenet: Fleet) -> None:
    proto = onnx.load_from_string(lenet.templates["fp32"])
    graph = proto.graph.SerializeToString()
    rest = proto.SerializeToString().replace(b"\x3a" + _varint(len(graph)) + graph, b"")
    # An initializer field claiming 2**40 bytes, inside a graph of the right length.
    bad_graph = graph + b"\x2a" + _varint(1 << 40)
    data = rest + b"\x3a" + _varint(len(bad_graph)) + bad_graph

    with pytest.raises(OnnxTemplateError, match="past the end"):
        OnnxTemplate.from_bytes(data)


def test_bit_flips_never_raise_anything_but_the_package_error(lenet: Fleet) -> None:
    rng = random.Random(1)
    state = _state(lenet.b)
    for precision in PRECISIONS:
        data = lenet.templates[precision]
        for _ in range(150):
            flipped = bytearray(data)
            for _ in range(rng.randint(1, 3)):
                flipped[rng.randrange(len(data) // 4)] ^= 1 << rng.randrange(8)  # headers
            with contextlib.suppress(OnnxTemplateError):
                OnnxTemplate.from_bytes(bytes(flipped)).render(state)


def test_an_onnx_model_that_is_not_a_template_is_refused(lenet: Fleet) -> None:
    plain = export_onnx(lenet.a, lenet.a.input_shape)

    with pytest.raises(OnnxTemplateError, match="not an edgefl template"):
        OnnxTemplate.from_bytes(plain)


def _integer_node(proto: onnx.ModelProto, weight: str) -> onnx.NodeProto:
    """The ConvInteger / MatMulInteger node that quantizes ``weight`` (edgefl.int8_weights)."""
    meta = {e.key: e.value for e in proto.metadata_props}
    names = json.loads(meta["edgefl.int8_weights"])
    nodes = [n for n in proto.graph.node if n.op_type in ("ConvInteger", "MatMulInteger")]
    return nodes[names.index(weight)]


def _with_metadata(data: bytes, changes: dict[str, str]) -> bytes:
    proto = onnx.load_from_string(data)
    meta = {e.key: e.value for e in proto.metadata_props}
    meta.update(changes)
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, meta)
    return proto.SerializeToString()


@pytest.mark.parametrize(
    ("source", "changes", "message"),
    [
        ("int8", {"edgefl.precision": "fp32"}, "precision is 'fp32' but it holds quantized"),
        ("fp32", {"edgefl.precision": "int8"}, "unsupported quantization None"),
        ("int8", {"edgefl.quantization": "other"}, "unsupported quantization 'other'"),
        ("fp32", {"edgefl.precision": "fp16"}, "not 'fp32' or 'int8'"),
        ("fp32", {"edgefl.template": "2"}, "not an edgefl template"),
        ("int8", {"edgefl.transposed": '["nope"]'}, r"names tensors it has not: \['nope'\]"),
        ("int8", {"edgefl.transposed": '["features.conv1.weight"]'}, "listed as transposed"),
        ("int8", {"edgefl.transposed": "{"}, "not a JSON list"),
        ("int8", {"edgefl.int8_weights": "{"}, "int8_weights is not a JSON list of names"),
        ("int8", {"edgefl.int8_weights": '["head.weight"]'}, "names 1 weights for 5 Conv"),
        ("int8", {"edgefl.int8_weights": "[1, 2, 3, 4, 5]"}, "not a JSON list of names"),
        ("fp32", {"edgefl.int8_weights": "[]"}, None),  # fp32 templates do not read it
    ],
)
def test_metadata_must_agree_with_the_content(
    lenet: Fleet, source: str, changes: dict[str, str], message: str | None
) -> None:
    data = _with_metadata(lenet.templates[source], changes)

    if message is None:
        assert OnnxTemplate.from_bytes(data).precision == source
        return
    with pytest.raises(OnnxTemplateError, match=message):
        OnnxTemplate.from_bytes(data)


def test_an_int8_template_without_the_weight_map_is_refused(lenet: Fleet) -> None:
    # As made before edgefl.int8_weights existed: which weight a node quantizes was read
    # from onnxruntime's initializer names, which differ between its versions.
    proto = onnx.load_from_string(lenet.templates["int8"])
    kept = [e for e in proto.metadata_props if e.key != "edgefl.int8_weights"]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)

    with pytest.raises(OnnxTemplateError, match=r"without edgefl\.int8_weights.*export it again"):
        OnnxTemplate.from_bytes(proto.SerializeToString())


def _set_op(proto: onnx.ModelProto, weight: str, hops: int, op_type: str) -> None:
    """Change the op type of the node ``hops`` steps after ``weight``'s integer node."""
    node = _integer_node(proto, weight)
    for _ in range(hops):
        (node,) = [n for n in proto.graph.node if node.output[0] in n.input]
    node.op_type = op_type


@pytest.mark.parametrize(
    ("hops", "op_type", "message"),
    [
        (1, "Identity", "not followed by exactly one Cast"),
        (2, "Add", "not followed by exactly one Mul"),
    ],
)
def test_integer_nodes_must_have_the_quantize_dynamic_structure(
    lenet: Fleet, hops: int, op_type: str, message: str
) -> None:
    proto = onnx.load_from_string(lenet.templates["int8"])
    _set_op(proto, "features.conv2.weight", hops, op_type)

    with pytest.raises(OnnxTemplateError, match=rf"'features\.conv2\.weight'.*{message}"):
        OnnxTemplate.from_bytes(proto.SerializeToString())


def test_the_weight_scale_is_found_through_the_scales_mul(lenet: Fleet) -> None:
    # The Mul that scales the integer output multiplies by Mul(activation scale, weight
    # scale): a constant there instead is not a weight scale the device may rewrite.
    proto = onnx.load_from_string(lenet.templates["int8"])
    node = _integer_node(proto, "head.weight")
    (cast,) = [n for n in proto.graph.node if node.output[0] in n.input]
    (scaled,) = [n for n in proto.graph.node if cast.output[0] in n.input]
    scale = numpy_helper.from_array(np.ones(10, np.float32), "some.constant")
    proto.graph.initializer.append(scale)
    scaled.input[:] = [cast.output[0], scale.name]

    with pytest.raises(OnnxTemplateError, match=r"'head\.weight'.*product of scales"):
        OnnxTemplate.from_bytes(proto.SerializeToString())


def test_unsupported_initializers_are_refused(lenet: Fleet) -> None:
    proto = onnx.load_from_string(lenet.templates["fp32"])
    proto.graph.initializer.append(numpy_helper.from_array(np.ones(3), "extra.double"))
    with pytest.raises(OnnxTemplateError, match=r"'extra\.double': unsupported data type DOUBLE"):
        OnnxTemplate.from_bytes(proto.SerializeToString())

    proto = onnx.load_from_string(lenet.templates["fp32"])
    tensor = proto.graph.initializer[0]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    with pytest.raises(OnnxTemplateError, match="external data"):
        OnnxTemplate.from_bytes(proto.SerializeToString())

    proto = onnx.load_from_string(lenet.templates["fp32"])
    proto.graph.initializer[0].dims[0] += 1
    with pytest.raises(OnnxTemplateError, match="data does not match its shape"):
        OnnxTemplate.from_bytes(proto.SerializeToString())

    proto = onnx.load_from_string(lenet.templates["int8"])
    zero_point = _integer_node(proto, "head.weight").input[3]  # found by structure
    for t in proto.graph.initializer:
        if t.name == zero_point:
            t.CopyFrom(numpy_helper.from_array(np.full(10, 3, dtype=np.int8), t.name))
    with pytest.raises(OnnxTemplateError, match=r"'head\.weight': non-zero zero points"):
        OnnxTemplate.from_bytes(proto.SerializeToString())


def test_templates_larger_than_the_limit_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lenet: Fleet
) -> None:
    big = tmp_path / "big.onnx"
    with big.open("wb") as file:
        file.truncate(onnx_model.MAX_TEMPLATE_BYTES + 1)  # sparse: no memory, no disk
    with pytest.raises(OnnxTemplateError, match="larger than"):
        OnnxTemplate.read(big)

    monkeypatch.setattr(onnx_model, "MAX_TEMPLATE_BYTES", len(lenet.templates["fp32"]) - 1)
    with pytest.raises(OnnxTemplateError, match="larger than"):
        OnnxTemplate.from_bytes(lenet.templates["fp32"])


def test_read_parses_a_file_and_reports_a_missing_one(tmp_path: Path, lenet: Fleet) -> None:
    path = tmp_path / "template.onnx"
    path.write_bytes(lenet.templates["int8"])

    assert OnnxTemplate.read(path).render(_state(lenet.b)) == lenet.expected["int8"]
    with pytest.raises(OnnxTemplateError, match="cannot read template"):
        OnnxTemplate.read(tmp_path / "absent.onnx")


def test_unknown_fields_are_kept_byte_for_byte(lenet: Fleet) -> None:
    unknown = _varint(1000 << 3 | 2) + _varint(5) + b"hello"  # model field 1000
    data = lenet.templates["int8"] + unknown

    rendered = OnnxTemplate.from_bytes(data).render(_state(lenet.b))

    assert rendered == lenet.expected["int8"] + unknown


def test_the_error_is_a_value_error_of_the_package() -> None:
    assert issubclass(OnnxTemplateError, EdgeClientError)
    assert issubclass(OnnxTemplateError, ValueError)


def test_importing_the_module_loads_neither_torch_nor_onnx_nor_onnxruntime() -> None:
    code = (
        "import sys\n"
        "import edge_client.serve.template\n"
        "roots = {m.split('.')[0] for m in sys.modules}\n"
        "bad = sorted(roots & {'torch', 'onnx', 'onnxruntime', 'models'})\n"
        "bad += sorted(m for m in sys.modules if m.startswith('google.protobuf'))\n"
        "assert not bad, bad\n"
    )

    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)

    assert done.returncode == 0, done.stderr


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
