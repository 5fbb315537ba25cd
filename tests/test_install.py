"""A fresh, non-editable install: one top-level package, a light public API, and a CLI that
trains, all from a directory holding its own ``shared/`` and ``services/`` packages (the
names a user's project most likely has, which must not shadow or be shadowed by ours)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

# a fresh venv installs TensorFlow (from pip's cache when warm): minutes, not seconds
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

USER_PACKAGE = (
    '"""A user\'s own package of this name: downpour must neither need nor break it."""\n'
)


def run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` outside this test run's environment (no PYTHONPATH, no active venv; pip's
    own settings kept); fail with its output."""
    drop = {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP"}
    clean = {k: v for k, v in os.environ.items() if k not in drop}
    out = subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(clean, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert out.returncode == 0, (
        f"{cmd}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    )
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a fresh venv with ``pip install .`` done, the wheel pip built), built once."""
    base = tmp_path_factory.mktemp("install")
    venv = base / "venv"
    run([sys.executable, "-m", "venv", str(venv)], base, 120)
    py = venv / "bin" / "python"
    wheels = base / "wheels"
    run([str(py), "-m", "pip", "-q", "wheel", "--no-deps", "-w", str(wheels), str(ROOT)], base, 600)
    run([str(py), "-m", "pip", "-q", "install", str(ROOT)], base, 1200)
    (wheel,) = wheels.glob("downpour_ps-*.whl")
    return venv, wheel


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    """A directory with the user's own ``shared`` and ``services`` packages in it."""
    for name in ("shared", "services"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(USER_PACKAGE)
    return tmp_path


def test_the_wheel_installs_one_top_level_package(installed: tuple[Path, Path]) -> None:
    _, wheel = installed
    with zipfile.ZipFile(wheel) as zf:
        (top,) = [n for n in zf.namelist() if n.endswith(".dist-info/top_level.txt")]
        assert zf.read(top).decode().split() == ["downpour"]
        tops = {
            n.split("/")[0] for n in zf.namelist() if not n.split("/")[0].endswith(".dist-info")
        }
        assert tops == {"downpour"}
        assert "downpour/py.typed" in zf.namelist()


def test_import_downpour_is_light_beside_a_users_own_packages(
    installed: tuple[Path, Path], user_project: Path
) -> None:
    venv, _ = installed
    code = (
        "import downpour, sys, json; "
        "assert 'tensorflow' not in sys.modules; "
        "import shared, services; "
        "print(json.dumps({'version': downpour.__version__, 'spec': repr(downpour.ModelSpec), "
        "'all': downpour.__all__, 'file': downpour.__file__, 'shared': shared.__file__}))"
    )
    out = run([str(venv / "bin" / "python"), "-c", code], user_project, 120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"] == "0.1.0"
    assert "downpour.spec.ModelSpec" in got["spec"]
    assert {"ModelSpec", "Dataset", "__version__"} <= set(got["all"])
    assert str(venv) in got["file"]  # the installed copy, not the checkout
    assert got["shared"].startswith(str(user_project))  # the user's package is theirs
    # and the isolated-mode check the issue names, verbatim
    run(
        [
            str(venv / "bin" / "python"),
            "-I",
            "-c",
            "import downpour, sys; print(downpour.__version__, downpour.ModelSpec); "
            "assert 'tensorflow' not in sys.modules",
        ],
        user_project,
        120,
    )


def test_installed_run_local_trains_from_a_users_project(
    installed: tuple[Path, Path], user_project: Path
) -> None:
    venv, _ = installed
    out = run(
        [
            str(venv / "bin" / "downpour"),
            "run-local",
            "--workers",
            "1",
            "--steps",
            "20",
            "--no-progress",
            "--run-dir",
            str(user_project / "run"),
        ],
        user_project,
        600,
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("held-out accuracy:")]
    assert line, out.stdout[-2000:]
    accuracy = float(line[-1].split(":")[1])
    assert accuracy > 0.2  # 20 steps of the CNN: well above chance (0.1)
    status = json.loads((user_project / "run" / "status.json").read_text())
    assert status["updates_applied"] >= 20
