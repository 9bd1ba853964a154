"""raysim's fixed-order GEMM (raysim/fixed_gemm.py, .c): the portable vectorised executor's convolutions on a CPU.

Its contract is the arithmetic: each output element sums its reduction in fixed blocks of 64 terms, each block one fma
after another from zero, the block sums added in order — so every kernel equals the scalar definition bit for bit on
any shape, and the bits depend on nothing of the
machine (a pinned digest), the thread count or how many clients one call computes."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raysim import fixed_gemm as fg

pytestmark = pytest.mark.skipif(not fg.available(), reason="no C compiler or no AVX2/FMA here")


def _floats(n: int, salt: int) -> torch.Tensor:
    """n float32 values in [-2, 2) from an integer hash: the same bits on every machine (no RNG kernels)."""
    i = np.arange(n, dtype=np.uint64) + np.uint64(salt * 1_000_003)
    h = (i * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return torch.from_numpy(((h.astype(np.float64) / 2.0 ** 24) * 4.0 - 2.0).astype(np.float32))


@pytest.mark.parametrize("dims,accumulate", [((2, 3, 1, 7, 19, 5), False), ((1, 1, 3, 13, 33, 11), True),
                                             ((3, 2, 2, 6, 16, 1), False), ((1, 1, 1, 1, 1, 300), True),
                                             ((2, 1, 2, 9, 47, 21), False), ((1, 2, 2, 25, 6, 13), False),
                                             ((2, 1, 1, 14, 8, 7), True), ((2, 1, 2, 25, 12, 9), True),
                                             ((1, 2, 1, 13, 9, 4), False), ((1, 2, 3, 7, 20, 130), False),
                                             ((2, 1, 2, 13, 12, 100), True)])
def test_kernel_equals_the_definition_bit_for_bit(dims, accumulate):
    """Odd M, N (row and column tails of both kernels' blocks), R > 1, two group levels, accumulate or a bias, a
    table for A's rows: the AVX2 kernel, the AVX-512 one (where this CPU has it) and the scalar definition give the
    same bits."""
    g1, g2, r, m, n, k = dims
    a = _floats(g1 * g2 * r * m * k, 1)
    b = _floats(g1 * g2 * r * k * n, 2)
    rows = torch.arange(m, dtype=torch.int64).flip(0) * k  # rows read in reverse through a table
    ops_a = fg.Operand(a, (g2 * r * m * k, r * m * k, m * k, rows, 1))
    ops_b = fg.Operand(b, (g2 * r * k * n, r * k * n, k * n, n, 1))
    bias = None if accumulate else _floats(g1 * n, 12)
    out = []
    lib = fg.library()
    before = lib.kernel_isa(-1)
    isas = [0, 1] if lib.kernel_isa(1) == 1 else [0]  # AVX2, and AVX-512 where this CPU has it
    try:
        for isa, ref in [(i, False) for i in isas] + [(0, True)]:
            lib.kernel_isa(isa)
            c = _floats(g1 * g2 * m * n, 3)
            fg.gemm(ops_a, ops_b, fg.Operand(c, (g2 * m * n, m * n, n, 1), bias), fg.Dims(*dims), accumulate,
                    reference=ref)
            out.append(c)
    finally:
        lib.kernel_isa(before)
    assert all(torch.equal(o, out[-1]) for o in out)
    want = torch.einsum("xyrmk,xyrkn->xymn", a.double().view(g1, g2, r, m, k).flip(3), b.double().view(g1, g2, r, k, n))
    if accumulate:
        want = want + _floats(g1 * g2 * m * n, 3).double().view(g1, g2, m, n)
    else:
        want = want + bias.double().view(g1, 1, 1, n)
    assert torch.allclose(out[0].view(g1, g2, m, n).double(), want, rtol=1e-5, atol=1e-4)



@pytest.mark.parametrize("dims", [(1, 2, 1, 9, 12, 65), (2, 1, 3, 7, 21, 64), (1, 1, 2, 13, 5, 130), (1, 1, 2, 5, 7, 0),
                                  (1, 1, 0, 5, 20, 300), (1, 1, 1, 4, 9, 0)])
def test_blocks_with_a_transposed_b_and_c_accumulate_and_bias_equal_the_definition(dims):
    """The blocked path (K > 64 or R > 1) with B read through a column stride (bn != 1: packed panels), C written
    through one (cn != 1), accumulate and a bias together, the 64 / 65 boundary, and no term at all (K = 0 or R = 0:
    C + bias, not scratch memory): every kernel equals the scalar definition bit for bit."""
    g1, g2, r, m, n, k = dims
    a = _floats(g1 * g2 * r * m * k + 1, 31)
    b = _floats(g1 * g2 * r * k * n + 1, 32)  # stored [g1, g2, r, n, k]: read transposed (bn = k, bk = 1)
    ops_a = fg.Operand(a, (g2 * r * m * k, r * m * k, m * k, k, 1))
    ops_b = fg.Operand(b, (g2 * r * k * n, r * k * n, k * n, 1, k))
    bias = _floats(g1 * n, 33)
    out = []
    lib = fg.library()
    before = lib.kernel_isa(-1)
    isas = [0, 1] if lib.kernel_isa(1) == 1 else [0]
    try:
        for isa, ref in [(i, False) for i in isas] + [(0, True)]:
            lib.kernel_isa(isa)
            c = _floats(g1 * g2 * m * n, 34)  # stored [g1, g2, n, m]: written transposed (cm = 1, cn = m)
            fg.gemm(ops_a, ops_b, fg.Operand(c, (g2 * m * n, m * n, 1, m), bias), fg.Dims(*dims), True, reference=ref)
            out.append(c)
    finally:
        lib.kernel_isa(before)
    assert all(torch.equal(o, out[-1]) for o in out)
    want = (_floats(g1 * g2 * m * n, 34).double().view(g1, g2, n, m).transpose(2, 3) + bias.double().view(g1, 1, 1, n))
    if r and k:
        av = a[:g1 * g2 * r * m * k].double().view(g1, g2, r, m, k)
        bv = b[:g1 * g2 * r * k * n].double().view(g1, g2, r, n, k).transpose(3, 4)
        want = want + torch.einsum("xyrmk,xyrkn->xymn", av, bv)
    assert torch.allclose(out[0].view(g1, g2, n, m).transpose(2, 3).double(), want, rtol=1e-5, atol=1e-4)

def test_same_bits_on_every_machine():
    """A digest of a product of hash-drawn floats, pinned: a CPU, vector width or compiler that summed otherwise
    would change it (computed on an AMD EPYC with AVX-512; the kernel uses AVX2 + FMA only)."""
    a, b, c = _floats(37 * 301, 4), _floats(301 * 45, 5), torch.empty(37 * 45)
    fg.gemm(fg.Operand(a, (0, 0, 0, 301, 1)), fg.Operand(b, (0, 0, 0, 45, 1)), fg.Operand(c, (0, 0, 45, 1)),
            fg.Dims(1, 1, 1, 37, 45, 301))
    assert hashlib.sha256(c.numpy().tobytes()).hexdigest()[:16] == DIGEST


def test_a_long_reduction_is_as_precise_as_blocked_sums():
    """The reduction runs in fixed blocks of 64 terms whose sums are added in order (a two-level sum): on 4,608 terms
    (a 3x3 convolution over 512 channels) within 5e-7 of float64, relative to the largest output — the one fma chain
    of the first definition was 1.3e-6 here (simulated exactly in float64), as MKL's cross-vendor branch is."""
    m, n, k = 6, 16, 4608
    a, b, c = _floats(m * k, 21), _floats(k * n, 22), torch.empty(m * n)
    fg.gemm(fg.Operand(a, (0, 0, 0, k, 1)), fg.Operand(b, (0, 0, 0, n, 1)), fg.Operand(c, (0, 0, n, 1)),
            fg.Dims(1, 1, 1, m, n, k))
    ref = a.double().view(m, k) @ b.double().view(k, n)
    assert float((c.view(m, n).double() - ref).abs().max() / ref.abs().max()) < 5e-7


DIGEST = "b829ddbf32d87d57"  # the definition with blocks of 64 (a96b9ecb414b301f: one chain)

GEOMETRIES = [  # B, K, C, O, H, kernel, stride, padding, dilation
    (3, 4, 1, 10, 12, 5, 1, 0, 1), (2, 3, 3, 7, 9, 3, 2, 1, 1), (2, 2, 4, 17, 11, 3, 1, 2, 2), (2, 3, 5, 6, 8, 1, 2, 0, 1)]


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("channels_last", [True, False])
def test_grouped_conv_is_conv2d(geo, channels_last):
    """Values and both gradients as torch's grouped convolution in float64 (float32 rounding apart), in the
    caller's layout."""
    bsz, k, c, o, h, ks, s, p, d = geo
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = _floats(bsz * k * c * h * h, 6).view(bsz, k * c, h, h).contiguous(memory_format=fmt).requires_grad_()
    w = (_floats(k * o * c * ks * ks, 7).view(k, o, c, ks, ks) / ks).requires_grad_()
    bias = _floats(k * o, 8).view(k, o).requires_grad_()
    y = fg.grouped_conv2d(x, w, bias, s, p, d)
    assert y.is_contiguous(memory_format=fmt)
    g = _floats(y.numel(), 9).view(y.shape)
    grads = torch.autograd.grad(y, (x, w, bias), g)
    assert grads[0].is_contiguous(memory_format=fmt)
    x2, w2, b2 = (t.detach().double().requires_grad_() for t in (x, w, bias))
    y2 = F.conv2d(x2, w2.reshape(k * o, c, ks, ks), b2.reshape(-1), s, p, d, k)
    want = torch.autograd.grad(y2, (x2, w2, b2), g.double())
    for got, ref in zip((y, *grads), (y2, *want)):
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_bits_do_not_depend_on_the_group_or_the_threads():
    """Client k's output and weight gradient are the same bits computed among 5 clients, alone, or with 2 threads:
    a group's size (max_group chunks) or the machine's threads never change a table."""
    bsz, k, c, o, h = 4, 5, 3, 8, 10
    x = _floats(bsz * k * c * h * h, 10).view(bsz, k * c, h, h).contiguous(memory_format=torch.channels_last)
    w = _floats(k * o * c * 9, 11).view(k, o, c, 3, 3).requires_grad_()

    def run(xs, ws):
        y = fg.grouped_conv2d(xs, ws, None, 1, 1, 1)
        return y.detach(), torch.autograd.grad(y, ws, torch.ones_like(y))[0]

    y_all, gw_all = run(x, w)
    for kk in (0, 3):
        xs = x[:, kk * c:(kk + 1) * c].contiguous(memory_format=torch.channels_last)
        ws = w.detach()[kk:kk + 1].clone().requires_grad_()
        y1, gw1 = run(xs, ws)
        assert torch.equal(y1, y_all[:, kk * o:(kk + 1) * o]) and torch.equal(gw1[0], gw_all[kk])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y2, gw2 = run(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y2, y_all) and torch.equal(gw2, gw_all)


def test_no_compiler_is_one_clear_error(tmp_path, monkeypatch):
    """Where the kernel cannot be built, one error names what is missing (the portable vectorised path refuses
    rather than computing other bits)."""
    monkeypatch.setattr(fg, "_lib", None)
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(fg.KernelUnavailable, match="no C compiler found"):
        fg.library()


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_is_baddbmm(bias):
    """The grouped linear layer: values and gradients as torch's baddbmm in float64 (float32 rounding apart)."""
    k, bsz, fin, out = 3, 5, 37, 19
    x = _floats(k * bsz * fin, 13).view(k, bsz, fin).requires_grad_()
    w = (_floats(k * out * fin, 14).view(k, out, fin) / 6).requires_grad_()
    b = _floats(k * out, 15).view(k, out).requires_grad_() if bias else None
    ins = (x, w) + ((b,) if bias else ())
    y = fg.grouped_linear(x, w, b)
    g = _floats(y.numel(), 16).view(y.shape)
    grads = torch.autograd.grad(y, ins, g)
    d = [t.detach().double().requires_grad_() for t in ins]
    y2 = torch.bmm(d[0], d[1].transpose(1, 2)) + (d[2].unsqueeze(1) if bias else 0)
    want = torch.autograd.grad(y2, d, g.double())
    for got, ref in zip((y, *grads), (y2, *want)):
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_a_vectorised_table_does_not_depend_on_the_vector_width():
    """A portable vectorised run (FedAvg on cnn_mnist: convolutions and linear layers on the fixed-order GEMM)
    gives the same table bit for bit with the AVX2 kernel and with the AVX-512 one (where this CPU has it; elsewhere
    the AVX2 run is compared with itself)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import test_vectorized as tv

    lib = fg.library()
    before = lib.kernel_isa(-1)
    tables = []
    try:
        for isa in (0, 1):
            lib.kernel_isa(isa)
            tables.append(tv.table(tv.cfg("fedavg")))
    finally:
        lib.kernel_isa(before)
    assert tables[0].equals(tables[1])
