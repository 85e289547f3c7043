"""The benchmark harness keeps working: one small configuration of ``hvd-compress bench``
(2 workers, the MNIST-1D CNN, 100 Mbit/s links, a few steps). Benchmarks are not tests;
this only checks the harness end to end, on shaped network namespaces when this process may
create them (root) and on localhost otherwise, which the harness must say."""

import json

import pytest

from benchmarks import bench, network
from benchmarks.protocol import OP_COUNT_PATHS, TF_OP_COUNT_PATHS

pytestmark = pytest.mark.multiprocess

SMOKE = [
    "--workers",
    "2",
    "--rates",
    "100M",
    "--models",
    "cnn",
    "--methods",
    "hvd-none,terngrad,terngrad-auto,ef-sign,ddp-fp16",
    "--tf-methods",
    "tf-hvd-none,tf-terngrad",
    "--steps",
    "2",
    "--bare-repeats",
    "1",
    "--accuracy-workers",
    "2",
    "--accuracy-steps",
    "4",
    "--accuracy-methods",
    "terngrad",
    "--timeout",
    "600",
]


def _run(tmp_path, capsys, *extra):
    bench.main(SMOKE + ["--out", str(tmp_path)] + list(extra))
    with open(tmp_path / "bench.json") as f:
        return json.load(f), capsys.readouterr().out


def _check_results(result, tmp_path):
    rows = {row["method"]: row for row in result["rows"]}
    assert set(rows) == {
        "hvd-none",
        "terngrad",
        "terngrad-auto",
        "ef-sign",
        "ddp-fp16",
        "tf-hvd-none",
        "tf-terngrad",
    }
    none = rows["hvd-none"]
    assert none["handed"] == none["sent"] == 832_552  # fp32 allreduce of 208,138 gradients
    # The TensorFlow job's rows: the same model's tensors, the same bytes as PyTorch's.
    assert rows["tf-hvd-none"]["handed"] == none["handed"]
    assert rows["tf-terngrad"]["handed"] == rows["terngrad"]["handed"]
    assert rows["tf-terngrad"]["of_pytorch"] is not None
    assert "the TensorFlow port against PyTorch's" in (tmp_path / "bench.md").read_text()
    assert rows["ddp-fp16"]["handed"] == none["handed"] // 2
    for codec in ("terngrad", "ef-sign"):
        row = rows[codec]
        assert row["sent"] < none["sent"] / 5
        # The collectives the probe recorded carry exactly the cost model's bytes.
        event = next(e for e in result["events"] if e["kind"] == "step" and e["method"] == codec)
        assert event["bare_sent"] == pytest.approx(row["sent"])
        assert row["codec"] is not None and row["wait"] >= 0
    # The adaptive row decided (after its warm-up at this rate) and faces the fastest of the
    # others measured with it.
    auto = rows["terngrad-auto"]["auto"]
    steps = {m: rows[m]["seconds"] for m in ("hvd-none", "terngrad", "ddp-fp16")}
    assert auto["fastest"] == min(steps, key=steps.get)
    assert auto["adaptive"]["decided_at_step"] is not None
    assert sum(auto["adaptive"]["counts"].values()) == len(auto["adaptive"]["paths"])
    assert (
        "the adaptive mode against the fastest fixed choice" in (tmp_path / "bench.md").read_text()
    )
    accuracy = [e for e in result["events"] if e["kind"] == "accuracy"]
    assert [e["method"] for e in accuracy] == ["terngrad"]
    assert [p[1] for p in accuracy[0]["points"]] == list(range(1, 5))
    assert (tmp_path / "bench.md").exists() and (tmp_path / "accuracy.png").exists()
    # At each N of --workers, on each path: the CPU kernels, the device path, the eager ops.
    by_path = {counts["path"]: counts for counts in result["op_counts"]["cnn"]}
    assert list(by_path) == [name for name, _, _ in OP_COUNT_PATHS.values()]
    for counts in by_path.values():
        assert counts["world_size"] == 2
        assert [c["codec"] for c in counts["codecs"]] == ["terngrad", "ef-sign"]  # not -auto
        # Compression adds ops to the step, for the tensors it compresses.
        assert all(c["added"] > 0 and c["compressed_tensors"] > 0 for c in counts["codecs"])
    # TernGrad's kernels, on the CPU or the device, add fewer ops than the eager ops.
    terngrad = {path: counts["codecs"][0]["added"] for path, counts in by_path.items()}
    assert terngrad["CPU kernels"] < terngrad["device path (Triton, interpreted)"]
    assert terngrad["device path (Triton, interpreted)"] < terngrad["eager ops"]
    # The TensorFlow job's codecs, on each of its paths: the XLA-compiled calls that a GPU's
    # tensors take add fewer ops than the same ops uncompiled.
    tf_paths = {counts["path"]: counts for counts in result["tf_op_counts"]["cnn"]}
    assert list(tf_paths) == [name for name, *_ in TF_OP_COUNT_PATHS.values()]
    for counts in tf_paths.values():
        assert counts["world_size"] == 2
        assert [c["codec"] for c in counts["codecs"]] == ["terngrad"]
        assert counts["codecs"][0]["added"] > 0
    tf_terngrad = {path: counts["codecs"][0]["added"] for path, counts in tf_paths.items()}
    assert (
        tf_terngrad["XLA-compiled calls (the GPU path)"] < tf_terngrad["TensorFlow ops, uncompiled"]
    )
    assert "TensorFlow ops of one traced step" in (tmp_path / "bench.md").read_text()


@pytest.mark.timeout(900)
def test_bench_smoke(tmp_path, capsys):
    reason = network.unavailable_reason()
    result, out = _run(tmp_path, capsys)
    _check_results(result, tmp_path)
    if reason is not None:
        assert "falling back to localhost" in out and result["network"].startswith("localhost")
        return
    assert result["network"] == "namespaces, tc tbf"
    assert (tmp_path / "speedup.png").exists()
    for row in result["rows"]:
        # Every payload byte crossed the shaped interface, with little besides. DDP's peers
        # only have to show traffic: their payload count comes from the comm hook's elements,
        # while what Gloo's allreduce inside DDP puts on one rank's link varies from run to run
        # (seen for ddp-fp16: above the upper bound once, at 0.9x of the payload in CI).
        if row["method"].startswith("ddp"):
            assert row["wire_tx"] > 0, row
            continue
        assert row["sent"] <= row["wire_tx"] <= 3 * row["sent"] + 200_000, row


@pytest.mark.timeout(900)
def test_bench_falls_back_to_localhost(tmp_path, capsys):
    result, out = _run(
        tmp_path,
        capsys,
        "--localhost",
        "--methods",
        "hvd-none,terngrad",
        "--no-tensorflow",
        "--no-accuracy",
        "--no-op-counts",
    )
    assert "falling back to localhost" in out
    assert result["network"].startswith("localhost")
    assert {row["method"] for row in result["rows"]} == {"hvd-none", "terngrad"}
    assert all(row["wire_tx"] is None for row in result["rows"])


@pytest.mark.timeout(900)
def test_bench_on_nodes_of_two_workers(tmp_path, capsys):
    """2 nodes of 2 workers: the two-level exchange beside the flat one, each node's link
    counted (on localhost when namespaces are unavailable: placed on named nodes, unshaped)."""
    result, out = _run(
        tmp_path,
        capsys,
        "--workers",
        "4",
        "--per-node",
        "2",
        "--methods",
        "terngrad,terngrad-2l",
        "--no-tensorflow",
        "--no-accuracy",
        "--no-op-counts",
    )
    assert "2 workers per node" in result["network"]
    rows = {row["method"]: row for row in result["rows"]}
    flat, two_level = rows["terngrad"], rows["terngrad-2l"]
    assert flat["predicted"] is None and two_level["predicted"] is None
    assert two_level["codec"] is not None and two_level["wait"] > 0
    # The bare exchange inside the nodes, for the cost model's inside tier: an allreduce and
    # an allgather among L = 2 ranks send 1.5x the padded gradient, what the flat fp32
    # allreduce among N = 4 sends of the gradient (2 (N - 1) / N): equal but for padding.
    bare = next(e for e in result["events"] if e["kind"] == "bare")["exchanges"]
    inside = bare["node fp32 allreduce+allgather"]
    assert inside["seconds"] > 0
    assert inside["sent"] == pytest.approx(bare["fp32 allreduce"]["sent"], abs=1.5 * 4)
    assert "the two-level exchange against the flat one" in (tmp_path / "bench.md").read_text()
    if network.unavailable_reason() is not None:
        return
    # Summed inside the nodes first, fewer bytes cross between them.
    assert 0 < two_level["wire_tx"] < flat["wire_tx"]


def test_topology_must_fill_its_nodes():
    network.check_topology(4, 2)
    with pytest.raises(ValueError, match="per_node must be a positive divisor of the 4"):
        network.check_topology(4, 3)
    with pytest.raises(ValueError, match="per_node"):
        network.check_topology(4, 0)
