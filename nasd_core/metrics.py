"""Speculation counters: tokens per step, acceptance by draft position, drafting time."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters of one request (or, merged, of a whole engine).

    ``drafted_by_position[i]`` counts steps that drafted an (i+1)-th token and
    ``accepted_by_position[i]`` those where it was accepted, so their ratio is the
    acceptance rate by draft position (it decays roughly geometrically).
    """

    num_steps: int = 0
    num_emitted: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    drafting_time_s: float = 0.0
    num_cached_prompt_tokens: int = 0  # prompt positions whose keys and values came from the prefix cache
    # Steps that ran the request's speculative path (a lookup at least), and times its draft gate
    # closed (``speculation/gate.py``): the rest of ``num_steps`` were plain steps.
    num_speculative_steps: int = 0
    num_gate_closures: int = 0

    def record_step(self, num_drafted: int, num_accepted: int, num_emitted: int, source: str | None) -> None:
        """Count one verification step (``num_emitted`` may be cut short by a stop condition)."""
        self.num_steps += 1
        self.num_emitted += num_emitted
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        _grow(self.drafted_by_position, num_drafted)
        _grow(self.accepted_by_position, num_drafted)
        for position in range(num_drafted):
            self.drafted_by_position[position] += 1
        for position in range(num_accepted):
            self.accepted_by_position[position] += 1
        if source is not None and num_drafted:
            self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + num_drafted
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + num_accepted

    def merge(self, other: SpecStats) -> None:
        """Add another request's counters into these."""
        for name in (
            "num_steps",
            "num_emitted",
            "num_drafted",
            "num_accepted",
            "prefill_time_s",
            "decode_time_s",
            "drafting_time_s",
            "num_cached_prompt_tokens",
            "num_speculative_steps",
            "num_gate_closures",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.drafted_by_position, other.drafted_by_position),
            (self.accepted_by_position, other.accepted_by_position),
        ):
            _grow(mine, len(theirs))
            for position, value in enumerate(theirs):
                mine[position] += value
        for mine_by_source, theirs_by_source in (
            (self.drafted_by_source, other.drafted_by_source),
            (self.accepted_by_source, other.accepted_by_source),
        ):
            for source, value in theirs_by_source.items():
                mine_by_source[source] = mine_by_source.get(source, 0) + value

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per target forward (acceptance length + 1 in vLLM's terms)."""
        return self.num_emitted / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [
            accepted / drafted if drafted else 0.0
            for accepted, drafted in zip(self.accepted_by_position, self.drafted_by_position)
        ]

    @property
    def drafting_share(self) -> float:
        """Share of decode time spent drafting and updating indexes."""
        return self.drafting_time_s / self.decode_time_s if self.decode_time_s else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "num_steps": self.num_steps,
            "num_emitted": self.num_emitted,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "tokens_per_step": round(self.tokens_per_step, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_by_position": [round(rate, 4) for rate in self.acceptance_by_position],
            "drafted_by_source": dict(self.drafted_by_source),
            "accepted_by_source": dict(self.accepted_by_source),
            "prefill_time_s": round(self.prefill_time_s, 6),
            "decode_time_s": round(self.decode_time_s, 6),
            "drafting_time_s": round(self.drafting_time_s, 6),
            "drafting_share": round(self.drafting_share, 6),
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "num_speculative_steps": self.num_speculative_steps,
            "num_gate_closures": self.num_gate_closures,
        }


def _grow(values: list[int], length: int) -> None:
    if len(values) < length:
        values.extend([0] * (length - len(values)))
