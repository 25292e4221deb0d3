"""A request's draft gate: it drafts only while its drafts pay for themselves in wall time.

The batch policy prices drafts with a model of step costs; the gate checks the result. Over each
window of ``GATE_WINDOW`` drafted steps (or ``LOOKUP_WINDOW`` steps with a lookup, drafted or
not, or ``IDLE_LOOKUPS`` lookups of which none drafted), it weighs the tokens the request's drafts
added against what its lookups and drafts cost the batch, read off the clock (``row_costs``). A
window that did not pay closes the gate, and so does one that has already lost ``LOSS_BUDGET``
tokens before it ends: the request then runs plain steps, skipping its lookups and its pricing
altogether, for 4, 8, 16, ... steps (exponential back-off), and tests again, in a window
``RETEST_SHARE`` of the first in every measure (drafted steps, lookups, budget). A window that paid
resets the back-off and the window.

What a request can lose is therefore bounded by its windows' budgets, and a request whose drafts
never pay spends ever fewer of its steps finding that out: one window, then re-tests a quarter
as long at back-offs that double.

A request's first window is its largest cost where drafts do not pay, and its verdict is what
the engine's recent requests' first verdicts mostly were: where most of those failed
(``GateHistory``), a new request's first window is a re-test's too. Where drafts pay, first
windows pay and stay whole.

Why a gate as well as the policy: the policy's estimates are only as good as its step-time model
on this host, and a request whose drafts never land (free-form text, sampled answers) still paid
each step's lookup and pricing; read in wall time, a miss is a miss whatever the model believed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A verdict comes after this many drafted steps: enough for a copied span to show, few enough that
# a request of 64-128 tokens whose drafts miss loses at most a few steps' overhead...
GATE_WINDOW = 8
# ...or after this many steps with the speculative path, drafted or not: lookups that rarely lead
# to a draft are judged too, on what they found against what all of them cost.
LOOKUP_WINDOW = 32
# ...or, failed, after this many lookups none of which led to a draft: such lookups gain nothing
# and cost host work every step (adversarial text at eight rows looked up in 29% of its steps).
IDLE_LOOKUPS = 8
# A window ends early, failed, once its cost passes its gain by this many tokens of plain
# decoding (a whole window of misses at eight rows could lose several).
LOSS_BUDGET = 1.0
# A re-test after a closure is this share of a window (drafted steps, lookups and budget): the
# request's prior is then that its drafts do not pay, and a copied span shows in a few steps.
RETEST_SHARE = 0.25
FIRST_BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 256
# Moving-average weight of each new first verdict in ``GateHistory``: a few requests in a row
# whose first windows failed make the next ones start with a re-test's window.
HISTORY_WEIGHT = 0.25


@dataclass
class GateHistory:
    """The first verdicts of an engine's recent requests' gates (``Calibration.gate_history``)."""

    paid_share: float = 1.0  # moving average of first windows that paid (1: trust a new request)
    num_verdicts: int = 0

    def record(self, paid: bool) -> None:
        self.paid_share += HISTORY_WEIGHT * (paid - self.paid_share)
        self.num_verdicts += 1

    def new_gate(self) -> DraftGate:
        """A new request's gate: its first window a re-test's where most recent ones failed."""
        return DraftGate(history=self, first_share=RETEST_SHARE if self.paid_share < 0.5 else 1.0)


@dataclass
class DraftGate:
    """One request's verdicts: open while its drafts pay, else closed for a back-off of plain steps."""

    num_failures: int = 0  # windows in a row whose drafts did not pay
    plain_steps_left: int = 0  # plain steps before the next test
    num_closures: int = 0  # times the gate closed over the request's life
    window_steps: int = 0  # steps with the speculative path
    window_drafted: int = 0  # of which drafted
    window_gain: float = 0.0  # tokens the drafts added (accepted drafts)
    window_cost: float = 0.0  # what they cost the batch, in tokens of plain decoding
    # Where the first verdict is recorded (None: nowhere), and the first window's share of a whole one.
    history: GateHistory | None = None
    first_share: float = 1.0
    num_verdicts: int = 0

    @property
    def is_open(self) -> bool:
        return self.plain_steps_left == 0

    @property
    def window_share(self) -> float:
        """This window's share of a whole one: a re-test's after a failure; the first as its
        history set it (``GateHistory.new_gate``)."""
        if self.num_failures:
            return RETEST_SHARE
        return 1.0 if self.num_verdicts else self.first_share

    def skip(self) -> None:
        """One plain step of the back-off went by."""
        self.plain_steps_left = max(0, self.plain_steps_left - 1)

    def record(self, drafted: bool, gain: float, cost: float) -> None:
        """One step with the request's speculative path, which ``drafted`` or only looked up: its
        drafts added ``gain`` tokens and it cost the batch ``cost`` tokens' worth of plain
        decoding (``row_costs``)."""
        self.window_steps += 1
        self.window_drafted += drafted
        self.window_gain += gain
        self.window_cost += cost
        share = self.window_share
        lookups = LOOKUP_WINDOW if self.window_drafted else IDLE_LOOKUPS
        ended = self.window_drafted >= share * GATE_WINDOW or self.window_steps >= share * lookups
        if not ended and self.window_cost - self.window_gain < share * LOSS_BUDGET:
            return
        paid = ended and self.window_gain > self.window_cost
        if self.history is not None and not self.num_verdicts:
            self.history.record(paid)
        self.num_verdicts += 1
        if paid:
            self.num_failures = 0
        else:
            self.num_failures += 1
            self.num_closures += 1
            backoff = FIRST_BACKOFF_STEPS << min(self.num_failures - 1, 16)
            self.plain_steps_left = min(backoff, MAX_BACKOFF_STEPS)
        self.window_steps, self.window_drafted, self.window_gain, self.window_cost = 0, 0, 0.0, 0.0


def row_costs(
    cost_ratio: float, lookup_share: float, looked_up: Sequence[bool], num_drafted: Sequence[int]
) -> list[float]:
    """What each row's speculative path cost a step of ``len(looked_up)`` rows, in tokens of plain
    decoding: the step took ``cost_ratio`` plain steps, ``lookup_share`` of a plain step of it
    spent finding and building drafts (split among the rows that ``looked_up``), the rest of the
    excess, which noise can make negative, on the draft positions (split by each row's
    ``num_drafted``). Every row waits for the whole step, so an excess of x plain steps costs the
    batch x tokens per row."""
    num_rows = len(looked_up)
    # Unclipped: a step read under a plain one is the clock's noise, which must average out.
    lookup = max(0.0, lookup_share)
    positions = cost_ratio - 1.0 - lookup
    num_looked_up = sum(looked_up)
    total_drafted = sum(num_drafted)
    costs = []
    for looks, drafted in zip(looked_up, num_drafted, strict=True):
        cost = lookup / num_looked_up if looks and num_looked_up else 0.0
        if total_drafted:
            cost += positions * drafted / total_drafted
        costs.append(num_rows * cost)
    return costs
