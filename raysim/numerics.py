"""Which CPU and GPU kernels every computing process runs (``backend.numerics``): the same table on any machine.

torch picks its CPU kernels at run time: ATen's vector kernels by the CPU's capability (AVX-512, AVX2, default),
oneDNN's convolutions by the ISA *and* the cache sizes, MKL's BLAS by the vendor and ISA. Each choice orders float
reductions differently, so one config and one seed gave three tables on three CPUs (measured on the quick start:
0.9552, 0.9593, 0.9613 after 100 rounds). ``portable`` (the default) makes every process that computes — the driver,
the server actor, every client actor on every node — run one kernel choice that every x86-64 CPU with AVX2 has and
that depends on nothing else of the machine:

============================  ==============  ==========================================================================
setting                       portable value  why
============================  ==============  ==========================================================================
``ATEN_CPU_CAPABILITY``        ``avx2``        ATen's vector kernels: the AVX2 build (fixed vector width, fixed order)
``MKL_CBWR``                   ``COMPATIBLE``  MKL's float GEMM (linear layers, convolutions): the one CNR branch that is
                                               the same on Intel and AMD (SSE2 without approximate reciprocals); the
                                               ISA branches (``AVX2``) fall back to AUTO on non-Intel CPUs
oneDNN                         off             its convolution kernels pick blocking by cache size: convolutions run
                                               ATen's own (unfold + GEMM) instead (``torch.backends.mkldnn.enabled``)
``ONEDNN_MAX_CPU_ISA``         ``AVX2``        a cap for any path that still reaches oneDNN
``OPENBLAS_CORETYPE``          ``Haswell``     numpy's OpenBLAS (read when numpy loads)
intra-op threads               ``backend.torch_threads`` (1 by default): reductions split by thread count
``aten::sqrt`` on the CPU      IEEE            torch computes sqrt with oneMKL's VML (``vsSqrt``/``vdSqrt``), whose kernels seed
                                               from ``rsqrtps``, an approximate instruction that Intel and AMD implement
                                               differently (so do the VML ``log2/log10/tan/atan/asin/acos`` kernels, via
                                               ``rcpps``); MKL_CBWR does not touch it: portable replaces the CPU kernel of
                                               ``sqrt`` by :func:`ieee_sqrt` (IEEE operations only)
CUDA (``backend.device``)      deterministic   ``torch.use_deterministic_algorithms``, cuDNN deterministic and not
                                               benchmarking, no TF32, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
============================  ==============  ==========================================================================

Measured on the 10-round quick start (a 2-core Intel Xeon with AVX-512): portable took 0.96x the native time. On an
H100 (the 20-round quick start, benchmarks/gpu_numerics.py): portable gave the same table run to run, loop and
vectorised, native did not; the GPU table is not the CPU's (same rows and message sizes; the clients' mean accuracy
within 0.045 in every round, 0.0006 at the end).
``native`` keeps torch's own choice (the fastest kernels of each machine; the table then depends on the CPU).

Every setting is an environment variable read lazily, when the first kernel of its library runs — so they work when
set before the first computation, not only before ``import torch``. ``import raysim`` pins them (unless the
environment says ``RAYSIM_NUMERICS=native``); :func:`enter` then fixes the mode of the process when a runner starts
and checks that the kernels really are the pinned ones (a process that computed before raysim was imported cannot be
re-pinned: one line says so). A process computes in one mode for its lifetime.

Nothing here imports torch at module level: ``raysim/__init__`` calls :func:`pin_at_import` first.
"""
from __future__ import annotations

import json
import os
import platform
import socket
from typing import Optional

from raysim.errors import ConfigError

MODES = ("portable", "native")
PORTABLE_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OPENBLAS_CORETYPE": "Haswell",
}
PORTABLE_CAPABILITY = "AVX2"  # what torch.backends.cpu.get_cpu_capability() reports under the pin
CUDA_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic cuBLAS reductions (read when cuBLAS starts)
MARK = "RAYSIM_NUMERICS_PINNED"  # JSON {variable: the value it had before raysim pinned it, or null}: which pins are
#                                  raysim's (a child process, e.g. a Ray worker, inherits them with the mark)
ENV_MODE = "RAYSIM_NUMERICS"  # portable (default) | native: what ``import raysim`` pins

_mode: Optional[str] = None  # the mode this process computes in, once a runner has entered it
_device: Optional[str] = None  # the device a runner of this process resolved backend.device to (cpu, cuda:0, ...)


def _cpuinfo(key: str):
    """The first value of ``key`` in /proc/cpuinfo (None where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, value = line.partition(":")
                if k.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set:
    """The CPU's feature flags (/proc/cpuinfo); empty where there is none (then nothing is refused for it)."""
    return set((_cpuinfo("flags") or "").split())


def node_cpu() -> tuple:
    """(host, CPU model, has AVX2 and FMA) of this machine: what a cluster node reports before a portable run
    (raysim/backends/ray_preflight.py runs it as a Ray task on each node; this module loads no torch)."""
    return socket.gethostname(), cpu_model(), has_avx2()


def has_avx2(flags: Optional[set] = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    if not flags:  # no /proc/cpuinfo (not Linux): let torch decide; the capability check below still guards
        return platform.machine().lower() in ("x86_64", "amd64")
    return {"avx2", "fma"} <= flags


def _pinned() -> dict:
    try:
        return json.loads(os.environ.get(MARK, "{}"))
    except ValueError:
        return {}


def pin(env: dict) -> None:
    """Set the variables of ``env``, remembering (in the environment, for child processes) what they were."""
    saved = _pinned()
    for k, v in env.items():
        if k not in saved:
            saved[k] = os.environ.get(k)
        os.environ[k] = v
    os.environ[MARK] = json.dumps(saved, sort_keys=True)


def unpin() -> None:
    """Undo raysim's pins (the user's own settings of the same variables come back)."""
    for k, old in _pinned().items():
        if old is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = old
    os.environ.pop(MARK, None)


def pin_at_import() -> None:
    """Called first by ``import raysim``: pin the portable kernels before anything computes, unless the environment
    asks for native (``RAYSIM_NUMERICS=native``)."""
    if os.environ.get(ENV_MODE, "portable").strip().lower() != "native" and _mode is None:
        pin(PORTABLE_ENV)


def active_mode() -> Optional[str]:
    """The mode this process computes in (``portable`` / ``native``), or None before a runner entered one."""
    return _mode


def check_mode(mode: str, key: str = "backend.numerics") -> None:
    if mode not in MODES:
        raise ConfigError(key, f"must be one of: {', '.join(MODES)}; got {mode!r}")


def _where() -> str:
    return f"node {socket.gethostname()} ({cpu_model()})"


def enter(mode: str, device=None) -> dict:
    """Fix this process's kernels to ``mode`` before it computes (every runner calls it; the driver too, before it
    loads data) and check they took. Returns :func:`describe`. A second call with the other mode is an error."""
    global _mode, _device
    import torch

    check_mode(mode)
    if _mode is not None and _mode != mode:
        raise ConfigError("backend.numerics", f"{mode} requested, but this process already computed in {_mode} mode "
                                              f"(a process keeps one kernel choice); start a new Python process, with "
                                              f"{ENV_MODE}={mode} in its environment")
    if mode == "portable":
        if not has_avx2():
            raise ConfigError("backend.numerics", f"portable needs a CPU with AVX2 and FMA; {_where()} has none: use "
                                                  f"backend.numerics: native (the table then depends on the CPU)")
        pin(PORTABLE_ENV)
        torch.backends.mkldnn.enabled = False
        exact_sqrt()
        cap = torch.backends.cpu.get_cpu_capability()
        if cap != PORTABLE_CAPABILITY:
            raise ConfigError("backend.numerics", f"portable: this process chose its CPU kernels ({cap}) before raysim "
                                                  f"could pin them ({_where()}); import raysim before running any "
                                                  f"torch code, or set ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE "
                                                  f"before starting Python")
    else:
        was = _pinned()
        unpin()
        torch.backends.mkldnn.enabled = True
        cap = torch.backends.cpu.get_cpu_capability()
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()  # torch's test for AVX512 kernels
        if "ATEN_CPU_CAPABILITY" in was and os.environ.get("ATEN_CPU_CAPABILITY") is None and avx512 \
                and cap == PORTABLE_CAPABILITY:  # the capability was fixed while raysim's pin was set
            raise ConfigError("backend.numerics", f"native: this process already ran the portable kernels pinned by "
                                                  f"'import raysim' ({_where()}); start Python with {ENV_MODE}=native")
    if device is not None and getattr(device, "type", str(device)) == "cuda":
        cuda_deterministic(mode == "portable")
    _device = str(device) if device is not None else None  # the driver enters without one at the start of each run
    _mode = mode
    return describe()


_sqrt_library = None  # the torch.library registration of ieee_sqrt as aten::sqrt's CPU kernel (portable processes)


def ieee_sqrt(x):
    """sqrt(x) from IEEE-specified operations only, so the same bits on every x86-64 CPU: float32 (and half types)
    correctly rounded (equal to ``numpy.sqrt``), float64 ``x * rsqrt(x)`` (rsqrt = 1 / the sqrt instruction; within
    2 ulp, deterministic). torch's own CPU sqrt calls oneMKL VML, whose kernels start from the approximate
    ``rsqrtps`` (Intel and AMD return different approximations; the result is not correctly rounded: +-1 ulp on
    about 20% of float32 inputs), so an Adam step or a distance differed in the last bit between CPU vendors.

    Eight kernels a float32 call (it runs as aten::sqrt's CPU kernel in portable processes, once per parameter tensor
    per Adam step): the float64 estimate ``d * rsqrt(d)`` of a positive finite float32 ``d`` is within 2 float64 ulps
    (2^-52 relative) of sqrt(d), while sqrt(d) lies at least 2^-51 (relative) from every midpoint between two
    float32 numbers (a midpoint m has 25 significant bits, so m^2 has 50 and is never a float32: |d - m^2| >= ulp(m^2),
    |sqrt(d) - m| >= ulp(m^2) / (2 sqrt(d)) ~ 2^-51 m), so rounding the estimate to float32 gives the correctly
    rounded sqrt. Checked against the nearest-neighbour correction this function used to apply on top
    (:func:`_ieee_sqrt_corrected`) and numpy's sqrt: every float32 of [1, 4) and every subnormal (both paths commute
    exactly with scaling x by 4, so those two binades stand for every normal float32), every 97th of all 2^32 bit
    patterns, every float16 and bfloat16: 0 differences (tests/test_ieee_sqrt.py keeps a 1-in-7 sample)."""
    import torch

    if x.dtype == torch.float64:
        y = x * torch.rsqrt(x)
        return torch.where((x == 0) | (x == float("inf")), x, y)  # 0 * inf, inf * 0: sqrt(+-0) = +-0, sqrt(inf)
        # = inf; sqrt(-inf) and every other negative: NaN, as x * rsqrt(x) gives
    if not x.is_floating_point():
        return ieee_sqrt(x.to(torch.get_default_dtype()))
    d = x.double()
    y = (d * torch.rsqrt(d)).to(x.dtype)  # the correctly rounded sqrt for every positive finite x (docstring)
    # every other x gives NaN here (0 * inf, inf * 0, a negative's rsqrt, NaN): IEEE sqrt's value instead, as the
    # special cases give it: nan (a positive quiet NaN) for negatives and -inf, x itself for +-0, inf and NaN
    return torch.where(torch.isnan(y), torch.where(x < 0, float("nan"), x), y)


def _ieee_sqrt_corrected(x):
    """The float32 (and half types) path of :func:`ieee_sqrt` as it was before issue 48: the same estimate, then one
    exact nearest-neighbour correction and the special values by masks (28 kernels). Kept as the reference the
    shorter path is checked against (tests/test_ieee_sqrt.py; :func:`ieee_sqrt`'s docstring)."""
    import torch

    d = x.double()
    y = (d * torch.rsqrt(d)).to(x.dtype)  # within 1 ulp of sqrt(x) in x's precision
    yd = y.double()
    up = torch.nextafter(y, torch.full_like(y, float("inf")))
    dn = torch.nextafter(y, torch.full_like(y, float("-inf")))
    mu, ml = (yd + up.double()) * 0.5, (yd + dn.double()) * 0.5
    y = torch.where(d > mu * mu, up, torch.where(d < ml * ml, dn, y))
    special = torch.where(x < 0, torch.full_like(x, float("nan")), x)  # nan, -x, +-0, inf as IEEE sqrt gives them
    return torch.where((x > 0) & torch.isfinite(x), y, special)


def exact_sqrt() -> None:
    """Make :func:`ieee_sqrt` the CPU kernel of ``aten::sqrt`` (and its ``out=`` and in-place forms) in this process:
    every CPU sqrt then avoids VML — torch.optim.Adam's denominator, ``Tensor.sqrt`` in methods, autograd's forward
    (its backward formula is unchanged), ``torch.cdist``. Once per process (portable mode is for its lifetime)."""
    global _sqrt_library
    if _sqrt_library is not None:
        return
    import warnings

    import torch

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        lib.impl("sqrt", ieee_sqrt, "CPU")
        lib.impl("sqrt.out", lambda x, *, out: out.copy_(ieee_sqrt(x)), "CPU")
        lib.impl("sqrt_", lambda x: x.copy_(ieee_sqrt(x)), "CPU")
    _sqrt_library = lib


def cuda_deterministic(on: bool) -> None:
    """Portable mode on a GPU: deterministic algorithms (run to run on one GPU model; ops without a deterministic
    CUDA kernel warn), no TF32, cuDNN without autotuning. The variables only take effect before cuBLAS starts."""
    import torch

    if on:
        pin(CUDA_ENV)
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = not on and torch.backends.cudnn.benchmark
    torch.backends.cuda.matmul.allow_tf32 = False if on else torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False if on else torch.backends.cudnn.allow_tf32


def describe() -> dict:
    """What this process computes with (recorded in the run metadata under ``numerics``)."""
    import torch

    out = {"mode": _mode, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "mkldnn": bool(torch.backends.mkldnn.enabled), "torch_threads": torch.get_num_threads(),
           "cpu": cpu_model()}
    out["env"] = {k: os.environ.get(k) for k in (*PORTABLE_ENV, *CUDA_ENV) if os.environ.get(k) is not None}
    if _device is not None:  # where this process's runner computes: a GPU table is not the CPU's (README, numerics)
        out["device"] = _device
        if _device.startswith("cuda"):
            out["gpu"] = torch.cuda.get_device_name(torch.device(_device))
    return out
