"""AdaComp: the selection rule, the residue identity, the wire format (numpy reference and
PyTorch port byte for byte), layer kinds, and real Horovod jobs against the reference."""

import numpy as np
import pytest
import torch

import hvd_compress
import hvd_compress.pt as hc
from hvd_compress.codes import FieldCodes

from .devices import DEVICES
from .harness import run_parallel
from .pt_jobs import adacomp_replay, assert_sparse_ranks_agree, train_sparse

SHAPES_AND_BINS = [(1234, 50), (5000, 500), (7, 50), (1, 1), (100, 7), (512, 64)]


def _gradients(numel, steps, seed):
    """Gradients with a trend and noise, and a zero stretch (whole zero bins) at first."""
    rng = np.random.default_rng(seed)
    trend = rng.standard_normal(numel).astype(np.float32)
    grads = [(trend + rng.standard_normal(numel)).astype(np.float32) for _ in range(steps)]
    grads[0][: min(numel, 120)] = 0
    return grads


@pytest.mark.parametrize("numel,bin_length", SHAPES_AND_BINS)
def test_residue_telescopes_and_the_selection_rule_holds(numel, bin_length):
    codec = hvd_compress.AdaComp()
    grads = _gradients(numel, 30, seed=numel)
    residue, steps = adacomp_replay(codec, grads, bin_length)
    # sum_t sent_t + G_T = sum_t dW_t
    total_sent = np.sum([s[4].astype(np.float64) for s in steps], axis=0)
    np.testing.assert_allclose(
        total_sent + residue, np.sum(grads, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5
    )
    for compensated, grad, selected, _message, sent in steps:
        bins = -(-numel // bin_length)
        padded = np.zeros(bins * bin_length, np.float32)
        padded[:numel] = np.abs(compensated)
        bin_max = np.repeat(padded.reshape(bins, bin_length).max(axis=1), bin_length)[:numel]
        rule = (np.abs(compensated + grad) >= bin_max) & (compensated != 0)
        assert np.array_equal(selected, rule)
        # Sent exactly where selected, as sign(G) * scale with scale = mean |G| of the sent.
        assert np.array_equal(sent != 0, selected)
        if selected.any():
            scale = np.abs(compensated[selected]).astype(np.float64).mean()
            np.testing.assert_allclose(np.abs(sent[selected]), scale, rtol=1e-6)
            assert np.array_equal(np.sign(sent[selected]), np.sign(compensated[selected]))


def test_zero_residue_sends_at_least_half_the_bin_maximum():
    """With no residue H = 2 dW: the first step sends exactly |dW| >= max_bin |dW| / 2."""
    codec = hvd_compress.AdaComp()
    grad = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    selected = codec.select(grad, grad, 50)
    bin_max = np.repeat(np.abs(grad).reshape(20, 50).max(axis=1), 50)
    assert np.array_equal(selected, np.abs(grad) >= bin_max / 2)


def test_all_zero_bin_sends_nothing_and_message_length_is_the_selection():
    codec = hvd_compress.AdaComp()
    grad = np.random.default_rng(4).standard_normal(300).astype(np.float32)
    grad[50:150] = 0  # bins 1 and 2 of 50
    selected = codec.select(grad, grad, 50)
    assert not selected[50:150].any() and selected.any()
    message = codec.encode_message(grad, selected, 50)
    # scale + 6 counts of 6 bits + one 6-bit offset and one sign bit per sent element
    sent = int(selected.sum())
    assert (
        message.size
        == 4 + 5 + FieldCodes(6).packed_nbytes(sent) + -(-sent // 8)
        == codec.message_nbytes(300, 50, sent)
    )
    counts = hvd_compress.packing.unpack(message[4:9], FieldCodes(6), 6)
    assert counts.tolist() == selected.reshape(6, 50).sum(axis=1).tolist()
    assert counts[1] == counts[2] == 0
    nothing = codec.encode_message(np.zeros(300, np.float32), np.zeros(300, bool), 50)
    assert nothing.size == 4 + 5 and not codec.decode_message(nothing, 300, 50).any()


@pytest.mark.parametrize("numel,bin_length", SHAPES_AND_BINS)
@pytest.mark.parametrize("device", DEVICES)
def test_pytorch_port_sends_the_reference_bytes(numel, bin_length, device):
    reference, port = hvd_compress.AdaComp(), hc.AdaComp()
    residue = torch.zeros(numel, device=device)
    for step, grad in enumerate(_gradients(numel, 10, seed=7)):
        grad = torch.from_numpy(grad).to(device)
        compensated = residue + grad
        selected = port.select(compensated, grad, bin_length)
        message = port.encode_message(compensated, selected, bin_length)
        expected = reference.encode_message(
            compensated.cpu().numpy(),
            reference.select(compensated.cpu().numpy(), grad.cpu().numpy(), bin_length),
            bin_length,
        )
        np.testing.assert_array_equal(message.cpu().numpy(), expected, err_msg=f"step {step}")
        sent = port.decode_message(message, numel, bin_length)
        np.testing.assert_array_equal(
            sent.cpu().numpy(), reference.decode_message(expected, numel, bin_length)
        )
        residue = compensated - sent


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_residue_decodes_to_nan_everywhere(device):
    codec = hc.AdaComp()
    grad = torch.randn(100).to(device)
    grad[7] = float("inf")
    message = codec.encode_message(grad, codec.select(grad, grad, 50), 50)
    assert torch.isnan(codec.decode_message(message, 100, 50)).all()


class _Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(30, 8)
        self.conv = torch.nn.Conv1d(8, 4, 3)
        self.gru = torch.nn.GRU(4, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 2)


def test_layer_kinds_and_bin_lengths():
    model = _Layers()
    codec = hc.AdaComp.for_model(
        model, bin_lengths={"recurrent": 400}, named_bin_lengths={"head.weight": 10}
    )
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    kinds = {name: codec.layer_kind(name, shape) for name, shape in shapes.items()}
    assert kinds == {
        "embed.weight": "embedding",
        "conv.weight": "conv",
        "conv.bias": "conv",
        "gru.weight_ih_l0": "recurrent",
        "gru.weight_hh_l0": "recurrent",
        "gru.bias_ih_l0": "recurrent",
        "gru.bias_hh_l0": "recurrent",
        "norm.weight": "other",
        "norm.bias": "other",
        "head.weight": "linear",
        "head.bias": "linear",
    }
    lengths = {name: codec.bin_length(name, kind) for name, kind in kinds.items()}
    assert lengths["conv.weight"] == 50 and lengths["embed.weight"] == 500
    assert lengths["gru.weight_hh_l0"] == 400 and lengths["head.weight"] == 10
    # Without the model: the same bin lengths by name and shape, except for biases.
    by_name = hc.AdaComp()
    assert [by_name.layer_kind(n, s) for n, s in shapes.items()] == [
        "linear",
        "conv",
        "other",
        "recurrent",
        "recurrent",
        "recurrent",
        "recurrent",
        "other",
        "other",
        "linear",
        "other",
    ]
    # The reference rebuilds the port with the same layers (registry, cross-port resolve).
    assert hvd_compress.resolve(codec, hc.CODECS) is codec
    assert hvd_compress.resolve(hvd_compress.AdaComp(**codec.params()), hc.CODECS) == codec


def test_bad_hyperparameters_and_misuse():
    with pytest.raises(ValueError, match="a bin_lengths key must be one of 'conv'"):
        hc.AdaComp(bin_lengths={"convolution": 50})
    with pytest.raises(ValueError, match=r"bin_lengths\['conv'\] \(L_T\) must be >= 1"):
        hc.AdaComp(bin_lengths={"conv": 0})
    with pytest.raises(TypeError, match=r"named_bin_lengths\['fc.weight'\] \(L_T\) must be an"):
        hc.AdaComp(named_bin_lengths={"fc.weight": 2.5})
    with pytest.raises(ValueError, match=r"layers\['fc.weight'\] must be one of"):
        hc.AdaComp(layers={"fc.weight": "dense"})
    with pytest.raises(TypeError, match="Horovod's own DistributedOptimizer"):
        hc.AdaComp().compress(torch.ones(3))
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="cannot travel by exchange='allreduce'"):
        hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), compression="adacomp", exchange="allreduce"
        )
    with pytest.raises(ValueError, match="cannot run with error_feedback=False"):
        hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), compression="adacomp", error_feedback=False
        )


# ----- real Horovod jobs -----

CODEC = hvd_compress.AdaComp(
    named_bin_lengths={"middle.weight": 64}, bin_lengths={"other": 20}, min_size=0
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_and_match_the_reference(world):
    results = run_parallel(train_sparse, world, CODEC)
    names = [name for name, _, exchange, reason in results[0]["tensors"]]
    assert all(
        reason == "compressed" and exchange == "allgather"
        for _, _, exchange, reason in results[0]["tensors"]
    )
    kinds = results[0]["kinds"]
    residues = {(rank, n): 0 for rank in range(world) for n in names}
    for step in range(len(results[0]["records"])):
        assert_sparse_ranks_agree(results, step)
        first = results[0]["records"][step]
        for name in names:
            bin_length = CODEC.bin_length(name, kinds[name])
            total = 0
            for rank, r in enumerate(results):
                grad = r["records"][step]["local"][name].numpy().ravel()
                compensated = residues[rank, name] + grad
                selected = CODEC.select(compensated, grad, bin_length)
                sent = CODEC.decode_message(
                    CODEC.encode_message(compensated, selected, bin_length), grad.size, bin_length
                )
                residues[rank, name] = compensated - sent
                total = total + sent
            np.testing.assert_allclose(
                first["exchanged"][name].numpy().ravel(),
                total / world,
                rtol=1e-6,
                atol=1e-9,
                err_msg=f"{name} step {step}",
            )
        for r in results:
            rec = r["records"][step]
            assert rec["bytes"] == rec["expected"]
            layers = rec["layers"]
            assert sum(layer["bytes_handed"] for layer in layers.values()) == rec["bytes"]
            assert set(layers) == {"linear", "other"}
            assert 0 < layers["linear"]["density"] < 0.5


def _train_with_conv(steps=200):
    """A small CNN on a fixed learnable task: AdaComp's per-layer statistics and that it
    learns."""
    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(1, 16, 5, padding=2),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 32, 4),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model.named_parameters(),
        compression=hc.AdaComp.for_model(model, min_size=0),
    )
    data = torch.Generator().manual_seed(hvd.rank())
    losses, layers = [], []
    for _ in range(steps):
        y = torch.randint(0, 4, (16,), generator=data)
        x = torch.randn(16, 1, 32, generator=data) * 0.5 + y[:, None, None].float()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        layers.append(optimizer.compression_stats()["layers"])
    return losses, layers


@pytest.mark.multiprocess
def test_learns_and_reports_each_layer_type():
    (losses, layers), _ = run_parallel(_train_with_conv, 2)
    assert np.mean(losses[-50:]) < 0.5 * np.mean(losses[:10])
    assert set(layers[-1]) == {"conv", "linear"}
    # A layer may send nothing in a step (every bin's largest residue met an opposing
    # gradient), never everything.
    for step in layers[10:]:
        for layer in step.values():
            assert layer["compression_ratio"] > 1 and 0 <= layer["density"] < 1
    assert np.mean([step["conv"]["density"] for step in layers]) > 0
