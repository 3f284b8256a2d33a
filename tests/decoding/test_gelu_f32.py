"""The fp32 GELU of the compiled decoding step (`decode_step.c`: `pi_gelu_f32`, an erf in vector lanes in place of
libm's erff): close to the exact GELU over the range a gate's hidden layer takes and beyond, IEEE where it must
be (NaN, ±inf, ±0), and the same bits from every build (vector width) and for every row length (the tail)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

import piattn.ops.pi.native as native

COMPILER = os.environ.get("CC") or "cc"
# The builds compared: the step's flags with this CPU's vector width and without (SSE on x86: four lanes).
BUILDS = {"native": ("-march=native",), "baseline": ()}


@pytest.fixture(scope="module")
def gelu(tmp_path_factory):
    """name -> the exported `pi_gelu_f32_row` of decode_step.c built with native.py's flags plus the build's own."""
    if shutil.which(COMPILER) is None:
        pytest.skip("no C compiler ($CC or cc) to build the compiled decoding step")
    folder = tmp_path_factory.mktemp("gelu")
    functions = {}
    for name, extra in BUILDS.items():
        library = folder / f"{name}.so"
        done = subprocess.run([COMPILER, *native._FLAGS, *extra, str(native.SOURCE), "-o", str(library), "-lm"],
                              capture_output=True, text=True)
        if done.returncode:
            if name == "baseline":
                pytest.fail(f"decode_step.c must build with the step's own flags: {done.stderr[-2000:]}")
            continue  # a compiler without -march=native: the baseline alone
        function = ctypes.CDLL(str(library)).pi_gelu_f32_row
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        function.restype = None
        functions[name] = function
    return functions


def _call(function, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.full_like(x, float("nan"))  # poisoned: an unwritten element cannot pass
    function(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def _grid() -> torch.Tensor:
    """Every fp32 from −12 to 12 that a step of 2^-17 reaches, and a geometric sweep of the small ones."""
    dense = torch.arange(-12 * 2**17, 12 * 2**17 + 1, dtype=torch.float64) / 2**17
    small = torch.logspace(-38, 0, 20001, dtype=torch.float64)
    return torch.cat([dense, small, -small]).float()


def test_the_gelu_is_within_its_stated_error_of_the_exact_one(gelu):
    """erf within 1.8e-7: GELU(x) = x/2·(1 + erf(x/√2)) within 0.9e-7·|x|, plus the roundings of x/√2, of the
    sum and of the products (an ulp of the result)."""
    x = _grid()
    exact = torch.nn.functional.gelu(x.double())
    ulp = torch.from_numpy(np.spacing(exact.float().abs().numpy())).double()
    for name, function in gelu.items():
        error = (_call(function, x).double() - exact).abs()
        bound = 0.9e-7 * x.double().abs() + ulp
        worst = int((error - bound).argmax())
        assert bool((error <= bound).all()), (f"{name}: at x = {x[worst].item()!r} the GELU is off by "
                                              f"{error[worst].item():.3g} > {bound[worst].item():.3g}")
        # and as close to torch's own fp32 GELU (the torch-ops step's) as that is to the exact one, roughly
        torch_error = (torch.nn.functional.gelu(x).double() - exact).abs()
        assert error.max() <= 4 * torch_error.max() + 1e-7, name


def test_non_finite_values_and_zeros_come_out_as_the_exact_formula_gives_them(gelu):
    x = torch.tensor([float("nan"), float("-inf"), float("inf"), -0.0, 0.0, -20.0, 20.0, -1e30, 1e30])
    # The formula in fp64: inf·(1 + 1)/2 = inf, −inf·0 = NaN, −20·(1 − 1)/2 = −0. (torch's fp32 GELU gives
    # NaN at +inf; libm's erff, which the step used before, gave inf, as this does.)
    expected = torch.tensor([float("nan"), float("nan"), float("inf"), -0.0, 0.0, -0.0, 20.0, -0.0, 1e30])
    for name, function in gelu.items():
        got = _call(function, x)
        assert torch.equal(got.isnan(), expected.isnan()), name
        finite = ~expected.isnan()
        assert torch.equal(got[finite], expected[finite]), name
        assert torch.equal(got[finite].signbit(), expected[finite].signbit()), name


def test_every_build_and_every_row_length_gives_the_same_bits(gelu):
    """Lanes compute alone: the vector width (8 with AVX, 4 without) and where a row's tail falls do not change a
    value."""
    x = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 4
    rows = {name: _call(function, x) for name, function in gelu.items()}
    first = next(iter(rows.values()))
    for name, row in rows.items():
        assert np.array_equal(row.numpy().view(np.uint32), first.numpy().view(np.uint32)), name
    for function in gelu.values():
        for n in range(1, 20):
            start = 3 * n
            part = _call(function, x[start:start + n])
            assert np.array_equal(part.numpy().view(np.uint32), first[start:start + n].numpy().view(np.uint32)), n
