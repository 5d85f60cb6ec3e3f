"""The NKI emulator itself: each hardware rule it enforces fires, and the instructions compute what
the NKI documentation says they compute."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

from permgen.nki import emulator as nki_emulator
from permgen.nki.emulator import EmulatorError, jit, simulate
from permgen.nki.emulator.api import isa as nisa  # what kernels see as nki.isa
from permgen.nki.emulator.api import language as nl
from permgen.nki.emulator.testing import nki_modules_restored


@pytest.fixture(autouse=True)
def one_core(monkeypatch):
    """These tests launch their kernels without brackets (LNC=1), so they declare LNC=1 (Trn2's
    default is 2); the LNC tests below set what they need."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")


def run(body, *arrays):
    """Run `body(*hbm_tensors)` as a kernel; it returns the output tensors."""
    return jit(body)(*arrays)


def in_sbuf(src, dtype=None, copy=nisa.dma_copy):
    """A new SBUF tile of src's shape (and dtype, unless given) that copy (a DMA, or an engine's
    tensor_copy) fills from src."""
    tile = nl.ndarray(src.shape, dtype=dtype or src.dtype, buffer=nl.sbuf)
    copy(dst=tile, src=src)
    return tile


def to_output(tile):
    """A kernel output: a new shared_hbm tensor that tile is DMA'd into."""
    out = nl.ndarray(tile.shape, dtype=tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def assert_refused(match, body, *arrays):
    """Running body(*arrays) as a kernel raises EmulatorError with a message matching match."""
    with pytest.raises(EmulatorError, match=match):
        run(body, *arrays)


def copy_through_sbuf(a):
    return to_output(in_sbuf(a))


def indexed_rows(src, idx, indirect_dim=0, **dma_options):
    """A new SBUF tile of the two 4-element rows of src that idx (an int32 [2, 1] tile) indexes: a DMA
    through the indirect access pattern [[4, 2], [1, 4]]."""
    tile = nl.ndarray((2, 4), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src.ap([[4, 2], [1, 4]], offset=0, vector_offset=idx, indirect_dim=indirect_dim),
                  **dma_options)
    return tile


def test_round_trip_and_simulate_signature():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(run(copy_through_sbuf, a), a)
    np.testing.assert_array_equal(simulate(jit(copy_through_sbuf))(a), a)
    b = a.astype(ml_dtypes.bfloat16)
    assert run(copy_through_sbuf, b).dtype == b.dtype


def test_install_registers_modules_only_without_real_nki():
    with nki_modules_restored():
        installed = nki_emulator.install()
        assert installed == (not nki_emulator.real_nki_available() or getattr(sys.modules.get("nki"), "__nki_emulator__", False))
        if installed:
            import nki
            import nki.isa
            import nki.language
            assert nki.language is nl and nki.isa is nisa and nki.__nki_emulator__


# --- tile limits ---------------------------------------------------------------------------
def test_partition_dimension_at_most_128():
    assert_refused("partition dimension 129 exceeds 128",
                   lambda: nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf))
    assert_refused("partition dimension", lambda: nl.ndarray((256, 4), dtype=nl.float32, buffer=nl.psum))


def test_tiles_need_a_free_axis():
    assert_refused("partition axis and a free axis", lambda: nl.ndarray((128,), dtype=nl.float32, buffer=nl.sbuf))


def test_psum_tile_fits_one_bank():
    """Tiling overview, Tile-Size Constraint#2: a PSUM tile's free size is at most psum_bank_fmax == 512
    (elements, whatever the dtype); NeuronCore-v4's nc_matmul writes up to the whole PSUM, and no page
    lets any other instruction use so wide a tile."""
    assert_refused("must not exceed one bank", lambda: nl.ndarray((128, 513), dtype=nl.float32, buffer=nl.psum))
    assert_refused("must not exceed one bank", lambda: nl.ndarray((128, 1024), dtype=nl.bfloat16, buffer=nl.psum))
    run(lambda a: [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum), a][1], np.zeros((1, 1), np.float32))

    def wide(a, reads_it):
        acc = nl.ndarray((1, 4096), dtype=nl.float32, buffer=nl.psum)
        ones = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(ones, value=1.0)
        moving = nl.ndarray((1, 4096), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(moving, value=2.0)
        nisa.nc_matmul(dst=acc, stationary=ones, moving=moving)
        if reads_it:
            nisa.tensor_copy(dst=moving, src=acc)
        return a
    with nki_emulator.on(nki_emulator.Platform("trn3")):
        run(lambda a: wide(a, False), np.zeros((1, 1), np.float32))
        assert_refused("wider than one bank.*not documented", lambda a: wide(a, True), np.zeros((1, 1), np.float32))
    assert_refused("must not exceed one bank", lambda a: wide(a, False), np.zeros((1, 1), np.float32))


def test_psum_capacity_counts_live_tiles():
    def body():
        banks = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(9)]
        return banks
    assert_refused("psum exhausted", body)


@pytest.mark.parametrize("generation, kib", [("trn2", 224), ("trn3", 256)])
def test_sbuf_holds_its_generations_bytes_per_partition(generation, kib):
    """trainium2_arch: "NeuronCore-v3 SBUF capacity is 28MiB (or, 128 partitions of 224KiB)";
    trainium3_arch: "The NeuronCore-v4 SBUF capacity is 32 MiB" (256 KiB per partition)."""
    def fills(extra):
        def body(a):
            full = nl.ndarray((128, kib * 256), dtype=nl.float32, buffer=nl.sbuf)
            more = [nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)] if extra else []
            return [a, full, more][0]
        return body
    with nki_emulator.on(nki_emulator.Platform(generation)):
        run(fills(False), np.zeros((1, 1), np.float32))
        assert_refused("sbuf exhausted", fills(True), np.zeros((1, 1), np.float32))
        assert nl.tile_size.sbuf_size_bytes == kib * 1024 * 128


def test_sbuf_capacity_counts_live_tiles_and_frees_dead_ones():
    def leaky():
        return [nl.ndarray((128, 16 * 1024), dtype=nl.float32, buffer=nl.sbuf) for _ in range(4)]  # 4 x 64 KiB
    assert_refused("sbuf exhausted", leaky)

    def loop(a):
        for _ in range(10):  # each iteration's tile dies when the name is rebound
            tile = nl.ndarray((128, 16 * 1024), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(tile, value=0.0)
        return copy_through_sbuf(a)
    run(loop, np.zeros((2, 2), np.float32))


# --- poisoned memory -------------------------------------------------------------------------
def test_fresh_memory_is_poisoned():
    def body(a):
        out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile[0:2, :], src=a)  # rows 2, 3 never written
        nisa.dma_copy(dst=out, src=tile)
        return out
    out = run(body, np.ones((2, 4), np.float32))
    assert np.isnan(out[2:]).all() and (out[:2] == 1).all()


def test_unwritten_integer_memory_is_poison_not_zero():
    def body(a):
        out = nl.ndarray((2, 2), dtype=nl.int32, buffer=nl.shared_hbm)
        tile = nl.ndarray((2, 2), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=out, src=tile)
        return out
    assert (run(body, np.zeros((1, 1), np.int32)) != 0).all()


def test_never_written_index_tile_is_rejected():
    def body(a):
        idx = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.sbuf)
        indexed_rows(a, idx, oob_mode=nisa.oob_mode.skip)
        return copy_through_sbuf(a)
    assert_refused("never-written", body, np.zeros((3, 4), np.float32))


def test_nan_to_integer_conversion_is_an_error():
    def body(a):
        f = nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf)
        i = nl.ndarray((2, 2), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=i, src=f)
        return copy_through_sbuf(a)
    assert_refused("never written", body, np.zeros((1, 1), np.float32))


# --- DMA -------------------------------------------------------------------------------------
def gather_rows(a, idx, mode):
    out = nl.ndarray((idx.shape[0], a.shape[1]), dtype=a.dtype, buffer=nl.shared_hbm)
    idx_tile = in_sbuf(idx)
    rows = nl.ndarray((idx.shape[0], a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
    nisa.memset(rows, value=0.0)
    nisa.dma_copy(dst=rows, src=a.ap([[a.shape[1], idx.shape[0]], [1, a.shape[1]]], offset=0, vector_offset=idx_tile,
                                     indirect_dim=0), oob_mode=mode)
    nisa.dma_copy(dst=out, src=rows)
    return out


def test_indirect_gather_and_out_of_bounds_lanes():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    idx = np.array([[2], [0], [-1], [3]], dtype=np.int32)
    out = run(lambda a, i: gather_rows(a, i, nisa.oob_mode.skip), a, idx)
    np.testing.assert_array_equal(out, np.stack([a[2], a[0], np.zeros(4), np.zeros(4)]))
    assert_refused("out of bounds at lanes \\[2, 3\\]", lambda a, i: gather_rows(a, i, nisa.oob_mode.error), a, idx)


def test_indirect_scatter_skips_out_of_bounds_lanes():
    def body(src, idx):
        out = nl.ndarray((4,), dtype=src.dtype, buffer=nl.shared_hbm)
        zero = nl.ndarray((4, 1), dtype=src.dtype, buffer=nl.sbuf)
        nisa.memset(zero, value=0.0)
        nisa.dma_copy(dst=out.ap([[1, 4], [1, 1]], offset=0), src=zero)
        vals = nl.ndarray((3, 1), dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=vals, src=src)
        where = nl.ndarray((3, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=where, src=idx)
        nisa.dma_copy(dst=out.ap([[1, 3], [1, 1]], offset=0, vector_offset=where, indirect_dim=0), src=vals,
                      oob_mode=nisa.oob_mode.skip)
        return out
    out = run(body, np.array([[5.0], [6.0], [7.0]], np.float32), np.array([[3], [4], [0]], np.int32))
    np.testing.assert_array_equal(out, [7.0, 0.0, 0.0, 5.0])


def test_dma_converts_and_needs_equal_element_counts():
    """nki.isa.dma_copy: a cast happens when the dtypes differ; the two sides need equal element
    counts, not equal shapes (a direct copy moves elements in row-major order)."""
    def converts(a):
        tile = in_sbuf(a, nl.bfloat16)
        return to_output(tile)
    a = np.array([[1.00390625, 2.5]], np.float32)
    np.testing.assert_array_equal(run(converts, a), a.astype(ml_dtypes.bfloat16))

    def reshapes(a, rows):
        tile = nl.ndarray((rows, 1), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=a)
        return to_output(tile)
    a = np.arange(4, dtype=np.float32).reshape(2, 2)
    np.testing.assert_array_equal(run(lambda a: reshapes(a, 4), a)[:, 0], [0, 1, 2, 3])
    assert_refused("element counts differ", lambda a: reshapes(a, 3), a)


def test_indirect_rows_move_by_the_tensor_row_stride():
    """The indexed dimension of an indirect access pattern moves by the base tensor's row stride, not
    by the pattern's step: indices [1, 2] on an [R, 8] tensor read elements 8.. and 16.., as on the
    hardware (the emulator used to read 4.. and 8..)."""
    def body(a, idx):
        return to_output(indexed_rows(a, in_sbuf(idx)))
    a = np.arange(24, dtype=np.float32).reshape(3, 8)
    np.testing.assert_array_equal(run(body, a, np.array([[1], [2]], np.int32)), a[1:3, 0:4])


def test_view_zeroes_fp8_through_integers():
    def body(a):
        tile = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.memset(tile.view(nl.uint8), value=0)
        return to_output(tile)
    got = run(body, np.ones((2, 3), ml_dtypes.float8_e5m2))
    assert got.dtype == np.dtype(ml_dtypes.float8_e5m2) and not got.view(np.uint8).any()
    assert_refused("does not split", lambda a: [nl.ndarray((2, 3), dtype=nl.uint8, buffer=nl.sbuf).view(nl.uint16)],
                   np.zeros((1, 1), np.uint8))


def test_vector_offset_rules():
    def body(a, idx):
        indexed_rows(a, idx)
        return copy_through_sbuf(a)
    assert_refused("vector_offset must be an SBUF tile", body, np.zeros((3, 4), np.float32), np.zeros((2, 1), np.int32))

    def indexes_sbuf(a):
        """The indexed tensor must be in HBM (DGE gathers/scatters HBM rows with SBUF indices)."""
        idx = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(idx, value=0)
        rows = nl.ndarray((3, 4), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=a)
        indexed_rows(rows, idx)
        return copy_through_sbuf(a)
    assert_refused("vector_offset indexes HBM tensors only", indexes_sbuf, np.zeros((3, 4), np.float32))


def test_slices_stay_in_bounds():
    def body(a):
        tile = nl.ndarray((4, 4), dtype=a.dtype, buffer=nl.sbuf)
        return tile[0:5, :]
    assert_refused("out of bounds", body, np.zeros((1, 1), np.float32))


def test_outputs_must_be_shared_hbm():
    def body(a):
        tile = in_sbuf(a)
        return tile
    assert_refused("shared_hbm", body, np.zeros((2, 2), np.float32))


# --- compute engines ----------------------------------------------------------------------------
def test_engines_cannot_read_hbm():
    def body(a):
        tile = in_sbuf(a, copy=nisa.tensor_copy)
        return copy_through_sbuf(a)
    assert_refused("compute engines cannot read HBM", body, np.zeros((2, 2), np.float32))


def test_matmul_layout_and_dtype_rules():
    def body(a, b, psum_dtype=nl.float32, dst_shape=None):
        sa = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        out_tile = nl.ndarray(dst_shape or (a.shape[1], b.shape[1]), dtype=psum_dtype, buffer=nl.psum)
        nisa.nc_matmul(dst=out_tile, stationary=sa, moving=sb)
        result = in_sbuf(out_tile, nl.float32, copy=nisa.tensor_copy)
        return to_output(result)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((5, 6)).astype(np.float32)
    np.testing.assert_allclose(run(body, a, b), a.T @ b, rtol=1e-5)
    assert_refused("contraction", body, a, b[:4].copy())
    assert_refused("fp32 PSUM", lambda a, b: body(a, b, psum_dtype=nl.bfloat16), a, b)
    assert_refused("stationary dtype int32", body, a.astype(np.int32), b)
    # fp32 pairs only with fp32; bf16 x bf16 is fine.
    assert_refused("fp32 pairs only with fp32", body, a, b.astype(ml_dtypes.bfloat16))
    bf_a, bf_b = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(run(body, bf_a, bf_b), bf_a.astype(np.float32).T @ bf_b.astype(np.float32), rtol=1e-5)
    # float8_e4m3fn is a NeuronCore-v4 (Trainium3) Tensor Engine format (on Trainium2 it is no data type at all).
    f8_a, f8_b = a.astype(ml_dtypes.float8_e4m3fn), b.astype(ml_dtypes.float8_e4m3fn)
    assert_refused("F8E4M3FN is not supported on TRN1/TRN2", body, f8_a, f8_b)
    with nki_emulator.on(nki_emulator.Platform("trn3")):
        np.testing.assert_allclose(run(body, f8_a, f8_b), f8_a.astype(np.float32).T @ f8_b.astype(np.float32), rtol=1e-5)
        # NeuronCore-v4: legacy float8_e4m3 and OCP float8_e4m3fn do not mix; a bf16 dst is allowed.
        assert_refused("cannot mix float8_e4m3 and float8_e4m3fn", body, a.astype(ml_dtypes.float8_e4m3), f8_b)
        want = (bf_a.astype(np.float32).T @ bf_b.astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(run(lambda a, b: body(a, b, psum_dtype=nl.bfloat16), bf_a, bf_b), want)
    assert_refused("free sizes", lambda a, b: body(a, b, dst_shape=(2, 4)), np.zeros((2, 129), np.float32),
                   np.zeros((2, 4), np.float32))


@pytest.mark.parametrize("generation, dst_dtype, widest", [("trn2", nl.float32, 512), ("trn3", nl.float32, 4096),
                                                         ("trn3", nl.bfloat16, 8192)])
def test_matmul_moving_tile_limit_by_generation(generation, dst_dtype, widest):
    """nki.isa.nc_matmul, "Tile size": the moving free size is at most 512 on NeuronCore-v2/v3; starting
    NeuronCore-v4, 4096 for a float32 dst or 8192 for a bfloat16 dst."""
    def body(a, columns):
        ones = nl.ndarray((1, 1), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(ones, value=1.0)
        moving = nl.ndarray((1, columns), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(moving, value=1.0)
        nisa.nc_matmul(dst=nl.ndarray((1, columns), dtype=dst_dtype, buffer=nl.psum), stationary=ones, moving=moving)
        return a
    a = np.zeros((1, 1), np.float32)
    with nki_emulator.on(nki_emulator.Platform(generation)):
        run(lambda a: body(a, widest), a)
        assert_refused(f"moving, <= {widest}|must not exceed one bank", lambda a: body(a, widest + 1), a)


def test_tensors_have_the_documented_attributes():
    """nki.language.NkiTensor documents shape, strides, offset, name, dtype, buffer, ndim and size, and no
    itemsize."""
    def body(a):
        view = a[1:3, 2:4]
        assert (view.shape, view.size, view.ndim, view.strides, view.offset) == ((2, 2), 4, 2, (5, 1), 7)
        assert view.dtype == nl.float32 and view.buffer is nl.shared_hbm and a.get_pattern() == [[5, 3], [1, 5]]
        assert a.is_contiguous() and not view.is_contiguous() and not a.is_indirect()
        assert a.view(nl.uint8).shape == (3, 20) and a.reinterpret_cast(nl.int32).dtype == nl.int32
        with pytest.raises(AttributeError):
            a.itemsize
        with pytest.raises(EmulatorError, match="NkiTensor.reshape is documented but not emulated"):
            a.reshape((15,))
        return copy_through_sbuf(a)
    run(body, np.zeros((3, 5), np.float32))


def test_dtypes_are_strings():
    """The nki.language stub: `DType = str`. A kernel keys tables by the name and compares names; NumPy's
    dtype methods are not there."""
    def body(a):
        assert nl.float32 == "float32" and a.dtype == nl.float32 and isinstance(a.dtype, str)
        assert {nl.float32: 4}[a.dtype] == 4 and a.view(nl.uint8).dtype == nl.uint8
        with pytest.raises(AttributeError):
            a.dtype.itemsize
        return copy_through_sbuf(a)
    run(body, np.zeros((1, 2), np.float32))


def test_vector_offset_indexes_dimension_0_through_software_dge():
    """nki-aps: with vector_offset "only indirect_dim=0 is supported"; nki-dge: "the DGE mode is
    constrained to swdge" (dge_mode unknown selects it)."""
    def gather(a, dim=0, mode=nisa.dge_mode.unknown):
        idx = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(idx, pattern=[[0, 1]], offset=0, channel_multiplier=2)
        return to_output(indexed_rows(a, idx, indirect_dim=dim, dge_mode=mode))
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    for mode in (nisa.dge_mode.unknown, nisa.dge_mode.swdge):
        np.testing.assert_array_equal(run(lambda a: gather(a, mode=mode), a), a[[0, 2]])
    for mode in (nisa.dge_mode.hwdge, nisa.dge_mode.none):
        assert_refused("constrained to swdge", lambda a: gather(a, mode=mode), a)
    assert_refused("only indirect_dim=0 is supported", lambda a: gather(a, dim=1), a)


def test_int32_tensor_tensor_is_exact_on_gpsimd():
    """nki.isa.tensor_tensor (from 2.29): int32/uint32 tiles default to GpSimd's native integer arithmetic,
    "exact results for all 32-bit integer values"; engine=vector, or an operand in PSUM, computes in fp32."""
    def add(a, b, engine=nisa.engine.unknown, through_psum=False):
        x = nl.ndarray(a.shape, dtype=nl.int32, buffer=nl.sbuf)
        y = nl.ndarray(a.shape, dtype=nl.int32, buffer=nl.psum if through_psum else nl.sbuf)
        nisa.dma_copy(dst=x, src=a)
        if through_psum:
            staged = nl.ndarray(a.shape, dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=staged, src=b)
            nisa.tensor_copy(dst=y, src=staged)
        else:
            nisa.dma_copy(dst=y, src=b)
        nisa.tensor_tensor(dst=x, data1=x, data2=y, op=nl.add, engine=engine)
        return to_output(x)
    a, b = np.array([[(1 << 24) + 1]], np.int32), np.array([[2]], np.int32)
    assert run(add, a, b)[0, 0] == (1 << 24) + 3
    assert run(lambda a, b: add(a, b, engine=nisa.engine.gpsimd), a, b)[0, 0] == (1 << 24) + 3
    rounded = int(np.float32(np.float32((1 << 24) + 1) + np.float32(2)))
    assert rounded != (1 << 24) + 3
    assert run(lambda a, b: add(a, b, engine=nisa.engine.vector), a, b)[0, 0] == rounded
    assert run(lambda a, b: add(a, b, through_psum=True), a, b)[0, 0] == rounded
    with nki_emulator.on(nki_emulator.Platform(sdk="2.28")):  # before 2.29 the page documents fp32 only
        assert run(add, a, b)[0, 0] == rounded
    assert_refused("overflow is not documented", add, np.array([[2**31 - 1]], np.int32), b)


def test_conversions_go_through_fp32():
    """nki.isa.dma_copy: a conversion is "first casting from src.dtype to float32, then from float32 to
    dst.dtype"; nki.isa.tensor_copy: bit-accurate for equal dtypes, an "intermediate FP32 cast" otherwise."""
    def copies(a):
        by_dma = in_sbuf(a, nl.uint32)
        same = in_sbuf(a, nl.int32)
        by_engine = in_sbuf(same, nl.uint32, copy=nisa.tensor_copy)
        exact = in_sbuf(same, nl.int32, copy=nisa.tensor_copy)
        return tuple(to_output(tile) for tile in (by_dma, by_engine, exact))
    a = np.array([[(1 << 24) + 1, 7]], np.int32)
    by_dma, by_engine, exact = run(copies, a)
    assert by_dma.tolist() == by_engine.tolist() == [[1 << 24, 7]] and exact.tolist() == a.tolist()


def test_float8_e4m3fn_needs_neuroncore_v4():
    """neuronx-cc's NCC_EVRF051: "Data type F8E4M3FN is not supported on TRN1/TRN2", raised "for an F8E4M3FN
    operand targeting Trn1 or Trn2": no float8_e4m3fn tensor exists there, computed or only moved (its bytes move
    as uint8); Trainium2's fp8 is float8_e4m3. On Trainium3 both are there."""
    def quantize(a, dtype):
        t = in_sbuf(a, nl.float32)
        q = in_sbuf(t, dtype, copy=nisa.tensor_copy)
        return to_output(q)
    a = np.array([[1.5, -3.0]], np.float32)
    assert run(lambda a: quantize(a, nl.float8_e4m3), a).astype(np.float32).tolist() == a.tolist()
    assert_refused("F8E4M3FN is not supported on TRN1/TRN2", lambda a: quantize(a, nl.float8_e4m3fn), a)
    as_fn = a.astype(ml_dtypes.float8_e4m3fn)
    assert_refused("F8E4M3FN is not supported on TRN1/TRN2", copy_through_sbuf, as_fn)
    np.testing.assert_array_equal(run(copy_through_sbuf, as_fn.view(np.uint8)), as_fn.view(np.uint8))
    assert_refused("F8E4M3FN is not supported on TRN1/TRN2",
                   lambda a: [copy_through_sbuf(a).view(nl.float8_e4m3fn)], as_fn.view(np.uint8))
    with nki_emulator.on(nki_emulator.Platform("trn3")):
        assert run(lambda a: quantize(a, nl.float8_e4m3fn), a).astype(np.float32).tolist() == a.tolist()
        np.testing.assert_array_equal(run(copy_through_sbuf, as_fn), as_fn)


def test_tile_size_constants():
    assert (nl.tile_size.pmax, nl.tile_size.psum_bank_fmax, nl.tile_size.gemm_stationary_fmax,
            nl.tile_size.gemm_moving_fmax) == (128, 512, 128, 512)
    with pytest.raises(EmulatorError, match="documented but not emulated"):
        nl.tile_size.bn_stats_fmax
    with nki_emulator.on(nki_emulator.Platform("trn3")):
        with pytest.raises(EmulatorError, match="not documented"):
            nl.tile_size.gemm_moving_fmax


def test_dma_moves_between_sbuf_and_hbm_only():
    """nki.isa.dma_copy: "data movement between memory locations (SBUF or HBM)"; tensor_copy: GpSimd
    Engine cannot access PSUM."""
    def through(buffer, engine=nisa.engine.unknown):
        def body(a):
            staged = in_sbuf(a)
            tile = nl.ndarray(a.shape, dtype=a.dtype, buffer=buffer)
            nisa.tensor_copy(dst=tile, src=staged, engine=engine)
            return to_output(tile)
        return body
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(run(through(nl.sbuf), a), a)
    assert_refused("src is in PSUM", through(nl.psum), a)
    assert_refused("GpSimd Engine cannot access PSUM", through(nl.psum, engine=nisa.engine.gpsimd), a)


def test_matmul_holds_kernels_to_their_promises():
    def body(a, onezero):
        t = in_sbuf(a)
        acc = nl.ndarray((a.shape[1], a.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=t, moving=t, is_stationary_onezero=onezero)
        return a
    run(lambda a: body(a, True), np.array([[0, 1], [1, 1]], np.float32))
    run(lambda a: body(a, False), np.array([[0, 2], [1, 1]], np.float32))
    assert_refused("values other than 0 and 1", lambda a: body(a, True), np.array([[0, 2], [1, 1]], np.float32))


def test_engine_operand_rules():
    """memset runs on Vector or GpSimd (and GpSimd cannot reach PSUM); iota takes an up-to-4D pattern;
    tensor_tensor_scan's operators are arithmetic."""
    a = np.zeros((2, 4), np.float32)

    def fill(buffer, engine):
        return lambda a: [nisa.memset(nl.ndarray((2, 4), nl.float32, buffer=buffer), value=1.0, engine=engine), a][1]
    run(fill(nl.psum, nisa.engine.vector), a)
    run(fill(nl.sbuf, nisa.engine.gpsimd), a)
    assert_refused("GpSimd Engine cannot access PSUM", fill(nl.psum, nisa.engine.gpsimd), a)

    def iota(pattern):
        return lambda a: [nisa.iota(nl.ndarray((2, 16), nl.int32, buffer=nl.sbuf), pattern=pattern), a][1]
    run(iota([[1, 2]] * 4), a)
    assert_refused("up to 4D", iota([[1, 2]] * 4 + [[1, 1]]), a)

    def scan(op1):
        def body(a):
            t = nl.ndarray((2, 4), nl.int32, buffer=nl.sbuf)
            nisa.memset(t, value=1)
            nisa.tensor_tensor_scan(dst=t, data0=t, data1=t, initial=0, op0=nl.multiply, op1=op1)
            return a
        return body
    run(scan(nl.add), a)
    assert_refused("binary arithmetic operator", scan(nl.bitwise_or), a)


def test_bitvec_operators_need_integers():
    def body(a):
        f = in_sbuf(a, nl.float32)
        nisa.tensor_tensor(dst=f, data1=f, data2=f, op=nl.bitwise_and)
        return copy_through_sbuf(a)
    assert_refused("bitvec", body, np.zeros((2, 2), np.float32))


def test_bitvec_scalar_operands_are_integer_tiles():
    """tensor_scalar types a scalar operand `float` (2.33) and "must be float32" (2.32): how a bitvec operator
    encodes an immediate is not documented, so a Python number is refused and an integer (P, 1) tile passes."""
    def masked(operand):
        def body(a):
            t = in_sbuf(a, nl.int32)
            mask = nl.ndarray((a.shape[0], 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.memset(mask, value=-16)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.bitwise_and, operand0=mask if operand is None else operand)
            return to_output(t)
        return body

    a = np.random.default_rng(578).integers(0, 1000, (2, 3)).astype(np.int32)
    np.testing.assert_array_equal(run(masked(None), a), a & -16)
    for immediate in (-16, -16.0):
        assert_refused("immediate is encoded for a bitvec operator is not documented", masked(immediate), a)


def test_arithmetic_scalar_operands_are_float32():
    """Arithmetic operators' scalar operands "must be float32" (nki.isa.tensor_scalar): a Python int
    is taken as that float32, as nki-library's kernels pass them (operand0=1 with nl.add); a
    non-number is refused."""
    def body(a, operand):
        t = in_sbuf(a, nl.float32)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=operand)
        return to_output(t)
    a = np.zeros((2, 2), np.float32)
    np.testing.assert_array_equal(run(lambda a: body(a, 1), a), a + 1)
    np.testing.assert_array_equal(run(lambda a: body(a, 1.0), a), a + 1)
    np.testing.assert_array_equal(run(lambda a: body(a, (1 << 24) + 1), a), a + np.float32((1 << 24) + 1))
    assert_refused("must be a tile or a Python number", lambda a: body(a, "1"), a)


def test_engine_semantics():
    def body(a):
        t = in_sbuf(a, nl.float32)
        scan = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        ones = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(ones, value=1.0)
        nisa.tensor_tensor_scan(dst=scan, data0=ones, data1=t, initial=0.0, op0=nl.multiply, op1=nl.add)
        red = nl.ndarray((a.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=red, op=nl.add, data=t, axis=1, keepdims=True)
        io = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(io, pattern=[[1, a.shape[1]]], offset=10, channel_multiplier=100)
        rounded = nl.ndarray(a.shape, dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=rounded, data=t, op0=nl.add, operand0=15.0)
        mask = nl.ndarray((a.shape[0], 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(mask, value=-16)
        nisa.tensor_scalar(dst=rounded, data=rounded, op0=nl.bitwise_and, operand0=mask)
        stt = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=stt, data=t, op0=nl.multiply, operand0=red, op1=nl.subtract, operand1=io)
        return tuple(to_output(tile) for tile in (scan, red, io, rounded, stt))
    a = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    scan, red, io, rounded, stt = run(body, a)
    np.testing.assert_array_equal(scan, np.cumsum(a, axis=1))
    np.testing.assert_array_equal(red, a.sum(1, keepdims=True))
    np.testing.assert_array_equal(io, [[10, 11, 12], [110, 111, 112]])
    np.testing.assert_array_equal(rounded, [[16, 16, 16], [16, 16, 16]])
    np.testing.assert_array_equal(stt, a * a.sum(1, keepdims=True) - io)


def test_reduce_axes_and_result_shape():
    def body(a):
        t = in_sbuf(a, nl.float32)
        red = nl.ndarray((a.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=red, op=nl.add, data=t, axis=1)  # keepdims=False gives shape (P,)
        return copy_through_sbuf(a)
    assert_refused("keepdims", body, np.zeros((2, 3), np.float32))


def test_engines_round_to_the_destination_dtype():
    def body(a):
        t = in_sbuf(a, nl.float32)
        b = in_sbuf(t, nl.bfloat16, copy=nisa.tensor_copy)
        return to_output(b)
    a = np.array([[1.00390625, 1.01171875]], np.float32)  # halfway cases: ties to even
    np.testing.assert_array_equal(run(body, a).astype(np.float32), a.astype(ml_dtypes.bfloat16).astype(np.float32))


# --- collectives and the multi-rank driver -------------------------------------------------
from permgen.nki.emulator.api import collectives as ncc  # noqa: E402
from permgen.nki.emulator import run_ranks  # noqa: E402


def _hbm(array):
    array = np.array(array)
    return nki_emulator.Tensor(array.shape, array.dtype, array, nl.shared_hbm, "t")


def test_all_to_all_splits_and_concatenates_dim0():
    group = ncc.ReplicaGroup([[0, 1, 2]])

    def rank(me):
        src, dst = _hbm(np.arange(6, dtype=np.int32).reshape(6, 1) + 10 * me), _hbm(np.zeros((6, 1), np.int32))
        ncc.all_to_all(srcs=[src], dsts=[dst], replica_group=group, collective_dim=0)
        return dst._array[:, 0].tolist()

    got = run_ranks(rank, [(r,) for r in range(3)])
    assert got[1] == [2, 3, 12, 13, 22, 23]  # chunk 1 of every source, in source order

    def uneven(me):
        rows = 6 if me else 3
        src, dst = _hbm(np.zeros((rows, 1), np.int32)), _hbm(np.zeros((rows, 1), np.int32))
        ncc.all_to_all(srcs=[src], dsts=[dst], replica_group=group, collective_dim=0)
    with pytest.raises(EmulatorError, match="differ in shape"):
        run_ranks(uneven, [(r,) for r in range(3)])


INTER_NODE = nki_emulator.Platform("trn2", ranks_per_node=1)  # every rank on its own instance


def _a2av_rank(me, send, recv_size, meta_rows, **flags):
    """Rank `me` sends send[me][d] elements to rank d, packed; returns (dst, metadata) arrays."""
    counts = np.array(send[me])
    src = _hbm(np.arange(max(1, counts.sum()), dtype=np.float32) + 100 * (me + 1))
    dst = _hbm(np.full(recv_size, -1.0, np.float32))
    meta = _hbm(np.zeros((len(meta_rows) + 2, len(counts)), np.uint32))
    meta._array[0], meta._array[1] = counts, np.cumsum(counts) - counts
    for i, row in enumerate(meta_rows):
        meta._array[2 + i] = row[me]
    ncc.all_to_all_v(srcs=[src], dsts=[dst], replica_group=ncc.ReplicaGroup([[0, 1]]), metadata_tensor=meta, **flags)
    return dst._array.tolist(), meta._array.tolist()


def test_all_to_all_v_explicit_and_implicit_receive_layouts():
    send = [[1, 2], [3, 0]]
    recv_counts = [[1, 3], [2, 0]]
    recv_displs = [[0, 1], [0, 2]]
    got = run_ranks(_a2av_rank, [(r, send, 5, [recv_counts, recv_displs]) for r in range(2)],
                    [dict(recv_counts_known=True, has_rdispls=True)] * 2, platform=INTER_NODE)
    assert got[0][0] == [100, 200, 201, 202, -1] and got[1][0] == [101, 102, -1, -1, -1]
    # No receive displacements: slot j starts at j * size / EP; unknown receive counts are written to row 2.
    got = run_ranks(_a2av_rank, [(r, send, 6, [[[0, 0], [0, 0]]]) for r in range(2)])
    assert got[0][0] == [100, -1, -1, 200, 201, 202] and got[0][1][2] == [1, 3]
    assert got[1][0] == [101, 102, -1, -1, -1, -1] and got[1][1][2] == [2, 0]


def test_all_to_all_v_is_strict():
    send = [[1, 2], [3, 0]]
    flags = [dict(recv_counts_known=True, has_rdispls=True)] * 2
    with pytest.raises(EmulatorError, match="receive capacity exceeded"):
        run_ranks(_a2av_rank, [(r, send, 3, [[[1, 3], [2, 0]], [[0, 1], [0, 2]]]) for r in range(2)], flags,
                  platform=INTER_NODE)
    with pytest.raises(EmulatorError, match="overlap"):
        run_ranks(_a2av_rank, [(r, send, 5, [[[1, 3], [2, 0]], [[0, 0], [0, 2]]]) for r in range(2)], flags,
                  platform=INTER_NODE)
    with pytest.raises(EmulatorError, match="receive capacity exceeded.*slot"):
        run_ranks(_a2av_rank, [(r, send, 4, [[[0, 0], [0, 0]]]) for r in range(2)])


def test_all_to_all_v_never_reads_receive_counts():
    """Metadata row 2 is output only: with recv_counts_known=True it is left as the kernel wrote it
    (even when wrong), otherwise the runtime writes what arrived (all_to_all_v, 2.33: metadata rows)."""
    send = [[1, 2], [3, 0]]
    wrong = [[7, 7], [7, 7]]
    got = run_ranks(_a2av_rank, [(r, send, 6, [wrong]) for r in range(2)], [dict(recv_counts_known=True)] * 2)
    assert got[0][0] == [100, -1, -1, 200, 201, 202] and got[0][1][2] == [7, 7]
    got = run_ranks(_a2av_rank, [(r, send, 6, [wrong]) for r in range(2)])
    assert got[0][1][2] == [1, 3] and got[1][1][2] == [2, 0]


def _a2av_ranks(world, groups, platform, has_rdispls):
    """Every rank of a `world`-rank run sends one element to each peer of its rank-list."""
    group = ncc.ReplicaGroup(groups)

    def rank(me):
        size = len(group.rank_list(me))
        src = _hbm(np.full(size, float(me), np.float32))
        dst = _hbm(np.full(size, -1.0, np.float32))
        meta = _hbm(np.zeros((4, size), np.uint32))
        meta._array[0], meta._array[1], meta._array[3] = 1, np.arange(size), np.arange(size)
        ncc.all_to_all_v(srcs=[src], dsts=[dst], replica_group=group, metadata_tensor=meta, has_rdispls=has_rdispls)
        return dst._array.tolist()
    return run_ranks(rank, [(r,) for r in range(world)], platform=platform)


def test_all_to_all_v_follows_each_generations_restrictions():
    """nki.collectives.all_to_all_v (2.33), "Current restrictions": on Trn2, has_rdispls=True only on
    inter-node rank-lists; on Trn3's NeuronSwitch, LNC=2, more than one device, and consecutive
    rank-lists holding every rank of each device they touch (4 ranks per device under LNC=2)."""
    trn2 = nki_emulator.Platform("trn2")  # one trn2 instance holds all ranks
    with pytest.raises(EmulatorError, match="inter-node rank-list"):
        _a2av_ranks(2, [[0, 1]], trn2, has_rdispls=True)
    assert _a2av_ranks(2, [[0, 1]], trn2, has_rdispls=False)[1] == [0.0, 1.0]
    # 2.30 - 2.32: "all_to_all_v currently supports only inter-node replica groups", with or without has_rdispls.
    with pytest.raises(EmulatorError, match="on SDK 2.32 on trn2 needs an inter-node rank-list"):
        _a2av_ranks(2, [[0, 1]], nki_emulator.Platform("trn2", sdk="2.32"), has_rdispls=False)
    assert _a2av_ranks(4, [[0, 2], [1, 3]], nki_emulator.Platform("trn2", ranks_per_node=2, sdk="2.30"),
                       has_rdispls=False)[3] == [1.0, 3.0]
    two_nodes = nki_emulator.Platform("trn2", ranks_per_node=2)  # ranks 0, 1 on node 0; 2, 3 on node 1
    assert _a2av_ranks(4, [[0, 2], [1, 3]], two_nodes, has_rdispls=True)[3] == [1.0, 3.0]
    with pytest.raises(EmulatorError, match="inter-node rank-list"):
        _a2av_ranks(4, [[0, 3], [1, 2]], two_nodes, has_rdispls=True)
    # The 2.32 stub: has_rdispls=True "Currently only supported on NeuronSwitch-based instances (trn3 today)",
    # inter-node rank-lists included; its 2.31 stub does not restrict it beyond inter-node rank-lists.
    with pytest.raises(EmulatorError, match="NeuronSwitch-based instances"):
        _a2av_ranks(4, [[0, 2], [1, 3]], nki_emulator.Platform("trn2", ranks_per_node=2, sdk="2.32"), has_rdispls=True)
    assert _a2av_ranks(4, [[0, 2], [1, 3]], nki_emulator.Platform("trn2", ranks_per_node=2, sdk="2.31"),
                       has_rdispls=True)[3] == [1.0, 3.0]

    trn3 = nki_emulator.Platform("trn3", lnc=2)
    assert _a2av_ranks(8, [list(range(8))], trn3, has_rdispls=True)[5] == [float(r) for r in range(8)]
    with pytest.raises(EmulatorError, match="more than one participating device"):
        _a2av_ranks(4, [[0, 1, 2, 3]], trn3, has_rdispls=False)
    with pytest.raises(EmulatorError, match="every rank of each device"):
        _a2av_ranks(8, [[0, 4], [1, 5], [2, 6], [3, 7]], trn3, has_rdispls=False)
    with pytest.raises(EmulatorError, match="requires LNC=2"):
        _a2av_ranks(8, [list(range(8))], nki_emulator.Platform("trn3", lnc=1), has_rdispls=True)


def test_driver_rules():
    with pytest.raises(EmulatorError, match="multi-rank driver"):
        ncc.all_to_all(srcs=[_hbm(np.zeros((2, 1), np.float32))], dsts=[_hbm(np.zeros((2, 1), np.float32))],
                       replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=0)

    def mismatched(me):
        t = _hbm(np.zeros((2, 1), np.float32))
        if me == 0:
            ncc.all_to_all(srcs=[t], dsts=[_hbm(np.zeros((2, 1), np.float32))], replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=0)
        else:
            ncc.all_to_all_v(srcs=[t], dsts=[_hbm(np.zeros((2, 1), np.float32))], replica_group=ncc.ReplicaGroup([[0, 1]]),
                             metadata_tensor=_hbm(np.zeros((3, 2), np.uint32)))
    with pytest.raises(EmulatorError, match="same collectives in the same order"):
        run_ranks(mismatched, [(0,), (1,)])

    def one_fails(me):
        if me == 1:
            raise ValueError("rank one broke")
        ncc.all_to_all(srcs=[_hbm(np.zeros((2, 1), np.float32))], dsts=[_hbm(np.zeros((2, 1), np.float32))], replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=0)
    with pytest.raises(ValueError, match="rank one broke") as info:
        run_ranks(one_fails, [(0,), (1,)])
    assert "raised on rank 1 of 2" in info.value.__notes__[0]

    def sbuf_source(me):
        tile = nl.ndarray((2, 1), dtype=nl.float32, buffer=nl.sbuf)
        ncc.all_to_all(srcs=[tile], dsts=[_hbm(np.zeros((2, 1), np.float32))], replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=0)
    with pytest.raises(EmulatorError, match="must be HBM tensors"):
        run_ranks(sbuf_source, [(0,), (1,)])
    with pytest.raises(EmulatorError, match="overlap"):
        ncc.ReplicaGroup([[0, 1], [1, 2]])


# --- registers, dynamic loops, scalar offsets (nki-dynamic-loops deep dive; nki.isa.register_alloc,
# register_load; nki.language.dynamic_range; NKI access patterns: scalar_offset) --------------------
def _bound_from(a):
    """A register loaded from the first element of an int32 HBM tensor, through SBUF."""
    tile = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=a.ap([[1, 1], [1, 1]], offset=0))
    reg = nisa.register_alloc()
    nisa.register_load(reg, tile)
    return reg


def test_fori_loop_runs_a_device_loop_with_a_register_bound():
    """nki.language.fori_loop (2.33): body(i) for i in [lower, upper), the bound a register read on the device."""
    def body(bound, rows):
        out = nl.ndarray((4, 3), dtype=nl.float32, buffer=nl.shared_hbm)
        zeros = nl.ndarray((4, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(zeros, value=0.0)
        nisa.dma_copy(dst=out, src=zeros)

        def copy_row(i):
            row = nl.ndarray((1, 3), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=row, src=rows.ap([[3, 1], [1, 3]], offset=0, scalar_offset=i, indirect_dim=0))
            nisa.dma_copy(dst=out.ap([[3, 1], [1, 3]], offset=0, scalar_offset=i, indirect_dim=0), src=row)

        nl.fori_loop(0, _bound_from(bound), copy_row)
        return out

    rows = np.random.default_rng(831).standard_normal((4, 3)).astype(np.float32)
    with nki_emulator.recording() as runs:
        got = run(body, np.array([3], dtype=np.int32), rows)
    np.testing.assert_array_equal(got[:3], rows[:3])
    assert not got[3].any()
    assert runs[0].dynamic_iterations == 3 and runs[0].indirect_dmas == 0


def test_fori_loop_bounds_and_body_follow_the_page():
    """fori_loop: "step size, must be a compile-time positive integer"; "A bound must be 32-bit"; the body is
    "(i) -> None"; from 2.33 i "is a NkiScalar unless either lower or upper is a VirtualRegister" (NkiScalar is
    not emulated), on 2.32 always a VirtualRegister."""
    a = np.zeros((1, 1), dtype=np.int32)

    def loop(lower, upper, step=1, returns=None):
        def body(a):
            nl.fori_loop(lower() if callable(lower) else lower, upper() if callable(upper) else upper,
                         lambda i: returns, step=step)
            return a
        return body

    run(loop(0, lambda: nisa.register_alloc(4), step=2), a)  # the legal twin of each refusal below
    assert_refused("step must be a compile-time positive int",
                   loop(0, lambda: nisa.register_alloc(4), step=lambda: nisa.register_alloc(2)), a)
    assert_refused("step must be a compile-time positive int", loop(0, lambda: nisa.register_alloc(4), step=0), a)
    assert_refused("must be 32-bit", loop(lambda: nisa.register_alloc(0), 2**31), a)
    assert_refused("returns None", loop(0, lambda: nisa.register_alloc(1), returns=1), a)
    assert_refused("NkiScalar", loop(0, 2), a)
    with nki_emulator.on(nki_emulator.Platform(sdk="2.32")):
        run(loop(0, 2), a)


def test_a_compiled_loop_body_is_traced_once():
    """The body is traced once, so its loop state lives in SBUF/HBM ("carry any other loop state through
    SBUF/HBM"): a body whose Python state changes what it issues fails; the same loop with its state in SBUF
    passes."""
    a = np.zeros((1, 4), dtype=np.float32)

    def python_state(a):
        done = []

        def grows(i):
            tile = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
            for _ in range(len(done) + 1):
                nisa.memset(tile, value=0.0)
            done.append(i)

        nl.fori_loop(0, nisa.register_alloc(3), grows)
        return a

    def sbuf_state(a):
        out = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        total = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(total, value=0.0)
        nl.fori_loop(0, nisa.register_alloc(3),
                     lambda i: nisa.tensor_scalar(dst=total, data=total, op0=nl.add, operand0=1.0))
        nisa.dma_copy(dst=out, src=total)
        return out

    assert_refused("traced once", python_state, a)
    np.testing.assert_array_equal(run(sbuf_state, a), np.full((1, 4), 3.0, np.float32))


def test_while_loop_runs_while_its_register_is_nonzero():
    """nki.language.while_loop: "checking the condition before each iteration"; the body returns "the next
    condition register"; init is a VirtualRegister."""
    def countdown(start):
        def body(a):
            out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
            total = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
            left = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.memset(total, value=0.0)
            nisa.memset(left, value=start)

            def step(r):
                nisa.tensor_scalar(dst=total, data=total, op0=nl.add, operand0=1.0)
                nisa.tensor_scalar(dst=left, data=left, op0=nl.subtract, operand0=1.0)
                following = nisa.register_alloc()
                nisa.register_load(following, left)
                return following

            nl.while_loop(nisa.register_alloc(start), step)
            nisa.dma_copy(dst=out, src=total)
            return out
        return body

    a = np.zeros((1, 1), dtype=np.float32)
    assert run(countdown(3), a)[0, 0] == 3.0
    assert run(countdown(0), a)[0, 0] == 0.0  # "if init is zero the body never runs"
    assert_refused("init must be a VirtualRegister", lambda a: [nl.while_loop(1, lambda r: r), a][1], a)
    assert_refused("return the next condition register",
                   lambda a: [nl.while_loop(nisa.register_alloc(1), lambda r: None), a][1], a)


def test_the_loops_nki_0_7_removed_are_refused_from_sdk_2_33():
    """NKI 0.7 (SDK 2.33) "removes the dynamic loop constructs deprecated in NKI 0.6.0": nl.dynamic_range and
    `while <register>:` fail there with the migration guide's words, and still run on 2.32."""
    def dynamic(a):
        for _ in nl.dynamic_range(nisa.register_alloc(2)):
            nisa.memset(nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf), value=0)
        return a

    def bare_while(a):
        reg = nisa.register_alloc(0)
        while reg:
            pass
        return a

    a = np.zeros((1, 1), dtype=np.int32)
    for body in (dynamic, bare_while):
        assert_refused("must move to nki.language.fori_loop", body, a)
    assert "dynamic_range" not in dir(nl)
    with nki_emulator.on(nki_emulator.Platform(sdk="2.32")):
        with nki_emulator.recording() as runs:
            run(dynamic, a)
        run(bare_while, a)
        assert "dynamic_range" in dir(nl)
    assert runs[0].dynamic_iterations == 2


def test_scalar_offset_scales_by_the_base_tensors_shape():
    """nki-aps: the access starts at offset + scalar_offset * prod(A.shape[indirect_dim+1:]), "read from
    the shape of the base tensor, not from the access pattern"; indirect_dim names a dimension of the
    tensor."""
    def column(a, dim, pattern):
        out = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.shared_hbm)
        col = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.sbuf)
        nl.fori_loop(nisa.register_alloc(2), 3,
                     lambda j: nisa.dma_copy(dst=col, src=a.ap(pattern, offset=0, scalar_offset=j, indirect_dim=dim)))
        nisa.dma_copy(dst=out, src=col)
        return out

    a = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    # indirect_dim=1 of a [2, 3, 4] tensor moves 4 elements per step (prod(shape[2:])), whatever the
    # pattern's steps: start 2 * 4 = 8, then 12 apart.
    np.testing.assert_array_equal(run(lambda a: column(a, 1, [[12, 2], [1, 1]]), a)[:, 0], [8, 20])
    np.testing.assert_array_equal(run(lambda a: column(a, 2, [[12, 2], [1, 1]]), a)[:, 0], [2, 14])
    flat = np.arange(8, dtype=np.int32)  # a 1-D tensor has one dimension: indirect_dim=1 names none
    assert_refused("indirect_dim 1 is not a dimension", lambda a: column(a, 1, [[4, 2], [1, 1]]), flat)
    np.testing.assert_array_equal(run(lambda a: column(a, 0, [[4, 2], [1, 1]]), flat)[:, 0], [2, 6])


def test_a_scalar_offset_can_be_an_sbuf_1x1_tensor():
    """nki-aps: scalar_offset is a register or an SBUF (1, 1) tensor; anything else is refused."""
    def row_at(start, shape=(1, 1), dtype=nl.int32, buffer=nl.sbuf):
        def body(a):
            out = nl.ndarray((1, 4), dtype=nl.int32, buffer=nl.shared_hbm)
            offset = nl.ndarray(shape, dtype=dtype, buffer=buffer)
            nisa.memset(offset, value=start)
            row = nl.ndarray((1, 4), dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=row, src=a.ap([[4, 1], [1, 4]], offset=0, scalar_offset=offset, indirect_dim=0))
            nisa.dma_copy(dst=out, src=row)
            return out
        return body

    a = np.random.default_rng(9).integers(-99, 99, (3, 4)).astype(np.int32)
    np.testing.assert_array_equal(run(row_at(2), a), a[2:3])
    assert_refused(r"SBUF \(1, 1\) integer tensor", row_at(2, shape=(2, 1)), a)
    assert_refused(r"SBUF \(1, 1\) integer tensor", row_at(2, dtype=nl.float32), a)


def test_a_loop_register_is_not_a_python_int():
    def slices_with_it(a):
        tile = nl.ndarray((2, 4), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=a)
        nl.fori_loop(0, nisa.register_alloc(2), lambda j: nisa.memset(tile[0:2, j:j + 1], value=0))
        return a

    def branches_on_it(a):
        def body(j):
            if j == 0:
                pass
        nl.fori_loop(0, nisa.register_alloc(2), body)
        return a

    a = np.zeros((2, 4), dtype=np.int32)
    for body in (slices_with_it, branches_on_it):
        assert_refused("host-side Python", body, a)
    assert_refused("host-side Python", lambda a: [range(nisa.register_alloc(3))], a)


def test_register_load_rules():
    a = np.zeros((2, 2), dtype=np.int32)

    def loads(shape, dtype, buffer=nl.sbuf, write=True, value=1):
        def body(a):
            src = nl.ndarray(shape, dtype=dtype, buffer=buffer)
            if write:
                nisa.memset(src, value=value)
            nisa.register_load(nisa.register_alloc(), src)
            return a
        return body

    run(loads((1, 1), nl.int32), a)
    assert_refused("exactly one element", loads((2, 1), nl.int32), a)
    assert_refused("never written", loads((1, 1), nl.int32, write=False), a)
    assert_refused("SBUF or HBM", loads((1, 1), nl.float32, buffer=nl.psum, write=False), a)
    assert_refused("never written", lambda a: [nl.fori_loop(0, nisa.register_alloc(), lambda i: None), a][1], a)
    # 2.33: "src can be any valid NKI data type"; which integer a fractional float becomes is not documented.
    run(loads((1, 1), nl.float32, value=3.0), a)
    assert_refused("fractional or out-of-range value becomes is not documented",
                   loads((1, 1), nl.float32, value=2.5), a)
    with nki_emulator.on(nki_emulator.Platform(sdk="2.32")):
        assert_refused("before SDK 2.33 is not documented", loads((1, 1), nl.float32, value=3.0), a)


def test_scalar_offset_rules():
    a = np.zeros((4, 4), dtype=np.int32)

    def both_offsets(a):
        idx = nl.ndarray((4, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(idx, value=0)
        a.ap([[4, 4], [1, 4]], offset=0, scalar_offset=nisa.register_alloc(0), vector_offset=idx)
        return a

    def past_the_end(a):
        tile = nl.ndarray((2, 4), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=a.ap([[4, 2], [1, 4]], offset=0, scalar_offset=nisa.register_alloc(3), indirect_dim=0))
        return a

    assert_refused("at most one of scalar_offset and vector_offset", both_offsets, a)
    assert_refused("leaves", past_the_end, a)


# --- cost counters ---------------------------------------------------------------------------
def test_costs_count_instructions_indirect_dmas_and_bytes():
    def body(a, idx):
        out = nl.ndarray((4, 8), dtype=a.dtype, buffer=nl.shared_hbm)
        rows = nl.ndarray((4, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=idx)  # 16 bytes
        tile = nl.ndarray((4, 8), dtype=a.dtype, buffer=nl.sbuf)
        nisa.memset(tile, value=0.0)
        # indirect gather: lane 2 is out of bounds and skipped, so 3 rows of 16 bytes move
        nisa.dma_copy(dst=tile, src=a.ap([[8, 4], [1, 8]], offset=0, vector_offset=rows, indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip)
        nisa.tensor_copy(dst=tile, src=tile)
        nisa.dma_copy(dst=out, src=tile)  # 64 bytes
        return out

    a = np.ones((4, 8), dtype=np.float16)
    with nki_emulator.recording() as runs:
        run(body, a, np.array([[0], [3], [9], [1]], dtype=np.int32))
        run(copy_through_sbuf, np.zeros((2, 2), dtype=np.float32))
    first, second = runs
    assert (first.kernel, first.instructions, first.indirect_dmas, first.dma_bytes) == ("body", 5, 1, 16 + 48 + 64)
    assert (second.instructions, second.indirect_dmas, second.dma_bytes) == (2, 0, 32)


# --- logical NeuronCores (LNC) ---------------------------------------------------------------
def halves(a, barrier=True, read_back=True):
    """Each core copies its half of `a` (nl.program_id) into one shared output, then (after the
    barrier) reads the whole output back: the other core's half included."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    cores, me = nl.num_programs(), nl.program_id(0)
    rows = a.shape[0] // cores
    tile = nl.ndarray((rows, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=a[me * rows:(me + 1) * rows, :])
    nisa.dma_copy(dst=out[me * rows:(me + 1) * rows, :], src=tile)
    if barrier:
        nisa.core_barrier(data=out, cores=(0, 1))
    if read_back:
        whole = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=whole, src=out)
    return out


def test_kernels_launch_with_the_lnc_the_environment_declares(monkeypatch):
    """nki.jit: "The LNC value must match the NEURON_LOGICAL_NC_CONFIG environment variable ...
    Mismatching the two will cause a runtime error"; `kernel[lnc](...)`, default LNC=1; LNC is 1 or 2."""
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    kernel = jit(lambda a: halves(a, barrier=False, read_back=False))
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")  # unset: LNC=2, Trn2's default
    with pytest.raises(EmulatorError, match="launched with LNC=1, but the environment declares LNC=2"):
        kernel(a)
    np.testing.assert_array_equal(kernel[2](a), a)
    np.testing.assert_array_equal(simulate(kernel[2])(a), a)
    with pytest.raises(EmulatorError, match="only be set to 1 or 2"):
        kernel[8]
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    np.testing.assert_array_equal(kernel(a), a)
    with pytest.raises(EmulatorError, match="launched with LNC=2, but the environment declares LNC=1"):
        kernel[2](a)
    with nki_emulator.on(nki_emulator.Platform(lnc=2)):  # a Platform's lnc declares it for its block
        import os
        assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == "2"
        np.testing.assert_array_equal(kernel[2](a), a)
    assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == "1"


def test_program_id_and_num_programs(monkeypatch):
    """lnc.rst: num_programs is 1 without LNC and 2 at LNC=2; program_id is 0 without LNC, 0 or 1 at LNC=2;
    program_ndim is "0 if no grid"."""
    def ids(a):
        out = nl.ndarray((1, 4), dtype=nl.int32, buffer=nl.shared_hbm)
        me = nl.program_id(0)
        tile = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(tile[0:1, 0:1], value=nl.num_programs())
        nisa.memset(tile[0:1, 1:2], value=nl.program_ndim())
        nisa.dma_copy(dst=out[0:1, 2 * me:2 * me + 2], src=tile)
        if nl.num_programs() == 1:
            nisa.dma_copy(dst=out[0:1, 2:4], src=tile)
        return out
    a = np.zeros((1, 1), np.float32)
    assert jit(ids)(a).tolist() == [[1, 0, 1, 0]]
    assert jit(ids)[1](a).tolist() == [[1, 1, 1, 1]]
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert jit(ids)[2](a).tolist() == [[2, 1, 2, 1]]
    with pytest.raises(EmulatorError, match="one axis"):
        jit(lambda a: [nl.program_id(1)])[2](a)


def test_cores_share_hbm_and_core_barrier_publishes_writes(monkeypatch):
    """Two cores share the kernel's HBM tensors (lnc.rst); reading what the other core wrote needs
    nisa.core_barrier(data, cores=(0, 1)) on it first (nki.isa.core_barrier)."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(jit(halves)[2](a), a)
    with pytest.raises(EmulatorError, match="race between cores"):
        jit(lambda a: halves(a, barrier=False))[2](a)
    np.testing.assert_array_equal(jit(lambda a: halves(a, barrier=False, read_back=False))[2](a), a)

    def barrier(data_in, cores=(0, 1)):
        def body(a):
            out = copy_through_sbuf(a)
            nisa.core_barrier(data=out if data_in == "hbm" else nl.ndarray((1, 1), nl.float32, nl.sbuf), cores=cores)
            return out
        return body
    with pytest.raises(EmulatorError, match="only cores=\\(0, 1\\) is supported"):
        jit(barrier("hbm", cores=(0,)))[2](a)
    with pytest.raises(EmulatorError, match="shared_hbm"):
        jit(barrier("sbuf"))[2](a)
    np.testing.assert_array_equal(jit(barrier("hbm", cores=[0, 1]))[2](a), a)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    # 2.32: "only allowed ... when LNC ... is enabled"; 2.33: "This applies at LNC degree 1 and 2", the barrier then
    # pairing two launches (two ranks), which the emulator does not model: refused as not emulated.
    with nki_emulator.on(nki_emulator.Platform(sdk="2.32", lnc=1)):
        with pytest.raises(EmulatorError, match="only allowed .* when LNC"):
            jit(barrier("hbm"))(a)
    with pytest.raises(EmulatorError, match="LNC degree 1 and 2.*pairing of two launches is not emulated"):
        jit(barrier("hbm"))(a)


def test_cores_run_the_same_program(monkeypatch):
    """lnc.rst: the program on each core is "the same": the same barriers, collectives and shared_hbm
    allocations; identical writes of the same bytes by both cores are no race, different ones are."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    a = np.arange(8, dtype=np.float32).reshape(4, 2)

    def barrier_on_core_0(a):
        out = copy_through_sbuf(a)
        if nl.program_id(0) == 0:
            nisa.core_barrier(data=out, cores=(0, 1))
        return out
    with pytest.raises(EmulatorError, match="the cores diverged"):
        jit(barrier_on_core_0)[2](a)

    def shapes_differ(a):
        return nl.ndarray((2 + nl.program_id(0), 2), dtype=a.dtype, buffer=nl.shared_hbm)
    with pytest.raises(EmulatorError, match="the cores diverged"):
        jit(shapes_differ)[2](a)

    np.testing.assert_array_equal(jit(copy_through_sbuf)[2](a), a)  # both cores write the same bytes

    def each_writes_its_id(a):
        out = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.shared_hbm)
        tile = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(tile, value=nl.program_id(0))
        nisa.dma_copy(dst=out, src=tile)
        return out
    with pytest.raises(EmulatorError, match="race between cores.*changes shared HBM bytes"):
        jit(each_writes_its_id)[2](a)


def test_collectives_at_lnc2_run_once_per_rank(monkeypatch):
    """At LNC=2 a rank is a logical core: both cores issue the collective and it runs once. No page
    says on which core's queue it runs or whether its results are visible to both cores, so what it
    reads and writes is published with a core_barrier before it, and its outputs after it."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    group = ncc.ReplicaGroup([[0, 1]])

    def exchange(a, publish_inputs=True, publish_outputs=True):
        src = copy_through_sbuf(a)
        dst = copy_through_sbuf(a)  # written before the collective overwrites it: published with the inputs
        if publish_inputs:
            nisa.core_barrier(data=src, cores=(0, 1))
            nisa.core_barrier(data=dst, cores=(0, 1))
        ncc.all_to_all(srcs=[src], dsts=[dst], replica_group=group, collective_dim=0)
        if publish_outputs:
            nisa.core_barrier(data=dst, cores=(0, 1))
        return copy_through_sbuf(dst)

    inputs = [(np.arange(4, dtype=np.float32).reshape(4, 1) + 10 * r,) for r in range(2)]
    got = run_ranks(lambda a: jit(exchange)[2](a), inputs)
    np.testing.assert_array_equal(got[1][:, 0], [2, 3, 12, 13])
    with pytest.raises(EmulatorError, match="not documented on which core's queue"):
        run_ranks(lambda a: jit(lambda a: exchange(a, publish_inputs=False))[2](a), inputs)
    with pytest.raises(EmulatorError, match="not documented whether a collective's results are visible"):
        run_ranks(lambda a: jit(lambda a: exchange(a, publish_outputs=False))[2](a), inputs)
