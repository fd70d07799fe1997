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


def chi_square_homogeneity_p_value(labels_a: torch.Tensor, labels_b: torch.Tensor) -> float:
    """Do two samples of category labels ([n_a] and [n_b] ints) come from one distribution?
    Categories whose pooled expected count is under 5 in either sample are merged into one;
    returns P(chi2 >= statistic) with (num_categories - 1) degrees of freedom."""
    categories, inverse = torch.unique(torch.cat([labels_a, labels_b]), return_inverse=True)
    counts_a = torch.bincount(inverse[: len(labels_a)], minlength=len(categories)).double()
    counts_b = torch.bincount(inverse[len(labels_a) :], minlength=len(categories)).double()
    pooled = (counts_a + counts_b) / (len(labels_a) + len(labels_b))
    rare = pooled * min(len(labels_a), len(labels_b)) < 5
    if bool(rare.any()):
        keep = ~rare
        counts_a = torch.cat([counts_a[keep], counts_a[rare].sum().view(1)])
        counts_b = torch.cat([counts_b[keep], counts_b[rare].sum().view(1)])
        pooled = torch.cat([pooled[keep], pooled[rare].sum().view(1)])
    if len(pooled) < 2:
        raise ValueError("a homogeneity test needs at least two categories")
    expected_a = pooled * len(labels_a)
    expected_b = pooled * len(labels_b)
    statistic = ((counts_a - expected_a) ** 2 / expected_a).sum() + (
        (counts_b - expected_b) ** 2 / expected_b
    ).sum()
    degrees_of_freedom = torch.tensor(len(pooled) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees_of_freedom / 2, statistic / 2))
