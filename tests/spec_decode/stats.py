"""Chi-square goodness of fit without scipy: the p-value is the regularized upper incomplete
gamma function Q(df / 2, statistic / 2), which torch provides."""

from __future__ import annotations

import torch


def chi_square_p_value(observed_counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """observed_counts: [num_categories] int; expected_probs: [num_categories] float summing to 1.
    Returns P(chi2 >= statistic) with num_categories - 1 degrees of freedom."""
    observed = observed_counts.double()
    expected = expected_probs.double() * observed.sum()
    if bool((expected < 5).any()):
        raise ValueError(f"expected counts {expected.tolist()} are too small for a chi-square test")
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees_of_freedom = torch.tensor(len(observed) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees_of_freedom / 2, statistic / 2))
