"""Tandem's CPU kernel (tandem.engine.rowgemm): right, against float64 sums; a row's result the same
whatever the other rows of its call, on every ISA it runs on; bfloat16, int8 and int4 layouts included.
The layers built on it are tested as layers in tests/test_invariance.py."""

import pytest
import torch

from tandem.engine import rowgemm
from tandem.engine.gemm import u8s8_pairs_saturate

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not rowgemm.available(), reason="the kernel is not built, or this CPU cannot run it")]

# rows: one (a decode step), the kernel's row blocks (AVX-512: 6, AVX2: 3) and around them, a prefill's worth
ROWS = (1, 2, 5, 6, 7, 13, 16, 17, 70)


def alone(x: torch.Tensor, packed, out: int, **kw) -> torch.Tensor:
    return torch.cat([rowgemm.linear(x[i:i + 1], packed, out, **kw) for i in range(len(x))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_weights_sum_right_and_each_row_as_if_alone(dtype):
    """Output sizes off the tile (130) and inputs longer than a block of the kernel (1100 > 512)."""
    torch.manual_seed(0)
    w = torch.randn(130, 1100).to(dtype)
    x = torch.randn(70, 1100)
    packed = rowgemm.pack(w)
    full = rowgemm.linear(x, packed, 130)
    assert full.shape == (70, 130) and full.dtype == torch.float32
    assert torch.allclose(full.double(), x.double() @ w.double().T, atol=1e-3)
    lone = alone(x, packed, 130)
    assert all(torch.equal(rowgemm.linear(x[:n], packed, 130), lone[:n]) for n in ROWS)


def test_bfloat16_weights_are_the_float32_kernel_on_them_widened():
    torch.manual_seed(1)
    w, x = torch.randn(64, 300).bfloat16(), torch.randn(9, 300)
    assert torch.equal(rowgemm.linear(x, rowgemm.pack(w), 64), rowgemm.linear(x, rowgemm.pack(w.float()), 64))


@pytest.mark.skipif(rowgemm.isa() not in ("avx512", "avx512-bf16"), reason="needs AVX-512 beside AVX2")
def test_avx2_and_avx512_give_the_same_bits():
    """Each output is one multiply-add per input in order, whatever the vector width."""
    torch.manual_seed(2)
    w, x = torch.randn(200, 700), torch.randn(13, 700)
    packed = rowgemm.pack(w)
    assert torch.equal(rowgemm.linear(x, packed, 200, which=1), rowgemm.linear(x, packed, 200, which=2))


@pytest.mark.skipif(not rowgemm.pairs(), reason="needs AVX512-BF16")
def test_bfloat16_inputs_in_pairs():
    """An odd input size is padded with a zero."""
    torch.manual_seed(3)
    w, x = torch.randn(130, 601).bfloat16(), torch.randn(40, 601).bfloat16()
    packed = rowgemm.pack(w, in_pairs=True)
    full = rowgemm.linear(x, packed, 130)
    assert torch.allclose(full.double(), x.double() @ w.double().T, atol=1e-3)
    lone = alone(x, packed, 130)
    assert all(torch.equal(rowgemm.linear(x[:n], packed, 130), lone[:n]) for n in ROWS)


# the int8 ISAs this CPU runs (rowgemm.sums_int8's `which`): AVX2, and AVX512-VNNI and AMX-INT8 where it has them
INT8_ISAS = [1, 2, 3][:("none", "avx2", "avx512-vnni", "amx-int8").index(rowgemm.int8_isa())]


@pytest.mark.skipif(not rowgemm.int8(), reason="needs AVX2 or AVX512-VNNI")
@pytest.mark.parametrize("which", INT8_ISAS)
def test_int8_sums_are_exact_on_every_isa(which):
    """Inputs as uint8 (int8 + 128) against int8 weights, every extreme included, at every count of
    rows around the row blocks (VNNI's 6, AVX2's 2); the sums are exact integers, so they equal
    torch's int64 ones whatever the ISA."""
    torch.manual_seed(4)
    w = torch.randint(-127, 128, (130, 1030), dtype=torch.int8)
    w[0] = 127
    w[1] = -127
    w[2] = -128
    x = torch.randint(0, 256, (70, 1030), dtype=torch.uint8)
    x[0] = 255
    x[1] = 0
    exact = (x.long() - 128) @ w.long().T
    packed = rowgemm.pack_int8(w)
    assert all(torch.equal(rowgemm.sums_int8(x[:n], packed, 130, which).long(), exact[:n]) for n in ROWS)


@pytest.mark.skipif(not rowgemm.int8(), reason="needs AVX2 or AVX512-VNNI")
def test_the_fused_int8_layer_is_the_torch_formula_bit_for_bit():
    """Quantizing each row, the sums and the scales in one call give what the same steps in torch
    give (halves rounded to even included), on oneDNN's sums too (exact with 7-bit weights where
    its pairs of products saturate)."""
    torch.manual_seed(5)
    top = 63 if u8s8_pairs_saturate() else 127
    w = torch.randint(-top, top + 1, (130, 1030), dtype=torch.int8)
    scales = torch.rand(130) / 100
    x = torch.randn(70, 1030)
    x[3, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0, 3.5, -3.5])   # row 3's scale is 1
    x[4] = 0
    scale = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    q = (torch.round(x / scale) + 128).to(torch.uint8)
    packed = rowgemm.pack_int8(w)
    by_torch = rowgemm.sums_int8(q, packed, 130).float() * scales * scale
    onednn = torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, torch.ops.onednn.qlinear_prepack(w, None), scales,
                                                torch.zeros(130, dtype=torch.long), None, 1.0, 0, torch.float32,
                                                "none", [], "") * scale
    for which in INT8_ISAS:
        fused = rowgemm.linear_int8(x, packed, scales, 130, which)
        assert torch.equal(fused, by_torch) and torch.equal(fused, onednn)
        assert torch.equal(rowgemm.linear_int8(x[3:4], packed, scales, 130, which), fused[3:4])


INT4_ISAS = [1, 2][:["none", "avx2", "avx512-vnni"].index(rowgemm.int4_isa())]


@pytest.mark.skipif(not rowgemm.int4(), reason="needs AVX512-VNNI or AVX2")
@pytest.mark.parametrize("which", INT4_ISAS)
def test_int4_groups_sum_right_and_each_row_as_if_alone(which):
    """Weights at both extremes (-8, 7) and inputs at both (the rows' largest magnitudes, so the
    AVX2 path's int16 sums reach their bound), inputs not a whole number of groups (1100 = 17
    groups and 12) and longer than a block of the kernel (512): each group's exact integer sum
    times its scale, groups added in order, times the row's scale (as int8's rows are quantized);
    every ISA gives the same bits."""
    torch.manual_seed(7)
    w = torch.randint(-8, 8, (130, 1100), dtype=torch.int8)
    w[0], w[1] = 7, -8
    groups = -(-1100 // rowgemm.GROUP)
    scales = (torch.rand(130, groups) + 0.01).half().float()      # stored as float16
    x = torch.randn(70, 1100)
    x[0], x[1] = 1.0, -1.0
    packed = rowgemm.pack_int4(w, scales)
    full = rowgemm.linear_int4(x, packed, 130, which)
    row_scale = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    q = torch.zeros(70, groups * rowgemm.GROUP, dtype=torch.float64)
    q[:, :1100] = torch.round(x / row_scale).double()
    wide = torch.zeros(130, groups * rowgemm.GROUP, dtype=torch.float64)
    wide[:, :1100] = w.double()
    sums = torch.einsum("mgi,ngi->mng", q.view(70, groups, -1), wide.view(130, groups, -1))
    assert torch.equal(sums, sums.round())                    # exact in float64 too
    expected = (sums * scales.double()).sum(-1) * row_scale.double()
    assert torch.allclose(full.double(), expected, rtol=1e-5, atol=1e-4)
    lone = torch.cat([rowgemm.linear_int4(x[i:i + 1], packed, 130, which) for i in range(70)])
    assert all(torch.equal(rowgemm.linear_int4(x[:n], packed, 130, which), lone[:n]) for n in ROWS)
    assert torch.equal(full, rowgemm.linear_int4(x, packed, 130, INT4_ISAS[0]))


def test_a_wrong_input_is_refused_with_its_reason():
    packed = rowgemm.pack(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="x has 16 features, the weight 32"):
        rowgemm.linear(torch.randn(2, 16), packed, 64)
    with pytest.raises(RuntimeError, match="weights are float32 or bfloat16"):
        rowgemm.pack(torch.zeros(4, 4, dtype=torch.float16))
    if rowgemm.int8():
        with pytest.raises(RuntimeError, match=r"int8 ISA 4 \(1 AVX2, 2 AVX512-VNNI, 3 AMX-INT8\) is beyond this CPU's"):
            packed = rowgemm.pack_int8(torch.zeros(64, 8, dtype=torch.int8))
            rowgemm.sums_int8(torch.zeros(1, 8, dtype=torch.uint8), packed, 64, which=4)
    if rowgemm.int4():
        packed = rowgemm.pack_int4(torch.zeros(64, 128, dtype=torch.int8), torch.ones(64, 2))
        with pytest.raises(RuntimeError, match="x has 16 features, the weight 128"):
            rowgemm.linear_int4(torch.randn(2, 16), packed, 64)
        with pytest.raises(RuntimeError, match=r"int4 ISA 3 \(1 AVX2, 2 AVX512-VNNI\) is beyond this CPU's"):
            rowgemm.linear_int4(torch.randn(2, 128), packed, 64, which=3)


def test_bfloat16_serves_on_onednn_where_the_cpu_has_amx_tiles(monkeypatch):
    from tandem.engine import gemm
    monkeypatch.setattr(gemm, "amx_tiles", lambda: True)
    assert gemm.own_kernel(torch.float32) and not gemm.own_kernel(torch.bfloat16)
    assert not gemm.PackedLinear(torch.nn.Linear(8, 8).bfloat16()).own_kernel
    monkeypatch.setattr(gemm, "amx_tiles", lambda: False)
    assert gemm.own_kernel(torch.bfloat16) and gemm.PackedLinear(torch.nn.Linear(8, 8).bfloat16()).own_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_on_the_kernel_keeps_its_shape_bias_and_dtype(dtype, monkeypatch):
    """gemm.PackedLinear on this kernel: outputs off the tile (130), a batch of sequences, a bias."""
    from tandem.engine import gemm
    from tandem.engine.gemm import PackedLinear
    monkeypatch.setattr(gemm, "amx_tiles", lambda: False)      # bfloat16 on this kernel on any CPU
    torch.manual_seed(6)
    linear = torch.nn.Linear(100, 130).to(dtype)
    layer = PackedLinear(linear)
    assert layer.own_kernel
    x = torch.randn(2, 3, 100).to(dtype)
    out = layer(x)
    assert out.shape == (2, 3, 130) and out.dtype == dtype
    assert torch.allclose(out.float(), linear(x).float(), atol=0.03 if dtype == torch.bfloat16 else 1e-4)
