"""A fixed-order float32 GEMM for portable numerics on a CPU, and the grouped convolution built on it.

Portable numerics (``raysim/numerics.py``) must give the same bits on every x86-64 CPU. torch's CPU GEMMs cannot do
that fast: MKL's one cross-vendor reproducible branch (``MKL_CBWR=COMPATIBLE``) is SSE2, and oneDNN picks its
blockings by cache size. Without oneDNN a grouped convolution (the vectorised executor's: K clients' convolutions as
one with ``groups = K``) ran as K separate unfold + SSE2 GEMMs, 2.3-2.7x the native time.

``raysim/fixed_gemm.c`` defines the product by its arithmetic instead: each output element sums its reduction in
fixed blocks of 64 terms, each block ``part = fma(a, b, part)`` in order from zero, the block sums added to the total in
order (a two-level sum, as precise as blocked library sums: one chain over 4,608 terms was 8x less precise) — no
other split, no reordering — so its bits do not depend on the CPU, the vector width, the thread count or how many groups one call computes; an AVX2 + FMA kernel
computes it (6 x 16 outputs a block, 8 lanes a register), an AVX-512 one where the CPU has it (6 x 32, 16 lanes: each
lane is still one output summed in the same order, so the same bits; ``RAYSIM_FIXED_GEMM_ISA=avx2`` forces AVX2); a
scalar reference of the same order is in the file, and the tests hold all three equal bit for bit. It is compiled with the machine's C compiler at first use into a cache
directory (``RAYSIM_CACHE``, default ``~/.cache/raysim``), keyed by the source's hash; a process that cannot compile or
load it gets one error naming what is missing (:class:`KernelUnavailable`).

:func:`grouped_conv2d` is ``F.conv2d(x, w.reshape(K*O, C, kh, kw), groups=K)`` as implicit GEMMs: operand A's rows and
columns are offset tables, so the (zero-padded) image is read in place as its im2col matrix (output positions x kernel
taps) without building it. Forward: y = im2col(x) w'; weight gradient: im2col(x)^T dy (images outer, positions inner);
input gradient: per client and image du = dy w'^T into a scratch block, then a col2im of fixed order (one C call). Groups are split across ``torch.get_num_threads()`` OpenMP threads of
torch's own runtime (the library links libgomp.so.1, which resolves to the copy torch loaded, so ATen's thread pool
serves both and nothing oversubscribes the cores); each output element is computed by one thread, so the bits do not
depend on the split.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

_SRC = Path(__file__).with_name("fixed_gemm.c")
FLAGS = ["-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared"]
THREADS = ["-fopenmp"]  # links libgomp.so.1: in a process with torch, the one torch loaded (its threads serve both)

_lib = None
_lock = threading.Lock()


class KernelUnavailable(RuntimeError):
    """The fixed-order GEMM could not be built or loaded here (no C compiler, no AVX2/FMA, an unwritable cache)."""


def cache_dir() -> Path:
    return Path(os.environ.get("RAYSIM_CACHE") or Path.home() / ".cache" / "raysim")


def _compiler() -> str:
    import shutil

    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise KernelUnavailable("no C compiler found (CC, cc, gcc or clang): raysim's fixed-order GEMM for portable "
                            "numerics on a CPU is compiled at first use; install one (Debian: apt-get install gcc)")


def _build() -> Path:
    """The compiled library in the cache: with OpenMP where the compiler has it, else single-threaded (same bits)."""
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join(FLAGS).encode()).hexdigest()[:16]
    variants = [(cache_dir() / f"fixed_gemm_{key}_omp.so", THREADS), (cache_dir() / f"fixed_gemm_{key}.so", [])]
    for out, _ in variants:
        if out.exists():
            return out
    cc = _compiler()
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {cache_dir()} ({e}); set RAYSIM_CACHE to a writable "
                                f"directory") from None
    err = ""
    for out, extra in variants:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # compile aside, then rename: concurrent builders
        os.close(fd)                                                # (Ray actors) never load a half-written file
        try:
            p = subprocess.run([cc, *FLAGS, *extra, "-o", tmp, str(_SRC), "-lm"], capture_output=True, text=True,
                               timeout=120)
            if p.returncode == 0:
                os.replace(tmp, out)
                return out
            err = (p.stderr or p.stdout).strip().splitlines()[-1:]
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise KernelUnavailable(f"compiling raysim's fixed-order GEMM with {cc} failed: {err}")


def _cpu_ok() -> None:
    from raysim import numerics

    flags = numerics.cpu_flags()
    if flags and not {"avx2", "fma"} <= flags:
        raise KernelUnavailable(f"this CPU lacks {sorted({'avx2', 'fma'} - flags)}: raysim's fixed-order GEMM needs "
                                f"AVX2 and FMA")


def library():
    """The loaded kernel library (built at first use)."""
    global _lib
    with _lock:
        if _lib is None:
            import torch  # first: the library's libgomp.so.1 then resolves to the copy torch loaded

            assert torch.__version__

            _cpu_ok()
            path = _build()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                raise KernelUnavailable(f"cannot load {path}: {e}") from None
            i64, f32p = ctypes.c_longlong, ctypes.POINTER(ctypes.c_float)
            vp = ctypes.c_void_p
            args = ([i64] * 6 + [f32p] + [i64] * 3 + [vp, vp] + [f32p] + [i64] * 5 + [f32p] + [i64] * 4
                    + [ctypes.c_int, vp, i64])
            lib.gemm.argtypes, lib.gemm.restype = [ctypes.c_int] + args, ctypes.c_int
            lib.gemm_reference.argtypes, lib.gemm_reference.restype = args, None
            lib.conv_input_grad.argtypes = [ctypes.c_int] + [i64] * 16 + [f32p, f32p, f32p]
            lib.conv_input_grad.restype = ctypes.c_int
            lib.kernel_isa.argtypes, lib.kernel_isa.restype = [ctypes.c_int], ctypes.c_int
            _lib = lib
    return _lib


def available() -> bool:
    try:
        library()
        return True
    except KernelUnavailable:
        return False


def _ptr(t):
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_float))


def _threads() -> int:
    import torch

    return max(1, torch.get_num_threads())


def _check(*ts) -> None:
    import torch

    for t in ts:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"raysim fixed-order GEMM: float32 CPU tensors only, got {t.dtype} on {t.device}")


def _table(v, n: int):
    """An int64 offset table of n entries: ``v`` itself (a tensor) or ``arange(n) * v`` (a stride)."""
    import torch

    if isinstance(v, torch.Tensor):
        if v.dtype != torch.int64 or v.numel() != n or not v.is_contiguous():
            raise ValueError(f"raysim fixed-order GEMM: an offset table must be {n} contiguous int64 values")
        return v
    return _strided(n, int(v))


@functools.lru_cache(maxsize=512)
def _strided(n: int, stride: int):
    """arange(n) * stride (cached: tables are read, never written)."""
    import torch

    return torch.arange(n, dtype=torch.int64) * stride


class Operand(NamedTuple):
    """A GEMM operand: a float32 CPU tensor and its element offsets from the data pointer — for A (s1, s2, sr, rows,
    cols), rows and cols a stride or an int64 table of M / K entries; for B (s1, s2, sr, sk, sn); for C (s1, s2, sm,
    sn): g1 * s1 + g2 * s2 + r * sr + the row and column offsets. C may carry a bias [G1, N] (contiguous), added to
    each output after its sum, as an add would."""
    t: object
    offsets: tuple
    bias: object = None


class Dims(NamedTuple):
    """G1 x G2 products of M x K by K x N, each summed over R pairs (r outer, k inner)."""
    G1: int
    G2: int
    R: int
    M: int
    N: int
    K: int


def gemm(a: Operand, b: Operand, c: Operand, d: Dims, accumulate: bool = False, reference: bool = False) -> None:
    """C[g1, g2] (=|+=) sum_r A[g1, g2, r] @ B[g1, g2, r] (+ c.bias[g1, n]) in the fixed order (each output: r outer,
    k inner in blocks of 64, each block one fma after another from zero, the block sums added in order; the bias
    added after, as an add would). The caller keeps the tensors
    alive and every index inside them. ``reference``: the plain C loops of the definition (tests)."""
    lib = library()
    bias = c.bias
    _check(a.t, b.t, c.t, *([] if bias is None else [bias]))
    if bias is not None and (not bias.is_contiguous() or bias.numel() != d.G1 * d.N):
        raise ValueError(f"raysim fixed-order GEMM: the bias must be {d.G1} x {d.N} contiguous values")
    am, ak = _table(a.offsets[3], d.M), _table(a.offsets[4], d.K)
    aa = (_ptr(a.t), *a.offsets[:3], am.data_ptr(), ak.data_ptr())
    rest = (_ptr(b.t), *b.offsets, _ptr(c.t), *c.offsets, int(accumulate),
            None if bias is None else bias.data_ptr(), d.N)
    if reference:
        lib.gemm_reference(*d, *aa, *rest)
    elif lib.gemm(_threads(), *d, *aa, *rest) != 0:
        raise MemoryError("raysim fixed-order GEMM: scratch allocation failed")


@functools.lru_cache(maxsize=256)
def _offsets(grid: tuple, step: tuple, row: int, pix: int):
    """int64 offsets of a (rows x cols) ``grid`` of pixels, ``step`` pixels apart, in an image ``row`` pixels wide
    whose pixels are ``pix`` elements apart (channels-last)."""
    import torch

    h = torch.arange(grid[0], dtype=torch.int64) * (step[0] * row * pix)
    w = torch.arange(grid[1], dtype=torch.int64) * (step[1] * pix)
    return (h[:, None] + w[None, :]).reshape(-1)


@functools.lru_cache(maxsize=256)
def _taps(kernel: tuple, ch: int, dilation: tuple, row: int, pix: int):
    """int64 offsets of the kernel taps (i, j, c), c fastest."""
    import torch

    kh, kw = kernel
    i = torch.arange(kh, dtype=torch.int64)
    j = torch.arange(kw, dtype=torch.int64)
    c = torch.arange(ch, dtype=torch.int64)
    return (i[:, None, None] * (dilation[0] * row * pix) + j[None, :, None] * (dilation[1] * pix)
            + c[None, None, :]).reshape(-1)


class _Geometry(NamedTuple):
    bsz: int
    h: int
    w: int
    ho: int
    wo: int
    stride: tuple
    padding: tuple
    dilation: tuple
    first: bool  # the caller's layout is channels-first


def _forward(ctx, x, w, bias, geometry):
    """y[b, (h, w), k, :] = sum over taps (i, j, c) of xk[b, k, h*s + i*d, w*s + j*d, c] w'[k, (i, j, c), :], the
    zero-padded image read in place through the offset tables (an implicit im2col), client-major (xk [B, K, Hp, Wp,
    C]: one client's image contiguous, where channels-last memory spreads it over K*C-float strides)."""
    import torch
    import torch.nn.functional as F

    cl = torch.channels_last
    stride, padding, dilation = geometry
    k, o, c, kh, kw = w.shape
    bsz, _, h, wd = x.shape
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    xp = x.detach()
    if padding[0] or padding[1]:
        xp = F.pad(xp, (padding[1], padding[1], padding[0], padding[0]))
    hp, wp = xp.shape[2:]
    xk = xp.reshape(bsz, k, c, hp, wp).permute(0, 1, 3, 4, 2).contiguous()  # [B, K, Hp, Wp, C]
    _check(xk, w)
    ckk, L, img = kh * kw * c, ho * wo, hp * wp * c
    pos, taps = _offsets((ho, wo), stride, wp, c), _taps((kh, kw), c, dilation, wp, c)
    wt = w.detach().permute(0, 3, 4, 2, 1).reshape(k, ckk, o).contiguous()  # [K, (i, j, c), O]
    y = torch.empty(bsz, k * o, ho, wo, memory_format=cl, device=xk.device)
    gemm(Operand(xk, (img, k * img, 0, pos, taps)), Operand(wt, (ckk * o, 0, 0, o, 1)),
         Operand(y, (o, L * k * o, k * o, 1), None if bias is None else bias.detach().contiguous()),
         Dims(k, bsz, 1, L, o, ckk))
    # the caller's layout: channels-first in, channels-first out (a model with batch norm runs channels-first, whose
    # kernels then reduce each channel as one client's own forward does); ambiguous -> channels-first
    first = not (x.is_contiguous(memory_format=cl) and not x.is_contiguous())
    if any(ctx.needs_input_grad[:3]):
        ctx.save_for_backward(xk, w.detach())
        ctx.geo = _Geometry(bsz, h, wd, ho, wo, stride, padding, dilation, first)
        ctx.tables = (pos, taps)
    return y.contiguous() if first else y


def _weight_grad(xk, w, gy, geo: _Geometry, tables: tuple):
    """dw'[k] (taps x O) = sum over images b (outer), positions (inner) of xk's tap entries (client-major) times dy
    (channels-last: a client's O outputs of a position contiguous, which the kernel's vector loads need)."""
    import torch

    k, o, c, kh, kw = w.shape
    img = xk.shape[2] * xk.shape[3] * c
    ckk, L = kh * kw * c, geo.ho * geo.wo
    pos, taps = tables
    gwt = torch.empty(k, ckk, o, device=w.device)
    gemm(Operand(xk, (img, 0, k * img, taps, pos)), Operand(gy, (o, 0, L * k * o, k * o, 1)),
         Operand(gwt, (ckk * o, 0, o, 1)), Dims(k, 1, geo.bsz, ckk, o, L))
    return gwt.view(k, kh, kw, c, o).permute(0, 4, 3, 1, 2)


def _input_grad(w, gy, geo: _Geometry):
    """dx: per client and image, the tap gradients du = dy w'^T (the fixed-order GEMM into a scratch block), then a
    col2im of fixed order into dx (channels-last), in one C call (``conv_input_grad``)."""
    import torch

    k, o, c, kh, kw = w.shape
    wo_ = w.permute(0, 1, 3, 4, 2).reshape(k, o, kh * kw * c).contiguous()  # [K, O, (i, j, c)]
    gx = torch.empty(geo.bsz, k * c, geo.h, geo.w, memory_format=torch.channels_last, device=w.device)
    _check(gy, wo_, gx)
    if library().conv_input_grad(_threads(), geo.bsz, k, geo.h, geo.w, c, o, kh, kw, *geo.stride, *geo.padding,
                                 *geo.dilation, geo.ho, geo.wo, _ptr(gy), _ptr(wo_), _ptr(gx)) != 0:
        raise MemoryError("raysim fixed-order GEMM: scratch allocation failed")
    return gx


def _backward(ctx, gy):
    import torch

    xk, w = ctx.saved_tensors
    geo = ctx.geo
    # the bias's gradient: dy summed over images and positions, in the layout it came in (as an add's backward)
    gb = gy.sum(dim=(0, 2, 3)).view(w.shape[0], w.shape[1]) if ctx.needs_input_grad[2] else None
    gy = gy.contiguous(memory_format=torch.channels_last)  # [B, Ho, Wo, K*O] in memory
    gw = _weight_grad(xk, w, gy, geo, ctx.tables) if ctx.needs_input_grad[1] else None
    gx = None
    if ctx.needs_input_grad[0]:
        gx = _input_grad(w, gy, geo)
        gx = gx.contiguous() if geo.first else gx
    return gx, gw, gb, None


_Fn = None


def _function():
    """The autograd function (built on first use: this module imports torch lazily)."""
    global _Fn
    if _Fn is None:
        import torch

        _Fn = type("FixedOrderGroupedConv", (torch.autograd.Function,),
                   {"forward": staticmethod(_forward),
                    "backward": staticmethod(torch.autograd.function.once_differentiable(_backward))})
    return _Fn


def grouped_conv2d(x, w, bias, stride, padding, dilation):
    """``F.conv2d(x, w.reshape(K*O, C, kh, kw), bias.reshape(-1), stride, padding, dilation, groups=K)`` for
    x [B, K*C, H, W], w [K, O, C, kh, kw], bias [K, O] or None, in the fixed order (module docstring); the result
    (and x's gradient) in x's memory layout (channels-last, or channels-first where x is not clearly channels-last)."""
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    return _function().apply(x, w, bias, (pair(stride), pair(padding), pair(dilation)))


def _linear_forward(ctx, x, w, bias):
    """y[k] = x[k] w[k]^T (+ bias[k]): x [K, B, in], w [K, out, in] -> [K, B, out], the fixed-order GEMM."""
    import torch

    k, bsz, fin = x.shape
    out = w.shape[1]
    xc, wc = x.detach().contiguous(), w.detach().contiguous()
    y = torch.empty(k, bsz, out, device=xc.device)
    gemm(Operand(xc, (bsz * fin, 0, 0, fin, 1)), Operand(wc, (out * fin, 0, 0, 1, fin)),
         Operand(y, (bsz * out, 0, out, 1), None if bias is None else bias.detach().contiguous()),
         Dims(k, 1, 1, bsz, out, fin))
    if any(ctx.needs_input_grad[:3]):
        ctx.save_for_backward(xc, wc)
    return y


def _linear_backward(ctx, gy):
    """dx[k] = dy[k] w[k]; dw[k] = dy[k]^T x[k] (the batch summed in order); dbias[k] = dy[k] summed over the batch
    (as baddbmm's backward sums)."""
    import torch

    xc, wc = ctx.saved_tensors
    k, bsz, fin = xc.shape
    out = wc.shape[1]
    gy = gy.contiguous()
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        gx = torch.empty(k, bsz, fin, device=gy.device)
        gemm(Operand(gy, (bsz * out, 0, 0, out, 1)), Operand(wc, (out * fin, 0, 0, fin, 1)),
             Operand(gx, (bsz * fin, 0, fin, 1)), Dims(k, 1, 1, bsz, fin, out))
    if ctx.needs_input_grad[1]:
        gw = torch.empty(k, out, fin, device=gy.device)
        gemm(Operand(gy, (bsz * out, 0, 0, 1, out)), Operand(xc, (bsz * fin, 0, 0, fin, 1)),
             Operand(gw, (out * fin, 0, fin, 1)), Dims(k, 1, 1, out, fin, bsz))
    if ctx.needs_input_grad[2]:
        gb = gy.sum(1)
    return gx, gw, gb


_Linear = None


def grouped_linear(x, w, bias):
    """``torch.baddbmm(bias.unsqueeze(1), x, w.transpose(1, 2))`` (``bmm`` without a bias) for x [K, B, in],
    w [K, out, in], bias [K, out] or None, in the fixed order."""
    global _Linear
    if _Linear is None:
        import torch

        _Linear = type("FixedOrderGroupedLinear", (torch.autograd.Function,),
                       {"forward": staticmethod(_linear_forward),
                        "backward": staticmethod(torch.autograd.function.once_differentiable(_linear_backward))})
    return _Linear.apply(x, w, bias)


if __name__ == "__main__":  # python -m raysim.fixed_gemm: build the kernel now and say where it is
    library()
    print(f"raysim fixed-order GEMM: {_build()}", file=sys.stderr)
