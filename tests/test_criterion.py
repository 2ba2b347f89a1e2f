"""The flash criterion itself (tests/attn_cases.py, the self-check's ``compare``): a correct result a
few ulps off a large value passes even where the naive same-dtype result rounds perfectly (a scalar
loss of ~29 in float32 failed on an Intel AVX-512 CPU under an absolute eps below one ulp), and a
wrong one still fails."""

import pytest
import torch

from attn_cases import assert_flash_criterion
from coreattn.selfcheck import compare

REF = torch.tensor([29.09], dtype=torch.float64)
ULP = 2.0 ** (4 - 23)  # float32's ulp in [16, 32)


def _off(ulps: int) -> torch.Tensor:
    return (REF + ulps * ULP).float()


def test_a_scalar_two_ulps_off_passes_against_a_perfect_naive():
    naive = REF.float()  # rounded as well as float32 can
    assert_flash_criterion("loss", _off(2), naive, REF, 1e-6)
    assert compare("loss", _off(2), naive, REF, 1e-6).passed


def test_a_wrong_scalar_still_fails():
    naive = REF.float()
    with pytest.raises(AssertionError):
        assert_flash_criterion("loss", _off(40), naive, REF, 1e-6)
    assert not compare("loss", _off(40), naive, REF, 1e-6).passed
