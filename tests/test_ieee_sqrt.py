"""Portable numerics' CPU sqrt (raysim/numerics.py, ``ieee_sqrt``): torch's own CPU sqrt goes through oneMKL VML,
whose kernels are not correctly rounded and differ between CPU vendors; ``ieee_sqrt`` uses IEEE operations only.
float32 is correctly rounded: equal, bit for bit, to numpy's sqrt (the sqrt instruction) on random magnitudes over the
whole range, denormals and the special values."""
from __future__ import annotations

import numpy as np
import torch

from raysim.numerics import ieee_sqrt


def _inputs(dtype, n=400_000):
    g = torch.Generator().manual_seed(3)
    mags = torch.rand(n, generator=g, dtype=torch.float64) * torch.pow(
        10.0, torch.randint(-44 if dtype == torch.float32 else -300, 38 if dtype == torch.float32 else 300, (n,),
                            generator=g).double())
    x = mags.to(dtype)
    tiny = torch.finfo(dtype).tiny
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -1.0, tiny, tiny / 2,
                             torch.finfo(dtype).max, 1.0, 4.0, 2.0], dtype=dtype)
    # floats next to perfect squares and midpoints: where an off-by-one rounding shows
    ints = torch.arange(1, 5000, dtype=torch.float64) ** 2
    near = torch.cat([torch.nextafter(ints.to(dtype), torch.tensor(0.0, dtype=dtype)), ints.to(dtype),
                      torch.nextafter(ints.to(dtype), torch.tensor(float("inf"), dtype=dtype))])
    return torch.cat([x, specials, near])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ib = torch.int32 if a.dtype == torch.float32 else torch.int64
    return (a.view(ib) == b.view(ib)) | (torch.isnan(a) & torch.isnan(b))


def test_float32_sqrt_is_correctly_rounded():
    x = _inputs(torch.float32)
    with np.errstate(invalid="ignore"):
        ref = torch.from_numpy(np.sqrt(x.numpy()))
    got = ieee_sqrt(x)
    bad = ~_same_bits(got, ref)
    assert not bad.any(), (x[bad][:5], got[bad][:5], ref[bad][:5])


def test_float64_sqrt_is_within_two_ulp_and_exact_on_the_special_values():
    x = _inputs(torch.float64)
    with np.errstate(invalid="ignore"):
        ref = torch.from_numpy(np.sqrt(x.numpy()))
    got = ieee_sqrt(x)
    finite = torch.isfinite(ref) & (ref > 0)
    ulp = torch.nextafter(ref[finite], torch.tensor(float("inf"), dtype=torch.float64)) - ref[finite]
    assert ((got[finite] - ref[finite]).abs() <= 2 * ulp).all()
    assert _same_bits(got[~finite], ref[~finite]).all()


def test_portable_mode_routes_torch_sqrt_through_it():
    from raysim.numerics import exact_sqrt

    exact_sqrt()  # what numerics.enter("portable") does (once per process)
    x = _inputs(torch.float32, 20_000)
    assert _same_bits(torch.sqrt(x), ieee_sqrt(x)).all()
    assert _same_bits(x.sqrt(), ieee_sqrt(x)).all()
    y = x.clone()
    y.sqrt_()
    assert _same_bits(y, ieee_sqrt(x)).all()


def test_the_eight_kernel_path_gives_the_corrected_paths_bits():
    """ieee_sqrt's float32 and half paths (the float64 estimate rounded once, issue 48) against the nearest-neighbour
    correction they replaced (numerics._ieee_sqrt_corrected): the same bits on every float32 of [1, 4) taken 1 in 7
    (both commute exactly with scaling by 4, so two binades stand for every normal float32), the subnormals 1 in 7,
    the test's magnitudes and specials, and every float16 and bfloat16."""
    from raysim.numerics import _ieee_sqrt_corrected

    dense = torch.cat([torch.arange(0x3F800000, 0x40800000, 7, dtype=torch.int64),
                       torch.arange(1, 0x00800000, 7, dtype=torch.int64)]).to(torch.int32).view(torch.float32)
    for x in (dense, _inputs(torch.float32), -_inputs(torch.float32, 10_000)):
        assert torch.equal(ieee_sqrt(x).view(torch.int32), _ieee_sqrt_corrected(x).view(torch.int32))
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        assert torch.equal(ieee_sqrt(x).view(torch.int16), _ieee_sqrt_corrected(x).view(torch.int16))
