"""The inference-only path: OnnxClassifier and ``python -m edge_client infer``."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from edge_client.__main__ import main
from edge_client.errors import EdgeClientError, InferenceError
from edge_client.serve.infer import OnnxClassifier
from edge_client.serve.template import OnnxTemplate, never_trained
from models import build_classifier
from models.onnx_export import export_onnx
from models.onnx_template import export_template

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = build_classifier("lenet5")
    path = tmp_path_factory.mktemp("model") / "lenet5.onnx"
    path.write_bytes(export_onnx(model, model.input_shape))
    return path


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(0).random((6, 1, 28, 28), dtype=np.float32)


def _reference_logits(model_file: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input": x})
    return np.asarray(logits)


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "edge_client", *args],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_classifier_matches_onnxruntime_from_path_and_from_bytes(
    model_file: Path, images: np.ndarray
) -> None:
    expected = _reference_logits(model_file, images)

    from_path = OnnxClassifier(model_file)
    from_bytes = OnnxClassifier(model_file.read_bytes(), threads=2)

    np.testing.assert_array_equal(from_path.predict_logits(images), expected)
    np.testing.assert_allclose(from_bytes.predict_logits(images), expected, atol=1e-6)
    predictions = from_path.predict(images)
    assert predictions.dtype == np.int64
    np.testing.assert_array_equal(predictions, expected.argmax(axis=1))
    assert from_path.sample_shape == (1, 28, 28)
    assert from_path.num_classes == 10


def test_a_single_image_is_a_batch_of_one(model_file: Path, images: np.ndarray) -> None:
    classifier = OnnxClassifier(model_file)

    logits = classifier.predict_logits(images[2])

    assert logits.shape == (1, 10)
    np.testing.assert_allclose(logits[0], classifier.predict_logits(images)[2], atol=1e-6)


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (np.zeros((2, 1, 28, 28), dtype=np.uint8), "uint8 / 255"),
        (np.zeros((2, 1, 28, 28), dtype=np.float64), "float32"),
        (np.zeros((2, 3, 28, 28), dtype=np.float32), r"shape \(1, 28, 28\)"),
        (np.zeros((2, 1, 32, 32), dtype=np.float32), r"shape \(1, 28, 28\)"),
        (np.zeros((28, 28), dtype=np.float32), "rank"),
        (np.zeros((1, 2, 1, 28, 28), dtype=np.float32), "rank"),
        (np.zeros((0, 1, 28, 28), dtype=np.float32), "empty"),
        (np.full((1, 1, 28, 28), np.nan, dtype=np.float32), "NaN"),
        ([[0.0] * 28] * 28, "numpy array"),
    ],
)
def test_malformed_inputs_are_rejected(model_file: Path, x: object, message: str) -> None:
    classifier = OnnxClassifier(model_file)

    with pytest.raises(InferenceError, match=message) as caught:
        classifier.predict(x)  # type: ignore[arg-type]

    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, EdgeClientError)


def test_unloadable_models_and_bad_threads_are_rejected(tmp_path: Path, model_file: Path) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not a model")

    with pytest.raises(InferenceError, match="not found"):
        OnnxClassifier(tmp_path / "missing.onnx")
    with pytest.raises(InferenceError, match="cannot load"):
        OnnxClassifier(garbage)
    with pytest.raises(InferenceError, match="cannot load"):
        OnnxClassifier(b"\x00not a model")
    with pytest.raises(InferenceError, match="threads"):
        OnnxClassifier(model_file, threads=0)


def test_cli_prints_predictions_and_saves_them(
    tmp_path: Path, model_file: Path, images: np.ndarray
) -> None:
    np.save(tmp_path / "x.npy", images)
    expected = _reference_logits(model_file, images)

    done = _run_cli(
        "infer", "--model", str(model_file), "--input", "x.npy", "--output", "y.npy", cwd=tmp_path
    )

    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["predictions"] == expected.argmax(axis=1).tolist()
    assert result["batch"] == 6
    assert result["latency_ms"] > 0
    saved = np.load(tmp_path / "y.npy")
    assert saved.dtype == np.int64
    np.testing.assert_array_equal(saved, expected.argmax(axis=1))


def test_cli_saves_logits_of_a_single_image(
    tmp_path: Path, model_file: Path, images: np.ndarray
) -> None:
    np.save(tmp_path / "x.npy", images[0])

    done = _run_cli(
        "infer",
        "--model",
        str(model_file),
        "--input",
        "x.npy",
        "--output",
        "logits.npy",
        "--logits",
        "--threads",
        "2",
        cwd=tmp_path,
    )

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["batch"] == 1
    np.testing.assert_allclose(
        np.load(tmp_path / "logits.npy"), _reference_logits(model_file, images[:1]), atol=1e-6
    )


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("wrong-shape", "shape"),
        ("wrong-dtype", "uint8"),
        ("pickled-array", "pickle"),
        ("pickle-file", "pickle"),
        ("missing", "cannot read input"),
    ],
)
def test_cli_rejects_bad_input_with_one_line_and_exit_2(
    tmp_path: Path, model_file: Path, payload: str, message: str
) -> None:
    path = tmp_path / "x.npy"
    if payload == "wrong-shape":
        np.save(path, np.zeros((2, 1, 14, 14), dtype=np.float32))
    elif payload == "wrong-dtype":
        np.save(path, np.zeros((2, 1, 28, 28), dtype=np.uint8))
    elif payload == "pickled-array":
        np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    elif payload == "pickle-file":
        path.write_bytes(pickle.dumps(np.zeros((1, 1, 28, 28), dtype=np.float32)))

    done = _run_cli("infer", "--model", str(model_file), "--input", str(path), cwd=tmp_path)

    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    assert message in lines[0]
    assert "Traceback" not in done.stderr


def test_cli_without_a_command_prints_help_and_exits_2(tmp_path: Path) -> None:
    done = _run_cli(cwd=tmp_path)

    assert done.returncode == 2
    assert "infer" in done.stderr
    assert "usage:" in done.stderr


def test_the_infer_path_never_imports_torch(tmp_path: Path, model_file: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((1, 1, 28, 28), dtype=np.float32))
    code = (
        "import sys\n"
        "import edge_client.serve.infer\n"
        "assert 'torch' not in sys.modules, 'import edge_client.serve.infer loaded torch'\n"
        "from edge_client.__main__ import main\n"
        f"rc = main(['infer', '--model', {str(model_file)!r}, '--input', 'x.npy'])\n"
        "assert rc == 0, rc\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "                ('torch', 'models', 'coordinator', 'sim'))\n"
        "assert not loaded, loaded\n"
        "assert 'onnxruntime' in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["batch"] == 1


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_cli_warns_once_on_a_template_never_filled_with_trained_weights(
    tmp_path: Path,
    model_file: Path,
    precision: str,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    torch.manual_seed(0)
    model = build_classifier("lenet5")
    template = tmp_path / "template.onnx"
    template.write_bytes(export_template(model, model.input_shape, precision=precision))
    weights = {
        name: tensor.numpy() * 0.5  # other weights, as a round would bring
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point()
    }
    served = tmp_path / "served.onnx"
    served.write_bytes(OnnxTemplate.read(template).render(weights))
    np.save(tmp_path / "x.npy", np.zeros((2, 1, 28, 28), dtype=np.float32))

    def warnings(path: Path) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="edge_client"):
            assert main(["infer", "--model", str(path), "--input", str(tmp_path / "x.npy")]) == 0
        assert json.loads(capsys.readouterr().out)["batch"] == 2  # it still answers
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert warnings(template) == [
        f"{template}: this model was never trained: predictions are meaningless; run "
        "`edge_client follow` or fill it with trained weights first"
    ]
    assert warnings(served) == []  # filled with the fleet's weights
    assert warnings(model_file) == []  # an ONNX model that is no template
    rendered_as_exported = OnnxTemplate.read(template).render(
        {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    )
    assert never_trained(rendered_as_exported)  # the same weights: still untrained
    assert not never_trained(b"not a model")
