"""The library's float32 -> bfloat16 rounding and widening (``to_bf16`` / ``from_bf16`` in
cuda_kernels/common/dnnl_matmul.cc): every bf16 kernel writes and reads these bits.  Checked
against the NumPy rounding of ``fusion.precision.policy`` (nearest even, NaN kept quiet, subnormals
rounded, not flushed) on special values and random bit patterns, with the AVX-512 loops and
with the portable ones (``MXFUSION_DISABLE_AVX512=1``, in a subprocess)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np

from fusion.native import library as _native
from fusion.precision import policy as P


def _special_bits() -> np.ndarray:
    return np.array([0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x00008000, 0x00018000,
                     0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0xFF7FFFFF,
                     0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFC12345, 0x7FBFFFFF, 0x7FFFFFFF,
                     0x3F800000, 0xBF7FFFFF], dtype=np.uint32)


def _bits(n: int = 100003, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([_special_bits(), rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)])


def _round(lib, x: np.ndarray) -> np.ndarray:
    y = np.empty(x.shape, np.uint16)
    lib.mxf_to_bf16(x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    return y


def _widen(lib, y: np.ndarray) -> np.ndarray:
    x = np.empty(y.shape, np.float32)
    lib.mxf_from_bf16(y.ctypes.data_as(ctypes.c_void_p), x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(y.size))
    return x


def check_library_rounding() -> None:
    lib = ctypes.CDLL(_native.load())
    bits = _bits()
    for lo, hi in ((0, bits.size), (0, 23), (5, 40), (3, 18), (1, 2)):   # tails of every length
        x = bits[lo:hi].view(np.float32).copy()
        want = P.to_bf16(x).view(np.uint16)
        got = _round(lib, x)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, "to_bf16 of %#010x gives %#06x, want %#06x" % (
            x.view(np.uint32)[bad[0]], got[bad[0]], want[bad[0]])
        w = _widen(lib, got)
        assert np.array_equal(w.view(np.uint32), P.from_bf16(got).view(np.uint32))


def test_library_rounding_matches_numpy():
    check_library_rounding()


def test_library_rounding_on_the_portable_loops():
    env = dict(os.environ, MXFUSION_DISABLE_AVX512="1")
    code = "import sys; sys.path[:0] = %r; import test_bf16_rounding as t; t.check_library_rounding()" % (
        [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
