"""The wheel alone runs the demo: ``pip wheel`` of the project, installed without the checkout
into a fresh venv that sees the built Horovod and the frameworks, answers
``hvd-compress demo --help``, imports every example script from there (they ship as
``hvd_compress.examples``) and trains a tiny two-worker demo of the PyTorch CNN from a
directory outside the checkout (the Keras scripts' runs are the README's tests, from the
checkout). The demo's codec is ef-sign: its CPU kernels run from the new install, where
numba compiles them for the first time, in a few seconds (the quantizers' take half a minute
in each worker; their kernels are checked in the checkout).

The fresh venv gets the project venv's site-packages through a ``.pth`` line, which adds the
directory to ``sys.path`` without running the ``.pth`` files inside it, so the checkout's
editable install (a finder started by such a file) cannot stand in for the wheel.
"""

import glob
import os
import shutil
import site
import subprocess
import sys

import pytest

from .harness import REPO, job_env, run_job

pytestmark = pytest.mark.multiprocess

# The modules of the demo application, which the wheel ships as hvd_compress.examples, by the
# framework whose process imports them; the demo's own modules need neither framework and
# are imported with PyTorch's scripts.
EXAMPLES = {
    "pt": ["cli", "args", "corpus", "datasets", "report"]
    + ["mnist1d_torch", "mnist1d_gru_torch", "lm_torch"],
    "tf": ["mnist1d_keras", "lm_keras", "keras_steps"],
}
# What the wheel is built from: the package directories and the metadata's files.
SOURCES = [
    "hvd_compress",
    "pt",
    "tf",
    "examples",
    "pyproject.toml",
    "setup.cfg",
    "README.md",
    "LICENSE",
]


def _fresh_venv(path):
    """A venv without pip whose ``sys.path`` ends with the project venv's site-packages
    (torch, TensorFlow, Horovod, numba, mnist1d), and Horovod's ``horovodrun`` script in its
    ``bin/`` as installing Horovod there would write it. Returns its python and its
    site-packages."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120
    )
    python = str(path / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    with open(os.path.join(purelib, "project_venv.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    horovodrun = path / "bin" / "horovodrun"
    # With pip's guard: horovodrun's multiprocessing spawns children that import this file.
    horovodrun.write_text(
        f"#!{python}\nimport sys\nfrom horovod.runner.launch import "
        "run_commandline\nif __name__ == '__main__':\n"
        "    sys.exit(run_commandline())\n"
    )
    horovodrun.chmod(0o755)
    return python, purelib


@pytest.mark.timeout(400)
def test_the_installed_wheel_runs_the_demo_outside_the_checkout(tmp_path):
    # Without PYTHONPATH, and run from outside the checkout: only the wheel can provide
    # hvd_compress.
    env = {k: v for k, v in job_env().items() if k != "PYTHONPATH"}
    source = tmp_path / "source"
    for name in SOURCES:
        origin = os.path.join(REPO, name)
        if os.path.isdir(origin):
            shutil.copytree(
                origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(origin, source / name)
    # No network: the build uses the project venv's setuptools.
    run_job(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        "pip wheel",
        180,
        cwd=tmp_path,
        env=env,
    )
    (wheel,) = glob.glob(str(tmp_path / "dist" / "hvd_compress-*.whl"))
    python, venv_site = _fresh_venv(tmp_path / "venv")
    run_job(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            wheel,
        ],
        "pip install",
        180,
        cwd=tmp_path,
        env=env,
    )

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    scripts = {name[:-3] for name in os.listdir(os.path.join(REPO, "examples"))}
    assert scripts - {"__init__", "__pycache__"} == {
        n for names in EXAMPLES.values() for n in names
    }
    # One process per framework: Horovod's two extensions do not share one.
    for framework, examples in EXAMPLES.items():
        modules = [f"hvd_compress.examples.{name}" for name in examples]
        where = run_job(
            [
                python,
                "-c",
                f"import sys, hvd_compress.{framework}, {', '.join(modules)}; "
                f"print(*('file:' + sys.modules[m].__file__ for m in {modules!r}), sep='\\n')",
            ],
            f"import the {framework} examples",
            120,
            cwd=outside,
            env=env,
        )
        files = [line[len("file:") :] for line in where.split("\n") if line.startswith("file:")]
        assert len(files) == len(modules), where
        for file in files:
            assert file.startswith(venv_site), (file, venv_site)

    script = str(tmp_path / "venv" / "bin" / "hvd-compress")
    assert "--full" in run_job([script, "demo", "--help"], "demo --help", 120, cwd=outside, env=env)
    output = run_job(
        [script, "demo", "--runs", "2:ef-sign", "--steps", "50"],
        "a two-worker demo",
        300,
        cwd=outside,
        env=env,
    )
    assert "| model | workers | optimizer | codec | test accuracy |" in output, output
    assert "| PyTorch CNN | 2 | sgd | ef-sign |" in output, output
