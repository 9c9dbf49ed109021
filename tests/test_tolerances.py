"""The tolerance helpers follow the arithmetic: a logit near zero may carry its row's rounding."""
import pytest
import torch

from tolerances import FLOAT32_ROW, FP8_ROW, assert_logits_close


def test_a_logit_near_zero_may_carry_the_rounding_of_its_rows_large_ones():
    want = torch.tensor([[7.0, -3.0, 0.01, 2.5]])
    got = want.clone()
    got[0, 2] += 2.0e-4  # what an AMD EPYC gave against transformers with FP8 projections (rtol=atol=1e-4 failed)
    assert not torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert_logits_close(got, want, FP8_ROW)
    got[0, 2] += 4 * FP8_ROW * 7.0  # far past a rounding tie's step: a different numeric
    with pytest.raises(AssertionError, match="element 2 .row 0."):
        assert_logits_close(got, want, FP8_ROW)


def test_each_row_has_its_own_scale():
    want = torch.tensor([[100.0, 0.0], [1.0, 0.0]])
    got = want.clone()
    got[0, 1] = 1e-3  # within 2e-5 of 100
    assert_logits_close(got, want, FLOAT32_ROW)
    got[1, 1] = 1e-3  # not within 2e-5 of 1
    with pytest.raises(AssertionError, match="row 1"):
        assert_logits_close(got, want, FLOAT32_ROW)
