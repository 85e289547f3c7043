"""Jobs started by the launchers clusters run: ``horovodrun -H node0:2,node1:2`` and
OpenMPI's ``mpirun -H node0:2,node1:2`` on hosts they reach over ssh (two network
namespaces of this machine, each with an sshd of its own: ``benchmarks.ssh_hosts``), and
``sbatch launch/slurm-cpu.sbatch`` on a Slurm cluster of this machine
(``tests.slurm_cluster``), ``horovod.spark.run`` on a local Spark and
``horovod.ray.RayExecutor`` on a local Ray. Horovod derives the local and cross ranks
itself; the flat codecs and the two-level exchange train (``tests.launched_train``), every
rank holds the same parameters after every step, the bytes each step handed to Horovod are
what the cost model says, and the exchanged gradients are the numpy reference's."""

import os
import pickle
import subprocess

import pytest

from benchmarks import network, ssh_hosts
from hvd_compress import cost, registry
from hvd_compress.topology import Nodes

from . import pt_jobs, slurm_cluster, two_level_checks
from .harness import BIN, REPO, job_env, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.launchers]

STEPS = 3
RUNS = ["terngrad:auto", "ef-sign:allgather", "terngrad:two-level"]
NODES, PER_NODE = 2, 2


def _unavailable():
    return network.unavailable_reason() or ssh_hosts.unavailable_reason()


@pytest.fixture(scope="module")
def hosts():
    reason = _unavailable()
    if reason is not None:
        pytest.skip(reason)
    with (
        network.TestNetwork(NODES * PER_NODE, PER_NODE, prefix="hvdct-") as net,
        ssh_hosts.SshHosts(net) as reachable,
    ):
        yield reachable


def _reports(out, ranks):
    """The reports ``tests.launched_train`` wrote to ``out``, by rank."""
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(ranks)]


def _check(ranks, nodes=NODES, per_node=PER_NODE):
    """Every rank's report from ``tests.launched_train``: placed as on ``nodes`` nodes of
    ``per_node`` ranks, its parameters bitwise those of the others after every step, each
    step's bytes the cost model's, and PyTorch's exchanged gradients the numpy reference's
    (``simulate``) where it has one: every stateless codec, flat or two-level."""
    for r, result in enumerate(ranks):
        assert result["rank"] == r and result["size"] == nodes * per_node
        assert (result["local_rank"], result["local_size"]) == (r % per_node, per_node)
        assert (result["cross_rank"], result["cross_size"]) == (r // per_node, nodes)
    placed = Nodes(tuple(tuple(range(m * per_node, (m + 1) * per_node)) for m in range(nodes)))
    for index, run in enumerate(ranks[0]["runs"]):
        results = [result["runs"][index] for result in ranks]
        codec = registry.resolve(run["codec"])
        reference = ranks[0]["framework"] == "torch" and not codec.two_way
        assert len(run["records"]) == STEPS
        if run["exchange"] == "two-level":
            assert cost.TWO_LEVEL in {route for _, _, route, _ in run["tensors"]}
            two_level_checks.check(results, codec, placed, reference)
        elif reference:
            pt_jobs.check_consistent_and_exact(results, codec)
        else:
            two_level_checks.check(results, codec, placed, reference=False)
    return ranks


def _train_command(out):
    return [os.path.join(BIN, "python"), "-m", "tests.launched_train", str(out), str(STEPS)] + RUNS


def test_horovodrun_over_ssh(hosts, tmp_path):
    command = hosts.horovodrun("--gloo-timeout-seconds", "120")
    run_job(
        command + _train_command(tmp_path), "horovodrun", 300, env=hosts.launcher_env(job_env())
    )
    assert all(not r["mpi"] and r["gloo"] for r in _check(_reports(tmp_path, 4)))


def test_mpirun_over_ssh(hosts, tmp_path):
    env = hosts.launcher_env(job_env())
    forwarded = ["OMP_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL", "HOROVOD_CYCLE_TIME", "PYTHONPATH"]
    command = hosts.launcher_prefix() + [
        "mpirun",
        "--allow-run-as-root",
        "-np",
        str(NODES * PER_NODE),
        "-H",
        hosts.hosts(),
        "--bind-to",
        "none",
        "--mca",
        "pml",
        "ob1",
        "--mca",
        "btl",
        "self,tcp",
        "--mca",
        "btl_tcp_if_include",
        "eth0",
        "--mca",
        "oob_tcp_if_include",
        "eth0",
    ]
    for name in forwarded:
        command += ["-x", name]
    run_job(command + _train_command(tmp_path), "mpirun", 300, env=env)
    assert all(r["mpi"] for r in _check(_reports(tmp_path, 4)))


def test_sbatch_runs_the_cpu_template(tmp_path):
    reason = slurm_cluster.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with slurm_cluster.SlurmCluster() as cluster:
        command = [
            "sbatch",
            "--wait",
            f"--output={tmp_path / 'slurm-%j.out'}",
            os.path.join(REPO, "launch", "slurm-cpu.sbatch"),
            "-m",
            "tests.launched_train",
        ]
        done = subprocess.run(
            command + [str(tmp_path), str(STEPS)] + RUNS,
            cwd=REPO,
            env=cluster.env(job_env()),
            capture_output=True,
            text=True,
            timeout=300,
        )
        output = "".join(path.read_text() for path in tmp_path.glob("slurm-*.out"))
        assert done.returncode == 0, (
            f"{done.stdout}{done.stderr}\n{output[-6000:]}\n{cluster.log('slurmctld')}"
        )
    assert all(r["mpi"] for r in _check(_reports(tmp_path, 2), nodes=1, per_node=2))


def test_horovod_spark_run_trains_with_both_wrappers(monkeypatch):
    """``horovod.spark.run`` of 2 processes on a local Spark, the PyTorch and the Keras
    training alike."""
    pyspark = pytest.importorskip("pyspark")
    from horovod.spark import run

    from .launched_train import train, train_keras

    # Spark's JVM, its Python workers and Horovod's processes take this process's
    # environment.
    spark_env = {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": os.path.join(BIN, "python")}
    for name, value in dict(job_env(), **spark_env).items():
        monkeypatch.setenv(name, value)
    spark = (
        pyspark.sql.SparkSession.builder.master("local[2]")
        .appName("hvd_compress launcher test")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    try:
        for function in (train, train_keras):
            ranks = run(function, args=(RUNS, STEPS), num_proc=2, use_gloo=True)
            assert all(r["gloo"] for r in _check(ranks, nodes=1, per_node=2)), function
    finally:
        spark.stop()


def test_horovod_ray_executor_trains_with_both_wrappers():
    """``horovod.ray.RayExecutor`` with 2 CPU workers on a local Ray, the PyTorch and the
    Keras training alike."""
    ray = pytest.importorskip("ray")
    from horovod.ray import RayExecutor

    from .launched_train import train, train_keras

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": job_env()})
    try:
        for function in (train, train_keras):
            executor = RayExecutor(
                RayExecutor.create_settings(timeout_s=120), num_workers=2, cpus_per_worker=1
            )
            executor.start()
            try:
                ranks = executor.run(function, args=[RUNS, STEPS])
            finally:
                executor.shutdown()
            ranks = sorted(ranks, key=lambda r: r["rank"])
            assert all(r["gloo"] for r in _check(ranks, 1, 2)), function
    finally:
        ray.shutdown()
