"""``python -m edge_client bundle``: options are checked before anything is downloaded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edge_client.__main__ import main
from edge_client.bundle.builder import _PACKAGES, BundleError, BundleOptions, _Plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"profile": "train"}, "the train profile needs --torch-index: 'cpu' for a Raspberry Pi"),
        ({"profile": "infer", "torch_index": "cpu"}, "the infer profile has no torch"),
        ({"profile": "infer", "platform": "linux_mips"}, "unknown platform 'linux_mips'"),
        ({"profile": "infer", "python_version": "3.9"}, "3.10 or newer"),
        ({"profile": "infer", "python_version": "three"}, "3.10 or newer"),
        ({"profile": "infer", "memory_max": "lots"}, "--memory-max 'lots'"),
        ({"profile": "infer", "cpu_quota": "2 cores"}, "--cpu-quota '2 cores'"),
        ({"profile": "train", "torch_index": "ftp://x"}, "neither cpu, default, a URL nor"),
        ({"profile": "infer", "onnx_template": Path("/nonexistent.onnx")}, "no such file"),
    ],
)
def test_bad_options_are_refused_before_any_download(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(BundleError, match=re.escape(message)):
        _Plan.make(BundleOptions(out=tmp_path / "b", **options))  # type: ignore[arg-type]


def test_the_output_folder_must_be_new_or_empty_and_the_config_valid(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(BundleError, match="not an empty folder"):
        _Plan.make(BundleOptions(out=tmp_path / "full", profile="infer"))
    bad = tmp_path / "bad.toml"
    bad.write_text('password = "x"\n')
    with pytest.raises(BundleError, match="no 'password' key"):
        _Plan.make(BundleOptions(out=tmp_path / "b", profile="infer", config=bad))


def test_cross_targets_get_pip_platform_tags_and_torch_its_source(tmp_path: Path) -> None:
    plan = _Plan.make(
        BundleOptions(
            out=tmp_path / "b",
            profile="train",
            platform="linux_aarch64",
            python_version="3.10",
            torch_index="cpu",
        )
    )
    flags = " ".join(plan.target_flags)
    assert "--platform manylinux_2_17_aarch64" in flags and "--platform linux_aarch64" in flags
    assert "--python-version 3.10" in flags and "--only-binary=:all:" in flags
    assert plan.torch_index == "https://download.pytorch.org/whl/cpu" and plan.arch == "aarch64"
    wheels = tmp_path / "jetson-wheels"
    wheels.mkdir()
    plan = _Plan.make(BundleOptions(out=tmp_path / "c", profile="train", torch_index=str(wheels)))
    assert plan.torch_index == str(wheels.resolve()) and "jetson-wheels" in plan.torch_source


def test_the_wheel_holds_every_package_of_the_project() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    listed = re.search(r"include = \[(.*?)\]", pyproject)
    assert listed is not None
    assert {p.strip(' "*') for p in listed.group(1).split(",")} == set(_PACKAGES)


def test_the_cli_says_what_is_wrong_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bundle", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the train profile needs --torch-index") and err.count("\n") == 1


def test_extra_indexes_reach_pip(tmp_path: Path) -> None:
    from edge_client.__main__ import _build_parser

    parser, _ = _build_parser()
    args = parser.parse_args(
        [
            "bundle",
            "--out",
            str(tmp_path / "b"),
            "--profile",
            "infer",
            "--platform",
            "linux_armv7l",
            "--extra-index-url",
            "https://www.piwheels.org/simple",
        ]
    )
    plan = _Plan.make(
        BundleOptions(
            out=args.out,
            profile=args.profile,
            platform=args.platform,
            extra_index_urls=tuple(args.extra_index_url),
        )
    )
    flags = list(plan.target_flags)
    assert flags[flags.index("--extra-index-url") + 1] == "https://www.piwheels.org/simple"
    assert "linux_armv7l" in flags
