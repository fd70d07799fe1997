"""Per-request speculation back-off: a request whose drafts keep being rejected stops
drafting for a while, so its steps run as plain decodes (CUDA-graph replays on a GPU)
instead of paying for verifications that emit about one token each."""

from __future__ import annotations

from dataclasses import dataclass

#: below this recent acceptance (accepted / proposed drafts) a request backs off
MIN_ACCEPTANCE = 0.3
#: weight of the latest verification in the recent acceptance
_EWMA_WEIGHT = 0.5
#: decode steps without drafts after a first back-off, doubled at each one in a row
_FIRST_PAUSE_STEPS = 4
_MAX_PAUSE_STEPS = 64


@dataclass
class DraftBackoff:
    """One request's back-off state; lives on its ``Request``. The scheduler asks
    :meth:`may_draft` once per step in which the request could carry drafts and calls
    :meth:`record` after each of its verifications. No tensors, no I/O."""

    #: recent acceptance; starts optimistic so that every request tries drafting
    recent_acceptance: float = 1.0
    num_paused_steps_left: int = 0
    next_pause_steps: int = _FIRST_PAUSE_STEPS
    num_pauses: int = 0

    def may_draft(self) -> bool:
        """Whether this step may carry drafts; a paused request counts one step down."""
        if self.num_paused_steps_left > 0:
            self.num_paused_steps_left -= 1
            return False
        return True

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verification of ``num_drafts`` drafts, ``num_accepted`` of them accepted."""
        if num_drafts <= 0:
            return
        self.recent_acceptance += _EWMA_WEIGHT * (num_accepted / num_drafts - self.recent_acceptance)
        if self.recent_acceptance >= MIN_ACCEPTANCE:
            self.next_pause_steps = _FIRST_PAUSE_STEPS
            return
        self.num_paused_steps_left = self.next_pause_steps
        self.next_pause_steps = min(2 * self.next_pause_steps, _MAX_PAUSE_STEPS)
        self.num_pauses += 1
        # After the pause, drafts get a fair new try: one good verification resumes them.
        self.recent_acceptance = MIN_ACCEPTANCE
