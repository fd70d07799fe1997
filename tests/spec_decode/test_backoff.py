"""Per-request speculation back-off: a request whose drafts are all rejected stops
drafting for growing pauses (its steps become plain decodes), one whose drafts are
accepted keeps drafting (engine-level checks: test_engine_spec.py)."""

from __future__ import annotations

from engine.spec_decode.backoff import MIN_ACCEPTANCE, DraftBackoff


def _pause_after(backoff: DraftBackoff, num_drafts: int, num_accepted: int) -> int:
    """Record one verification; -> how many steps drafting is paused after it."""
    backoff.record(num_drafts, num_accepted)
    steps = 0
    while not backoff.may_draft():
        steps += 1
    return steps


def test_rejections_pause_drafting_for_doubling_windows_and_acceptance_resumes_it() -> None:
    backoff = DraftBackoff()
    assert backoff.may_draft()
    assert _pause_after(backoff, 4, 0) == 0, "one bad verification is not enough to pause"
    pauses = [_pause_after(backoff, 4, 0) for _ in range(4)]
    assert pauses[0] >= 1 and all(b == 2 * a for a, b in zip(pauses[:-1], pauses[1:], strict=True)), pauses
    assert _pause_after(backoff, 4, 4) == 0  # drafts pay again
    assert backoff.recent_acceptance >= MIN_ACCEPTANCE
    # the next pause starts short again
    assert [_pause_after(backoff, 4, 0), _pause_after(backoff, 4, 0)] == [0, pauses[0]]


def test_good_drafts_never_pause() -> None:
    backoff = DraftBackoff()
    for _ in range(50):
        backoff.record(4, 3)
        assert backoff.may_draft()
    assert backoff.num_pauses == 0
