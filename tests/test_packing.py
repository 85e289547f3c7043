"""The wire format of integer codes: numpy reference and PyTorch port, byte for byte."""

import numpy as np
import pytest
import torch

from hvd_compress import packing
from hvd_compress.codes import FieldCodes, FloatCodes, IntCodes, SignCodes, shard_length
from hvd_compress.pt import packing as pt_packing
from hvd_compress.pt.buckets import rescale

from .devices import DEVICES

LENGTHS = [0, 1, 3, 4, 5, 1_000_003]
BOUNDS = [1, 2, 7, 100, 2048, 40000]  # widths 2, 4, 4, 8, 16, 32


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_and_ports_agree(numel, bound, device):
    space = IntCodes(bound)
    codes = np.random.default_rng(numel + bound).integers(-bound, bound + 1, numel)
    packed = packing.pack(codes, space)
    assert packed.dtype == np.uint8 and packed.size == space.packed_nbytes(numel)
    np.testing.assert_array_equal(packing.unpack(packed, space, numel), codes)
    packed_pt = pt_packing.pack(torch.from_numpy(codes).to(device), space)
    np.testing.assert_array_equal(packed_pt.cpu().numpy(), packed)
    np.testing.assert_array_equal(pt_packing.unpack(packed_pt, space, numel).cpu().numpy(), codes)


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_one_bit_fields_ports_agree(numel, rows, device):
    # Signs (from int8 codes, as BlockSign makes them, and from int64) and one-bit fields
    # take the port's eight-fields-per-multiplication path.
    rng = np.random.default_rng(numel + rows)
    signs = rng.choice(np.array([-1, 1]), (rows, numel))
    bits = rng.integers(0, 2, (rows, numel))
    for codes, space in ((signs, SignCodes()), (bits, FieldCodes(1))):
        packed = packing.pack(codes, space)
        assert packed.shape == (rows, space.packed_nbytes(numel))
        for dtype in (torch.int8, torch.int64):
            packed_pt = pt_packing.pack(torch.from_numpy(codes).to(device, dtype), space)
            np.testing.assert_array_equal(packed_pt.cpu().numpy(), packed)
        unpacked = pt_packing.unpack(packed_pt, space, numel)
        np.testing.assert_array_equal(unpacked.cpu().numpy(), codes)


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("device", DEVICES)
def test_scaled_signs_are_rescaled_unpacked_signs(numel, device):
    # The sharded server's shortcut: one gather of +-scale per row, NaN where the scale is
    # not finite, bit for bit what unpacking and ``rescale`` give.
    rng = np.random.default_rng(numel)
    signs = rng.choice(np.array([-1, 1], dtype=np.int8), (4, numel))
    packed = pt_packing.pack(torch.from_numpy(signs).to(device), SignCodes())
    scale = torch.tensor([[0.25], [3e-30], [float("inf")], [float("nan")]], device=device)
    for length in {numel, max(numel - 3, 0)}:
        got = pt_packing.unpack_scaled_signs(packed, scale, length)
        want = rescale(pt_packing.unpack(packed, SignCodes(), length), scale, max(length, 1), 1)
        assert got.dtype == torch.float32 and got.shape == want.shape == (4, length)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        assert got[2:].isnan().all()


def test_ternary_layout_is_four_codes_per_byte_little_endian():
    # codes -1, 0, 1, 1 -> unsigned 0, 1, 2, 2 -> 0b10_10_01_00
    packed = packing.pack(np.array([-1, 0, 1, 1, 1]), IntCodes(1))
    assert packed.tolist() == [0b10100100, 0b01010110]  # padding codes are 0 -> unsigned 1


def test_rows_pack_independently():
    space = IntCodes(4)
    rows = np.random.default_rng(0).integers(-4, 5, (3, 7))
    packed = packing.pack(rows, space)
    assert packed.shape == (3, 4)
    for row, out in zip(rows, packed):
        np.testing.assert_array_equal(packing.pack(row, space), out)
    np.testing.assert_array_equal(packing.unpack(packed, space, 7), rows)


def test_widths_and_sums():
    assert [IntCodes(b).width for b in (1, 2, 7, 8, 127, 128, 32767, 32768)] == [
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        32,
    ]
    assert IntCodes(1).summed(4) == IntCodes(4)
    assert IntCodes(1).allreduce_carrier(2, ("float16", "int32")) == "float16"
    assert IntCodes(1).allreduce_carrier(2049, ("float16", "int32")) == "int32"
    assert IntCodes(1).allreduce_carrier(100, ("int8", "float16", "int32")) == "int8"
    assert FloatCodes().packed_nbytes(10) == 20
    with pytest.raises(OverflowError):
        IntCodes(1).allreduce_carrier(3000, ("int8", "float16"))


@pytest.mark.parametrize("numel,world", [(1, 2), (10, 4), (1001, 4), (8, 3)])
def test_shards_are_byte_aligned_and_cover(numel, world):
    spaces = (IntCodes(1), IntCodes(world))
    length = shard_length(numel, world, *spaces)
    assert length * world >= numel
    assert all(length % s.codes_per_byte == 0 for s in spaces)
