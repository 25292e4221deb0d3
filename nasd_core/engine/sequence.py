"""One request's state inside the engine: tokens, stop checker, drafter, draws, counters."""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from nasd_core.config import SamplingParams, SpecConfig
from nasd_core.engine.stopping import FinishReason, StopChecker
from nasd_core.logprobs import TokenLogprob
from nasd_core.metrics import SpecStats
from nasd_core.processors import LogitsProcessors
from nasd_core.sampling import TokenDraws
from nasd_core.speculation.acceptance import AcceptanceEstimator
from nasd_core.speculation.drafter import Draft, RequestDrafter
from nasd_core.speculation.gate import DraftGate
from nasd_core.speculation.pace import INITIAL_PACE_CREDIT, INITIAL_PREFILL_PACE_CREDIT, pace_credit
from nasd_core.speculation.policy import RowDraft
from nasd_core.speculation.verify import VerifyRow


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request from admission to its last token.

    ``tokens`` is the prompt followed by the output; its last token is the one the next
    verification step feeds (the model has keys and values for all the others).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecConfig
    stopper: StopChecker
    drafter: RequestDrafter
    draws: TokenDraws
    on_tokens: Callable[[Request, list[int]], None] | None = None
    processors: LogitsProcessors | None = None
    # Each kept token's log-probability, when the request asked for them (else None).
    logprobs: list[TokenLogprob] | None = None
    # With prompt_logprobs: None for the first prompt token, then each one's logprob.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Another choice of the same prompt whose prefill this one copies (Engine.add_request).
    prefill_source: Request | None = None
    # Prefix-cache entries are shared only among requests of the same salt (a tenant).
    prefix_salt: Hashable = None
    status: RequestStatus = RequestStatus.WAITING
    tokens: list[int] = field(default_factory=list)
    acceptance: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)
    stats: SpecStats = field(default_factory=SpecStats)
    num_prefilled: int = 0
    # Whether its drafts pay, read off the clock; closed, it runs plain steps (``gate.DraftGate``).
    gate: DraftGate = field(default_factory=DraftGate)
    # How far the request is ahead of its pace floor, in plain steps (``pace.pace_credit``):
    # the batch's drafts may not slow it below ``pace.MIN_ROW_PACE`` of plain decoding.
    pace_credit: float = INITIAL_PACE_CREDIT
    # The same for its prompt's chunks, each one plain step of progress (``pace.prefill_floor``).
    prefill_pace_credit: float = INITIAL_PREFILL_PACE_CREDIT
    cancelled: bool = False
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def num_output(self) -> int:
        """Tokens generated so far (= the output position the next step samples first)."""
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.stopper.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def finish_reason(self) -> str | None:
        return "cancelled" if self.cancelled else self.stopper.finish_reason

    @property
    def draft_cap(self) -> int:
        """Most tokens this step may draft: the spec's cap, never past ``max_tokens`` (the
        step's own token always comes on top), none when the request does not speculate."""
        if not self.spec.is_speculating:
            return 0
        return max(0, min(self.spec.num_draft_tokens, self.stopper.num_remaining - 1))

    @property
    def looks_up(self) -> bool:
        """Whether this step runs the row's speculative path (not while its gate is closed, nor
        when it may draft nothing)."""
        return self.gate.is_open and self.draft_cap > 0

    def best_case(self, match: tuple[int, str | None] = (0, None)) -> RowDraft:
        """What the batch policy would see if this step's draft were as long and as well
        matched as it can be, given the drafter's ``longest_match`` (asked only where
        ``looks_up``: no draft is built); nothing while its gate is closed."""
        if not self.gate.is_open:
            return RowDraft("off", 0, 0, self.acceptance, pace_credit=self.pace_credit)
        match_length, source = match
        # Without a match there is no draft, unless unknown contexts are filled with guesses.
        available = self.draft_cap if match_length or not self.spec.stop_if_unknown else 0
        return RowDraft(
            self.mode, available, match_length, self.acceptance, source, pace_credit=self.pace_credit
        )

    @property
    def mode(self) -> str:
        """The speculation mode this request runs in ("off" when it cannot speculate)."""
        return self.spec.mode if self.spec.is_speculating else "off"

    def row_draft(self, draft: Draft) -> RowDraft:
        """What the batch policy knows about this row given this step's ``draft``."""
        return RowDraft(
            self.mode,
            len(draft.tokens),
            draft.match_length,
            self.acceptance,
            draft.source,
            draft.splits,
            pace_credit=self.pace_credit,
        )

    def learn_acceptance(self, draft: Draft, num_drafted: int, num_emitted: int) -> None:
        """Count how much of the verified draft was accepted (the engine defers this to the
        step's tail: the next step's plan may read acceptance one step old)."""
        self.acceptance.record(draft.match_length, num_drafted, num_emitted - 1, draft.source, draft.splits)

    def charge(self, num_drafted: int, num_emitted: int, cost_ratio: float, gate_cost: float | None) -> None:
        """The step that verified ``num_drafted`` of the row's drafts and emitted ``num_emitted`` of
        its tokens took ``cost_ratio`` plain steps: the pace credit follows, and, for an ``auto``
        row, the gate (``gate_cost``: what its speculative path cost the batch, ``gate.row_costs``;
        None when the step ran none of it for this row)."""
        self.pace_credit = pace_credit(self.pace_credit, num_emitted, cost_ratio)
        if self.mode != "auto":  # "on" drafts whatever its odds
            return
        if gate_cost is None:
            self.gate.skip()
            return
        self.stats.num_speculative_steps += 1
        was_open = self.gate.is_open
        self.gate.record(num_drafted > 0, num_emitted - 1, gate_cost)
        self.stats.num_gate_closures += was_open and not self.gate.is_open

    def verify_row(self) -> VerifyRow:
        """What verification needs of this row this step."""
        return VerifyRow(self.params, self.draws, self.num_output, self.processors)

    def prefilled_chunk(self, cost_ratio: float) -> None:
        """One of its prompt's chunks went in, in a step ``cost_ratio`` times as dear as without
        its drafts: one plain step of the prompt's progress (``pace.prefill_floor``)."""
        self.prefill_pace_credit = pace_credit(self.prefill_pace_credit, 1, cost_ratio)

    def advance(self, draft: Draft, num_drafted: int, emitted: list[int]) -> list[int]:
        """Take one verified step: ``num_drafted`` tokens of ``draft`` were verified and
        ``emitted`` came out. Updates the output and counters (the drafter learns the new tokens
        when it next looks up, the acceptance in ``learn_acceptance``, the pace and the gate in
        ``charge``); returns the tokens actually kept (a stop condition can cut the step short)."""
        num_accepted = len(emitted) - 1
        num_taken = self.stopper.extend(emitted)
        kept = emitted[:num_taken]
        self.tokens.extend(kept)
        if self.processors is not None:
            self.processors.observe(kept)
        self.stats.record_step(num_drafted, num_accepted, num_taken, draft.source if num_drafted else None)
        return kept


@dataclass
class GenerationResult:
    """What one request produced.

    Attributes:
        token_ids: generated ids (a final end-of-sequence id included, as transformers does).
        text: decoded output, special tokens removed, cut before any stop string.
        finish_reason: "stop" (eos, stop id or stop string) or "length" (max_tokens).
        prompt_ids: the prompt as token ids.
        stats: speculation counters of this request.
        logprobs: each token's log-probability and top alternatives (when asked for).
        prompt_logprobs: the same for the prompt (None for its first token), when asked for.
    """

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_ids: list[int]
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
