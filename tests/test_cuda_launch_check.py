"""KILN_CHECK_LAUNCHES=1: a kernel's launch arguments against its parameters (the sizes come from the cubin,
tests/test_kernel_compile.py checks them against the PTX). The sizes CuPy passes follow its _pointer."""

import numpy as np
import pytest

from kiln.backend.cuda.launch import argument_bytes, check_arguments, f32, i32, i64
from kiln.errors import KilnError


class DeviceArray:  # what CuPy's ndarray shows a launch: a device pointer
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


def test_argument_bytes_are_cupys():
    tma_map = np.zeros(128, dtype=np.uint8).view(np.dtype((np.void, 128)))
    assert [argument_bytes(a) for a in (None, DeviceArray(), i32(1), i64(1), f32(1.0), np.float16(1), tma_map,
                                        7, True, 0.5)] == [8, 8, 4, 8, 4, 2, 128, 8, 8, 8]
    assert argument_bytes(np.zeros(3, np.int32)) is None and argument_bytes("x") is None  # CuPy refuses these


def test_matching_arguments_pass():
    check_arguments("k", [8, 4, 4, 8], (DeviceArray(), i32(3), f32(0.5), None))
    check_arguments("k", [4, 4], (7, i64(7)))  # an integer wider than its parameter: read by its low bytes


def test_a_missing_argument_names_the_kernel_and_both_counts():
    with pytest.raises(KilnError, match=r"kernel attention_bwd_fused_tc<__nv_bfloat16, 64> takes 3 arguments, this "
                                        r"launch passes 2"):
        check_arguments("attention_bwd_fused_tc<__nv_bfloat16, 64>", [8, 8, 4], (DeviceArray(), DeviceArray()))


def test_a_narrow_argument_or_a_float_of_another_width_names_each_argument():
    with pytest.raises(KilnError, match=r"kernel k: argument 1 is 8 bytes \(float\), its parameter 4; argument 2 is "
                                        r"4 bytes \(int32\), its parameter 8; argument 3 is 4 bytes \(float32\), its "
                                        r"parameter 8"):
        check_arguments("k", [8, 4, 8, 8], (DeviceArray(), 0.5, i32(5), f32(5)))  # a bare float is a double to CuPy
