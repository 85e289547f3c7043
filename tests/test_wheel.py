"""The wheel alone runs the demo: ``pip wheel`` of the project, installed without the checkout
into a fresh venv that sees the built Horovod and the frameworks, answers
``hvd-compress demo --help``, imports every example script from there (they ship as
``hvd_compress.examples``) and trains a tiny two-worker demo of the PyTorch CNN from a
directory outside the checkout (the Keras scripts' runs are the README's tests, from the
checkout). The demo's codec is ef-sign: its CPU kernels run from the new install, where
numba compiles them for the first time, in a few seconds (the quantizers' take half a minute
in each worker; their kernels are checked in the checkout). On the oldest Python that
``requires-python`` admits, the same wheel installs, its core imports and resolves every
codec, and every module of it compiles.

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
import tomllib

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The project's wheel, built from a copy of its sources with the project venv's
    setuptools (no network)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    for name in SOURCES:
        origin = os.path.join(REPO, name)
        if os.path.isdir(origin):
            shutil.copytree(
                origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(origin, source / name)
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
        env=_env(),
    )
    (built,) = glob.glob(str(tmp_path / "dist" / "hvd_compress-*.whl"))
    return built


def _env():
    """The jobs' environment without PYTHONPATH: only the wheel can provide hvd_compress."""
    return {k: v for k, v in job_env().items() if k != "PYTHONPATH"}


@pytest.mark.timeout(400)
def test_the_installed_wheel_runs_the_demo_outside_the_checkout(tmp_path, wheel):
    # Run from outside the checkout, without PYTHONPATH.
    env = _env()
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


def _oldest_python():
    """An interpreter of the oldest Python the project declares (``requires-python``), or
    None where this machine has none."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["requires-python"]
    version = declared.removeprefix(">=")
    candidates = [shutil.which(f"python{version}")] + sorted(
        glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}"))
    )
    for candidate in filter(None, candidates):
        # pyenv's shims exist for every version and fail for those not selected.
        if subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return version, candidate
    return version, None


@pytest.mark.timeout(300)
def test_the_wheel_installs_and_imports_on_the_oldest_python_declared(tmp_path, wheel):
    version, interpreter = _oldest_python()
    if interpreter is None:
        pytest.skip(f"no Python {version} here (requires-python's lowest)")
    venv = tmp_path / "venv"
    subprocess.run([interpreter, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # uv checks the wheel's Requires-Python against the interpreter, and takes a numpy
    # built for it.
    uv = os.path.join(os.path.dirname(sys.executable), "uv")
    run_job([uv, "pip", "install", "--python", python, wheel], "uv pip install", 240)
    site_packages = run_job(
        [
            python,
            "-c",
            "import sys, hvd_compress, hvd_compress.registry as r; "
            "assert sys.version_info[:2] == tuple(map(int, sys.argv[1].split('.'))); "
            "[r.resolve(name) for name in r.CODECS]; "
            "print('site:' + hvd_compress.__path__[0])",
            version,
        ],
        f"import hvd_compress on Python {version}",
        60,
        cwd=tmp_path,
        env=_env(),
    )
    [package] = [line[5:] for line in site_packages.split("\n") if line.startswith("site:")]
    assert package.startswith(str(venv)), package
    # The ports and the examples need torch or TensorFlow to import; their syntax must
    # still be this Python's.
    run_job(
        [python, "-m", "compileall", "-q", os.path.dirname(package) + "/hvd_compress"],
        f"compile the package on Python {version}",
        60,
    )
