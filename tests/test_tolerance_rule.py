"""The reference-error rule of tests/utils.py (`compare_to_exact`), which the conformance suites use for
fp32, bf16 and fp16: it passes what it should and fails what it should, on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from utils import FLOOR_ULPS, REFERENCE_ERROR_FACTOR, compare_to_exact


def _case(dtype, reference_error: float, backend_error: float):
    exact = torch.linspace(-2, 2, 50, dtype=torch.float64)
    reference = (exact + reference_error).to(dtype)
    actual = exact.clone()
    actual[7] += backend_error
    return (reference,), (actual.to(dtype),), (exact,)


def test_within_the_reference_error_passes():
    compare_to_exact(*_case(torch.float32, 1e-5, 0.5 * REFERENCE_ERROR_FACTOR * 1e-5))


def test_beyond_the_reference_error_fails_and_says_where():
    with pytest.raises(AssertionError, match=r"y: largest error .* at \(7,\) > .*the reference's own"):
        compare_to_exact(*_case(torch.float32, 1e-5, 2 * REFERENCE_ERROR_FACTOR * 1e-5))


def test_an_exact_reference_leaves_only_the_floor():
    ulp = torch.finfo(torch.float32).eps * 2  # largest |exact| is 2
    compare_to_exact(*_case(torch.float32, 0.0, 0.5 * FLOOR_ULPS * ulp))
    with pytest.raises(AssertionError):
        compare_to_exact(*_case(torch.float32, 0.0, 2 * FLOOR_ULPS * ulp))


def test_the_bound_follows_the_dtype():
    """A bf16 backend as far off as a bf16 reference passes; the same error in fp32 with an fp32 reference
    (exact to fp32 rounding) does not."""
    compare_to_exact(*_case(torch.bfloat16, 1e-2, 2e-2))
    with pytest.raises(AssertionError):
        compare_to_exact(*_case(torch.float32, 0.0, 2e-2))


def test_missing_gradient_must_be_missing_in_both():
    with pytest.raises(AssertionError, match="gradient"):
        compare_to_exact((torch.zeros(2), None), (torch.zeros(2), torch.zeros(2)),
                         (torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)))
