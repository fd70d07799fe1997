"""The outcome of one model-runner step as plain data: sampled tokens, accepted drafts,
the connector's load failures and its worker side's report.

A module of its own so that the model runner (which makes it), the step future (which
completes it) and the batch queue and pipeline executor (which read it) import it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.base import WorkerReport


@dataclass
class RunnerOutput:
    """What one model-runner step produced, for the engine core and the scheduler.
    ``request_id_to_token`` is complete only once the step's ``StepFuture.result()``
    returned (it fills it from the sampled ids)."""

    request_id_to_token: dict[str, int]
    #: request id -> its drafts the rejection sampler accepted (requests that had drafts)
    request_id_to_accepted_draft_ids: dict[str, list[int]]
    #: request id -> leading tokens truly in the paged cache (connector load failures)
    load_failures: dict[str, int]
    num_computed_tokens: int
    #: what the connector's worker side did this step (None: no connector): the engine core
    #: hands it to the scheduler side (``update_connector_output``) before updating the
    #: scheduler, which tells it the requests done sending and those whose fetch progressed
    connector_report: WorkerReport | None = None
