"""The rejection sampler kernel against its torch reference, its exact greedy semantics, the
absence of uninitialized or out-of-bounds accesses, and its output distribution."""

from __future__ import annotations

import pytest
import torch

from kernels.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample, rejection_sample_ref
from tests.spec_decode.stats import chi_square_p_value

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
POISON = -777_777
# Significance level of every chi-square test here; seeds are fixed, so a pass is deterministic.
ALPHA = 1e-3


def normalized(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(dim=-1, keepdim=True)


def make_batch(
    num_draft_tokens: list[int],
    vocab_size: int,
    is_greedy: list[bool],
    with_draft_probs: bool,
    seed: int,
    device: str = "cpu",
) -> dict:
    """Random verification inputs where drafts are often, but not always, accepted: the draft
    distribution is a blend of the target and noise, and some drafts copy the target argmax."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(num_draft_tokens)
    batch = len(num_draft_tokens)
    target_logits = torch.randn(num_rows, vocab_size, generator=gen) * 3
    target_probs = torch.softmax(target_logits, dim=-1)
    draft_probs = normalized(0.6 * target_probs + 0.4 * torch.rand(num_rows, vocab_size, generator=gen))
    if num_rows:
        draft_token_ids = torch.multinomial(draft_probs, 1, generator=gen)[:, 0]
    else:
        draft_token_ids = torch.zeros(0, dtype=torch.int64)
    target_argmax = target_logits.argmax(dim=-1)
    copy_argmax = torch.rand(num_rows, generator=gen) < 0.6
    draft_token_ids = torch.where(copy_argmax, target_argmax, draft_token_ids)
    inputs = {
        "draft_token_ids": draft_token_ids,
        "num_draft_tokens": num_draft_tokens,
        "draft_probs": draft_probs if with_draft_probs else None,
        "target_probs": target_probs,
        "target_argmax": target_argmax,
        "bonus_token_ids": torch.randint(0, vocab_size, (batch,), generator=gen),
        "is_greedy": torch.tensor(is_greedy, dtype=torch.bool),
        "uniform_samples": torch.rand(num_rows, generator=gen),
        "recovery_noise": torch.empty(batch, vocab_size).exponential_(generator=gen).clamp_min(1e-12),
    }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


CASES = {
    "greedy": ([3, 4, 1, 4, 2], [True] * 5),
    "sampled": ([4, 2, 4, 3, 1, 4], [False] * 6),
    "mixed": ([4, 1, 3, 4, 2, 4, 3], [True, False, False, True, False, True, False]),
    "zero_drafts": ([0, 3, 0, 4, 0], [False, True, True, False, True]),
    "all_zero_drafts": ([0, 0, 0], [False, True, False]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "ngram"])
@pytest.mark.parametrize("vocab_size", [37, 1500])  # 1500 spans two vocab blocks of the kernel
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case: str, vocab_size: int, with_draft_probs: bool, device: str) -> None:
    num_draft_tokens, is_greedy = CASES[case]
    max_spec_len = 4
    found_acceptance = found_rejection = False
    for seed in range(3):
        inputs = make_batch(num_draft_tokens, vocab_size, is_greedy, with_draft_probs, seed, device)
        got = rejection_sample(**inputs, max_spec_len=max_spec_len)
        want = rejection_sample_ref(**inputs, max_spec_len=max_spec_len)
        assert got.shape == (len(num_draft_tokens), max_spec_len + 1)
        assert got.device.type == device
        assert torch.equal(got.cpu(), want.cpu()), (
            f"seed {seed}: kernel {got.tolist()} != reference {want.tolist()}"
        )
        num_emitted = (want != PLACEHOLDER_TOKEN_ID).sum(dim=1).cpu()
        num_drafts = torch.tensor(num_draft_tokens)
        found_acceptance |= bool((num_emitted > 1).any())
        found_rejection |= bool((num_emitted <= num_drafts).any())
    if sum(num_draft_tokens):
        # The random inputs exercise both paths, so the comparison above means something.
        assert found_acceptance and found_rejection


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_accepts_only_the_target_argmax(device: str) -> None:
    vocab_size = 10
    # request 0: third draft differs from the argmax; request 1: all accepted; request 2: no drafts.
    draft_token_ids = torch.tensor([4, 5, 6, 1, 2])
    target_argmax = torch.tensor([4, 5, 9, 1, 2])
    # The target probabilities disagree with the argmax on purpose: greedy must not look at them.
    target_probs = torch.full((5, vocab_size), 1.0 / vocab_size)
    out = rejection_sample(
        draft_token_ids.to(device),
        [3, 2, 0],
        None,
        target_probs.to(device),
        target_argmax.to(device),
        torch.tensor([7, 8, 3]).to(device),
        torch.tensor([True, True, True]).to(device),
        torch.full((5,), 0.999).to(device),
        torch.ones(3, vocab_size).to(device),
        max_spec_len=3,
    )
    assert out.cpu().tolist() == [[4, 5, 9, -1], [1, 2, 8, -1], [3, -1, -1, -1]]


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_rule_on_hand_made_inputs(device: str) -> None:
    """p(d)/q(d) = 0.5: accepted when u < 0.5; a rejection samples max(0, p - q) only."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 4)
    q = torch.tensor([[0.0, 0.0, 0.2, 0.8]] * 4)  # residual max(0, p - q) = [0.1, 0.2, 0.1, 0]
    noise = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.05, 1.0, 1.0, 1.0]])
    out = rejection_sample(
        torch.tensor([3, 3, 3, 3]).to(device),
        [2, 2],
        q.to(device),
        p.to(device),
        p.argmax(dim=-1).to(device),
        torch.tensor([0, 2]).to(device),
        torch.tensor([False, False]).to(device),
        torch.tensor([0.4, 0.3, 0.2, 0.6]).to(device),
        noise.to(device),
        max_spec_len=2,
    )
    # request 0: both accepted, then its bonus. request 1: second draft rejected, residual
    # scores with its noise are [2, 0.2, 0.1, 0] so token 0 is recovered.
    assert out.cpu().tolist() == [[3, 3, 0], [3, 0, -1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "ngram"])
def test_every_output_slot_is_written_and_nothing_else(with_draft_probs: bool, device: str) -> None:
    """Output and padding are poisoned before the call: no poison may survive in a result slot,
    and poison placed beyond the vocabulary, after the first rejection or in the recovery noise
    of fully accepted requests must not leak into any result."""
    num_draft_tokens = [4, 0, 2, 4, 1, 3]
    is_greedy = [False, True, False, True, False, False]
    vocab_size, padded_vocab, max_spec_len = 37, 64, 4
    inputs = make_batch(num_draft_tokens, vocab_size, is_greedy, with_draft_probs, seed=5)
    want = rejection_sample_ref(**inputs, max_spec_len=max_spec_len)

    # Row-strided views whose padding columns hold a huge probability (a tiny noise): an
    # unmasked read would make an out-of-vocabulary token win the residual argmax.
    num_rows, batch = sum(num_draft_tokens), len(num_draft_tokens)
    for name, rows in (("target_probs", num_rows), ("draft_probs", num_rows), ("recovery_noise", batch)):
        if inputs[name] is None:
            continue
        padded = torch.full((rows, padded_vocab), 1e30 if name != "recovery_noise" else 1e-30)
        padded[:, :vocab_size] = inputs[name]
        inputs[name] = padded.to(device)[:, :vocab_size]
    # Inputs the result must not depend on: rows after the first rejection of each request and
    # the recovery noise of requests that accept every draft.
    emitted = (want != PLACEHOLDER_TOKEN_ID).sum(dim=1)
    start = 0
    for req, num_drafts in enumerate(num_draft_tokens):
        num_accepted = int(emitted[req]) - 1
        unread_rows = slice(start + num_accepted + 1, start + num_drafts)
        for name in ("target_probs", "draft_probs", "uniform_samples"):
            if inputs[name] is not None:
                inputs[name][unread_rows] = float("nan")
        if num_accepted == num_drafts:
            inputs["recovery_noise"][req] = float("nan")
        start += num_drafts
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    out_storage = torch.full((batch, max_spec_len + 1 + 3), POISON, dtype=torch.int64, device=device)
    out = out_storage[:, : max_spec_len + 1]
    got = rejection_sample(**inputs, max_spec_len=max_spec_len, out=out)

    assert got.data_ptr() == out.data_ptr()
    assert not bool((out == POISON).any()), f"unwritten output slots: {out.tolist()}"
    assert bool((out_storage[:, max_spec_len + 1 :] == POISON).all()), "wrote past the output row"
    assert torch.equal(out.cpu(), want)


def test_bad_inputs_raise_clear_errors() -> None:
    good = make_batch([2, 1], 11, [False, True], with_draft_probs=True, seed=0)
    with pytest.raises(ValueError, match=r"num_draft_tokens\[0\]=2 is outside"):
        rejection_sample(**good, max_spec_len=1)
    with pytest.raises(ValueError, match="draft_token_ids must have shape"):
        rejection_sample(**{**good, "draft_token_ids": good["draft_token_ids"][:2]}, max_spec_len=2)
    with pytest.raises(ValueError, match="recovery_noise must have shape"):
        rejection_sample(**{**good, "recovery_noise": good["recovery_noise"][:, :5]}, max_spec_len=2)
    with pytest.raises(ValueError, match="target_probs must have dtype"):
        rejection_sample(**{**good, "target_probs": good["target_probs"].half()}, max_spec_len=2)
    with pytest.raises(ValueError, match="is_greedy must have dtype"):
        rejection_sample(**{**good, "is_greedy": good["is_greedy"].int()}, max_spec_len=2)
    with pytest.raises(ValueError, match="out must be int64"):
        rejection_sample(**good, max_spec_len=2, out=torch.empty(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"draft_token_ids must be in \[0, 11\), got min 0 max 11"):
        rejection_sample(**{**good, "draft_token_ids": torch.tensor([0, 11, 3])}, max_spec_len=2)
    with pytest.raises(ValueError, match="max_spec_len must be >= 0"):
        rejection_sample_ref(**good, max_spec_len=-1)


def empirical_distributions(
    sampler, num_requests: int, with_draft_probs: bool, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    """Two drafts per request, drawn from fixed q0, q1 (or fixed n-gram drafts); targets fixed
    p0, p1 and a bonus drawn from p2. Returns the counts of the first output token, of the second
    among requests that reach it, of the bonus among requests that accept both, and p0, p1, p2."""
    vocab_size = 4
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.1, 0.3], [0.25, 0.25, 0.4, 0.1]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.2, 0.6]])
    gen = torch.Generator().manual_seed(seed)
    rows_q = q.repeat(num_requests, 1)
    if with_draft_probs:
        draft_token_ids = torch.multinomial(rows_q, 1, generator=gen)[:, 0]
    else:
        draft_token_ids = torch.tensor([3, 0]).repeat(num_requests)
    rows_p = p[:2].repeat(num_requests, 1)
    out = sampler(
        draft_token_ids.to(device),
        [2] * num_requests,
        rows_q.to(device) if with_draft_probs else None,
        rows_p.to(device),
        rows_p.argmax(dim=-1).to(device),
        torch.multinomial(p[2], num_requests, replacement=True, generator=gen).to(device),
        torch.zeros(num_requests, dtype=torch.bool, device=device),
        torch.rand(2 * num_requests, generator=gen).to(device),
        torch.empty(num_requests, vocab_size).exponential_(generator=gen).clamp_min(1e-12).to(device),
        max_spec_len=2,
    ).cpu()
    counts = [torch.bincount(column[column >= 0], minlength=vocab_size) for column in out.T]
    return counts[0], counts[1], counts[2], p[0], p[1], p[2]


@pytest.mark.parametrize(
    ("sampler", "num_requests", "device"),
    [
        pytest.param(rejection_sample_ref, 20_000, "cpu", id="reference"),
        # The interpreter runs ~6 ms per request, so the CPU kernel run is smaller.
        pytest.param(rejection_sample, 600, "cpu", id="kernel-cpu"),
        pytest.param(rejection_sample, 200_000, "cuda", id="kernel-gpu", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "ngram"])
def test_output_distribution_equals_target(
    sampler, num_requests: int, device: str, with_draft_probs: bool
) -> None:
    """Speculative sampling is exact: every emitted token follows the target distribution
    (chi-square goodness of fit, ALPHA per test), whatever the drafts were."""
    first, second, bonus, p0, p1, p2 = empirical_distributions(
        sampler, num_requests, with_draft_probs, device, seed=1234
    )
    assert int(first.sum()) == num_requests
    assert 0 < int(second.sum()) < num_requests and 0 < int(bonus.sum()) < int(second.sum())
    for name, counts, probs in (("first", first, p0), ("second", second, p1), ("bonus", bonus, p2)):
        p_value = chi_square_p_value(counts, probs)
        assert p_value > ALPHA, f"{name} token counts {counts.tolist()} do not follow {probs.tolist()}"
    # The test has power: the same first tokens are far from the draft distribution.
    wrong = torch.tensor([0.4, 0.3, 0.2, 0.1])
    assert chi_square_p_value(first, wrong) < ALPHA


@pytest.mark.gpu
def test_row_offsets_beyond_int32() -> None:
    """Row * vocab offsets above 2**31 must address the right probabilities (int64 index math)."""
    vocab_size, max_spec_len = 128_256, 8
    num_requests = 2_100  # 16,800 rows x 128,256 = 2.15e9 elements (8.6 GB of float32)
    num_rows = num_requests * max_spec_len
    target_probs = torch.zeros(num_rows, vocab_size, device="cuda")
    rows = torch.arange(num_rows, device="cuda")
    target_tokens = (rows * 7919 + 1) % vocab_size
    target_probs[rows, target_tokens] = 1.0
    draft_token_ids = target_tokens.clone()
    # Request i rejects its draft at position i % max_spec_len: recovered = the target's token.
    reject_rows = (
        torch.arange(num_requests, device="cuda") * max_spec_len
        + torch.arange(num_requests, device="cuda") % max_spec_len
    )
    draft_token_ids[reject_rows] = (target_tokens[reject_rows] + 1) % vocab_size
    out = rejection_sample(
        draft_token_ids,
        [max_spec_len] * num_requests,
        None,
        target_probs,
        target_tokens,
        torch.full((num_requests,), 5, device="cuda"),
        torch.zeros(num_requests, dtype=torch.bool, device="cuda"),
        torch.full((num_rows,), 0.5, device="cuda"),
        torch.ones(num_requests, vocab_size, device="cuda"),
        max_spec_len=max_spec_len,
    ).cpu()
    expected = torch.full((num_requests, max_spec_len + 1), PLACEHOLDER_TOKEN_ID)
    tokens = target_tokens.cpu().view(num_requests, max_spec_len)
    for req in range(num_requests):
        num_accepted = req % max_spec_len
        expected[req, : num_accepted + 1] = tokens[req, : num_accepted + 1]
    assert int(reject_rows[-1]) * vocab_size > 2**31
    assert torch.equal(out, expected)
