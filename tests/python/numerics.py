"""How the Python tests compare numbers: always relative to the reference's magnitude.

An absolute bound breaks on a machine whose BLAS kernels sum in another order (it did, in the
C++ suites: |ΔdX| = 3e-7 against a bound of 1e-7); a bound on the error relative to the
reference's largest value holds everywhere. The C++ suites use the same rule
(tests/core/reference.h, RelativeError).
"""

import math

import torch


def relative_error(actual, expected, floor: float = 0.0) -> float:
    """max |actual − expected| / max(max |expected|, floor), for tensors or numbers.

    An all-zero reference (and floor 0) gives 0 for an all-zero `actual`, infinity otherwise.
    Equal values count as no difference, equal infinities included (a log-probability of −inf
    outside a sampler's kept set), and the magnitude is the finite values'.
    """
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    if actual.shape != expected.shape:
        return math.inf
    if actual.numel() == 0:
        return 0.0
    diff = torch.where(actual == expected, 0.0, (actual - expected).abs()).max().item()
    finite = expected[expected.isfinite()]
    scale = max(finite.abs().max().item() if finite.numel() else 0.0, floor)
    if diff == 0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def close(actual, expected, rel: float, floor: float = 0.0) -> bool:
    """relative_error(actual, expected, floor) <= rel."""
    return relative_error(actual, expected, floor) <= rel
