"""The quantized formats' table and checks (``cupyln._formats``) and their float64 reference
(``reference.quantize``), on the CPU: hand-computed elements and scales at the edges of each
rule (saturation, ties to even, zero blocks, partial blocks, power-of-two scales), the packing
of NVFP4, the 128x4-tiled scale layout against an independent tiling, and the round trip of
random rows within each format's step."""

import ml_dtypes
import numpy as np
import pytest

from cupyln import _formats as F
from cupyln import reference as ref


def test_spec_refuses_bad_options_by_name():
    cases = [
        ((3, 64), {}, TypeError, "quant must be a format name"),
        (("fp16", 64), {}, ValueError, "quant must be one of fp8, fp8_row"),
        (("nvfp4", 64), {"fp8_dtype": "e5m2"}, ValueError, "fp8_dtype does not apply"),
        (("fp8_row", 64), {"fp8_dtype": "e4m3fn"}, ValueError, "fp8_dtype must be"),
        (("fp8_row", 64), {"block": 128}, ValueError, "block= applies to fp8_block"),
        (("fp8_block", 64), {"block": 32}, ValueError, "block must be 128 or 64"),
        (("mxfp8", 48), {}, ValueError, "multiple of 32; got N = 48"),
        (("nvfp4", 40), {}, ValueError, "multiple of 16; got N = 40"),
        (("mxfp8", 64), {"pow2_scale": True}, ValueError, "pow2_scale applies"),
        (("fp8_block", 64), {"scale_ub": 2.0}, ValueError, "scale_ub applies"),
        (("fp8_row", 64), {"scale_ub": True}, TypeError, "scale_ub must be a positive"),
        (("fp8_row", 64), {"scale_ub": -1.0}, ValueError, "positive finite"),
        (("mxfp8", 64), {"scale_layout": "cutlass"}, ValueError, "scale_layout must be"),
        (("fp8_row", 64), {"scale_layout": "cublas"}, ValueError, "is for mxfp8 and nvfp4"),
    ]
    for args, kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            F.spec(*args, **kw)


def test_spec_of_each_format():
    assert F.spec("fp8", 100).blocks(100) == 0
    assert F.spec("fp8_row", 100).blocks(100) == 1
    assert F.spec("fp8_block", 200).blocks(200) == 2  # the last block partial
    assert F.spec("fp8_block", 200, block=64).blocks(200) == 4
    s = F.spec("mxfp8", 96, fp8_dtype="e5m2")
    assert (s.block, s.dtype, s.max, s.blocks(96)) == (32, F.E5M2, 57344.0, 3)
    s = F.spec("nvfp4", 64, scale_layout="cublas")
    assert (s.block, s.dtype, s.max, s.blocks(64), s.scale_layout) == (16, F.E2M1, 6.0, 4, "cublas")


def test_fp8_per_tensor_rounds_to_nearest_even_and_saturates():
    y = np.array([[448.0, -500.0, 1.0, 2.0**-10, 0.0013, 464.0, 1.0625, 0.0]])
    data, scale = ref.quantize(y, "fp8", scale=1.0)
    assert data.dtype == F.E4M3 and scale.dtype == np.float32 and float(scale) == 1.0
    want = [448.0, -448.0, 1.0, 0.0, 2.0**-9, 448.0, 1.0, 0.0]  # 1.0625 ties to 1.0 (even)
    assert data.astype(np.float64).tolist() == [want]
    data, _ = ref.quantize(y, "fp8", scale=2.0)
    assert data.astype(np.float64)[0, :3].tolist() == [224.0, -256.0, 0.5]
    data, _ = ref.quantize(y * 100, "fp8", scale=1.0, fp8_dtype="e5m2")
    assert data.dtype == F.E5M2 and float(data.astype(np.float64)[0, 0]) == 40960.0


def test_fp8_row_scales_each_row_and_clamps_to_scale_ub():
    y = np.array([[1.0, -3.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [1000.0, 2.0, -1.0, 4.0]])
    data, scale = ref.quantize(y, "fp8_row")
    assert scale.shape == (3, 1) and scale.dtype == np.float32
    assert scale[0, 0] == np.float32(3.5) / np.float32(448.0)
    assert scale[1, 0] == np.float32(1e-12) / np.float32(448.0)  # a zero row: the floor
    assert float(data[0, 1]) == -448.0 and float(data[2, 0]) == 448.0  # amax lands on the top
    assert not data[1].astype(np.float64).any()
    data, scale = ref.quantize(y, "fp8_row", scale_ub=448.0)  # row 2 clamped: s = 1
    assert scale[2, 0] == 1.0 and float(data[2, 0]) == 448.0 and float(data[2, 3]) == 4.0


def test_fp8_block_partial_last_block_and_power_of_two_scales():
    rng = np.random.default_rng(0)
    y = rng.standard_normal((3, 200))
    y[1, 128:] *= 10.0  # the partial block of row 1: its own scale
    data, scale = ref.quantize(y, "fp8_block")
    assert scale.shape == (3, 2) and data.shape == y.shape
    amax = np.abs(y[1, 128:]).max().astype(np.float32)
    assert scale[1, 1] == amax / np.float32(448.0)
    _, p2 = ref.quantize(y, "fp8_block", pow2_scale=True, block=64)
    assert p2.shape == (3, 4) and p2.dtype == np.float32
    for r in range(3):
        for j in range(4):
            a = np.float32(np.abs(y[r, 64 * j : 64 * (j + 1)]).max()) / np.float32(448.0)
            assert p2[r, j] == 2.0 ** np.ceil(np.log2(np.float64(a))), (r, j)
            assert p2[r, j] >= a  # rounded up: nothing saturates


def test_mxfp8_e8m0_rounds_up_and_zero_blocks_are_zero():
    y = np.zeros((1, 128))
    y[0, 0] = 448.0  # block 0: s = 1, byte 127
    y[0, 32] = 449.0  # block 1: past 448, s = 2, byte 128
    y[0, 64] = 3.0 * 2.0**-20  # block 2: 2^ceil(log2(3 * 2^-20 / 448)) = 2^-27, byte 100
    data, scale = ref.quantize(y, "mxfp8")  # block 3: zeros, byte 0
    assert scale.dtype == np.uint8 and scale.tolist() == [[127, 128, 100, 0]]
    assert [float(data[0, i]) for i in (0, 32, 64)] == [448.0, 224.0, 3.0 * 2.0**-20 * 2.0**27]
    assert not data[0, 96:].astype(np.float64).any()
    _, scale = ref.quantize(y, "mxfp8", fp8_dtype="e5m2")
    assert scale.tolist() == [[127 - 7, 127 - 6, 100 - 7, 0]]  # 57344 = 448 * 2^7


def test_nvfp4_packs_low_nibble_first_with_e4m3_block_scales():
    y = np.zeros((1, 32))
    y[0, :6] = [0.5, -0.5, 6.0, 5.0, 0.25, -7.0]  # block 0: amax 7
    gmax = 448.0 * 6.0  # S = 1
    data, scale = ref.quantize(y, "nvfp4", global_amax=gmax)
    assert data.dtype == np.uint8 and data.shape == (1, 16) and scale.dtype == F.E4M3
    sv = float(np.float32(7.0 / 6.0).astype(F.E4M3))  # 1.125 in e4m3
    assert float(scale[0, 0]) == sv and float(scale[0, 1]) == 0.0  # block 1: zeros
    codes = (np.array(y[0, :6] / sv).astype(ml_dtypes.float4_e2m1fn)).view(np.uint8)
    assert data[0, 0] == codes[0] | codes[1] << 4 and data[0, 2] == codes[4] | codes[5] << 4
    assert data[0, 2] >> 4 == 0xF  # -7 / 1.125 saturates to -6 (sign 8 | code 7)
    assert not data[0, 8:].any()
    _, s0 = ref.quantize(y, "nvfp4", global_amax=0.0)  # S = 1 as well
    assert float(s0[0, 0]) == sv


def _to_blocked(scales):
    """The 128x4 tiling as reshapes (cuBLAS's and torch._scaled_mm's layout), padding zero."""
    m, c = scales.shape
    pm, pc = -(-m // 128) * 128, -(-c // 4) * 4
    padded = np.zeros((pm, pc), scales.dtype)
    padded[:m, :c] = scales
    tiles = padded.reshape(pm // 128, 128, pc // 4, 4).transpose(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(pm, pc)


@pytest.mark.parametrize("m,n", [(130, 6 * 32), (128, 128), (5, 32), (300, 10 * 32)])
def test_cublas_layout_is_the_128x4_tiling(m, n):
    y = ref.sample((m, n), np.float64, seed=m + n, xp=np)
    _, rows = ref.quantize(y, "mxfp8")
    _, tiled = ref.quantize(y, "mxfp8", scale_layout="cublas")
    assert tiled.shape == F.cublas_shape(m, n // 32)
    assert np.array_equal(tiled, _to_blocked(rows))
    _, rows = ref.quantize(y, "nvfp4", global_amax=float(np.abs(y).max()))
    _, tiled = ref.quantize(y, "nvfp4", global_amax=float(np.abs(y).max()), scale_layout="cublas")
    assert np.array_equal(tiled.view(np.uint8), _to_blocked(rows).view(np.uint8))


def test_round_trip_within_a_step():
    """Dequantized random rows (-2.3 + 0.5 randn, as the tests' inputs) are within half a step
    of the format of each element's scaled value."""
    y = ref.sample((64, 512), np.float64, seed=7, xp=np)
    rel = 2.0**-4  # half of e4m3's step, relative
    for quant, kw in (("fp8_row", {}), ("fp8_block", {}), ("mxfp8", {}),
                      ("fp8_block", {"pow2_scale": True})):  # fmt: skip
        data, scale = ref.quantize(y, quant, **kw)
        s = scale.astype(np.float64)
        if quant == "mxfp8":
            s = np.ldexp(1.0, scale.astype(np.int64) - 127)
        width = 512 // s.shape[1]
        back = data.astype(np.float64) * np.repeat(s, width, axis=1)
        assert np.all(np.abs(back - y) <= rel * np.abs(y) + 1e-12), quant
    gmax = float(np.abs(y).max())
    data, scale = ref.quantize(y, "nvfp4", global_amax=gmax)
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(64, 512)
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    big = np.float32(448.0 * 6.0) / np.float32(gmax)
    back = vals * np.repeat(scale.astype(np.float64), 16, axis=1) / float(big)
    block_amax = np.repeat(np.abs(y).reshape(64, -1, 16).max(axis=2), 16, axis=1)
    assert np.all(np.abs(back - y) <= 0.19 * block_amax)  # half e2m1's top step (1 of 6)


def test_dequantize_inverts_each_format_within_its_step():
    """reference.dequantize of reference.quantize: each format's values back within its
    rounding (e4m3 3 mantissa bits, e5m2 2, e2m1 1, relative to the block's largest), either
    scale layout alike."""
    y = np.random.default_rng(3).standard_normal((130, 256)) * 3
    for quant, opts, ops, bound in (
        ("fp8", {}, {"scale": 0.03}, 2.0**-4),
        ("fp8_row", {"scale_ub": 5.0}, {}, None),
        ("fp8_block", {"block": 64, "pow2_scale": True}, {}, 2.0**-4),
        ("mxfp8", {}, {}, 2.0**-4),
        ("mxfp8", {"fp8_dtype": "e5m2", "scale_layout": "cublas"}, {}, 2.0**-3),
        ("nvfp4", {"scale_layout": "cublas"}, {"global_amax": 12.0}, 0.25),
    ):
        data, scale = ref.quantize(y, quant, **opts, **ops)
        back = ref.dequantize(data, ops.get("scale", scale), quant, 256,
                              global_amax=ops.get("global_amax"), **opts)  # fmt: skip
        assert back.shape == y.shape
        if bound is None:  # scale_ub: rows past it saturate at 448 * 5 / 448
            small = np.abs(y) < 4
            assert np.abs(back).max() <= 5.0 * (1 + 1e-6)
            assert np.allclose(back[small], y[small], rtol=2.0**-4, atol=1e-3)
            continue
        assert np.abs(back - y).max() <= bound * np.abs(y).max(), quant
