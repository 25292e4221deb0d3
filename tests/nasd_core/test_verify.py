"""Verification rules: greedy by exact cases, sampled by chi-square against the target distribution.

The sampled tests use the real model's distributions at two verified positions and show
that the same test rejects a deliberately lossy rule, so a pass means something.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from nasd_core.config import SamplingParams
from nasd_core.processors import LogitsProcessors
from nasd_core.sampling import TokenDraws, logits_to_probs, sample_tokens
from nasd_core.speculation.verify import VerifyRow, accept_prefix, verify_rows, verify_sampled

NUM_TRIALS = 6000


def test_greedy_accepts_leading_matches_then_corrects():
    assert accept_prefix([5, 6, 9, 8], [5, 6, 7]) == [5, 6, 9]  # correction at the first mismatch
    assert accept_prefix([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_prefix([4, 6, 7, 8], [5, 6, 7]) == [4]  # nothing accepted: still one token
    assert accept_prefix([3], []) == [3]  # no draft: plain decoding


def lossy_rule(probs: torch.Tensor, draft: list[int], uniforms: torch.Tensor) -> list[int]:
    """Deliberately wrong: accept d with probability p(d), else sample from p *without* removing d.

    P(emit d) = p(d) + (1 - p(d)) p(d) > p(d): biased towards the draft.
    """
    emitted: list[int] = []
    for position in range(len(draft) + 1):
        if position < len(draft) and float(uniforms[position]) < float(probs[position, draft[position]]):
            emitted.append(draft[position])
            continue
        # A fresh draw for the sample (the one above decided the acceptance).
        fresh = torch.tensor([(float(uniforms[position]) * 7919.0) % 1.0])
        emitted.append(int(sample_tokens(probs[position : position + 1], fresh)[0]))
        break
    return emitted


def target_probs(model, tokenizer) -> tuple[torch.Tensor, list[int]]:
    """Target distributions at two verified positions of a real prompt (on the model's
    device), with a plausible draft."""
    params = SamplingParams(temperature=1.0, top_k=8)
    prompt = tokenizer.encode("The three primary colors are red, yellow and", add_special_tokens=False)

    def forward(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids], device=model.device)).logits[0].float()

    with torch.inference_mode():
        first = logits_to_probs(forward(prompt)[-1:], params)[0]
        # Draft: the second most likely token, then that context's most likely token.
        d1 = int(torch.topk(first, 2).indices[1])
        logits = forward([*prompt, d1])[-2:]
        d2 = int(logits[-1].argmax())
        probs = logits_to_probs(torch.cat([logits, forward([*prompt, d1, d2])[-1:]]), params)
    return probs, [d1, d2]


@pytest.fixture(scope="module")
def two_position_probs(model, tokenizer):
    return target_probs(model, tokenizer)


def run_rule(rule, probs, draft, seed: int = 1234) -> tuple[Counter, Counter]:
    draws = TokenDraws(seed)
    first, second = Counter(), Counter()
    for trial in range(NUM_TRIALS):
        # Each trial is a request of its own: the draws of output positions 0..len(draft).
        uniforms = torch.from_numpy(TokenDraws(int(draws.uniforms(trial, 1)[0] * 2**62)).uniforms(0, 3))
        emitted = rule(probs, draft, uniforms)
        first[emitted[0]] += 1
        if emitted[0] == draft[0] and len(emitted) > 1:
            second[emitted[1]] += 1
    return first, second


def chi_square_p(counts: Counter, probs: torch.Tensor) -> float:
    support = torch.nonzero(probs).flatten().tolist()
    assert set(counts) <= set(support), "sampled a token with zero probability"
    observed = np.array([counts.get(token, 0) for token in support], dtype=float)
    expected = probs[support].double().cpu().numpy()
    expected = expected / expected.sum() * observed.sum()
    return float(chisquare(observed, expected).pvalue)


def test_sampled_rule_matches_target_distribution_at_two_positions(two_position_probs):
    probs, draft = two_position_probs
    first, second = run_rule(verify_sampled, probs, draft)
    assert chi_square_p(first, probs[0]) > 1e-3
    # Given the first draft was accepted, the next token follows the second distribution.
    assert sum(second.values()) > 500
    assert chi_square_p(second, probs[1]) > 1e-3


def test_the_same_test_rejects_a_lossy_rule(two_position_probs):
    probs, draft = two_position_probs
    first, _ = run_rule(lossy_rule, probs, draft)
    assert chi_square_p(first, probs[0]) < 1e-6


def test_the_draw_of_an_output_position_depends_only_on_the_seed_and_the_position():
    draws = TokenDraws(7).uniforms(0, 1000)
    assert np.array_equal(TokenDraws(7).uniforms(3, 4), draws[3:7])
    assert not np.array_equal(TokenDraws(8).uniforms(0, 1000), draws)
    assert draws.min() >= 0.0 and draws.max() < 1.0 and abs(draws.mean() - 0.5) < 0.05


def test_a_step_verifies_greedy_and_sampled_rows_from_one_logits_tensor(two_position_probs):
    """verify_rows gives each row what the single-row rules give it."""
    probs, draft = two_position_probs
    logits = torch.log(probs.clamp_min(1e-30))
    sampled = SamplingParams(temperature=1.0, top_k=8)
    greedy = SamplingParams()
    for seed in range(20):
        draws = TokenDraws(seed)
        rows = [VerifyRow(greedy, draws, 0), VerifyRow(sampled, draws, 5), VerifyRow(greedy, draws, 0)]
        emitted = verify_rows(torch.cat([logits, logits[:1], logits]), [draft, [], draft[:1]], rows)
        uniforms = torch.from_numpy(draws.uniforms(5, 3))
        assert emitted[0] == accept_prefix(logits.argmax(-1).tolist(), draft)
        assert emitted[1] == verify_sampled(logits_to_probs(logits[:1], sampled), [], uniforms)
        assert emitted[2] == accept_prefix(logits[:2].argmax(-1).tolist(), draft[:1])


def test_a_sampled_rows_tokens_do_not_depend_on_the_rows_beside_it():
    """Each row of a step, whatever its sampling settings and the rows sharing the step, gets
    the tokens it gets verified alone."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(14, 4096, generator=generator) * 4
    settings = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=40),
    ]
    drafts = [[5, 6], [], [1, 2, 3], [7], [8], [9]]
    starts = [0, 3, 4, 8, 10, 12]  # each row's first position: its draft and one more
    for seed in range(10):
        rows = [VerifyRow(params, TokenDraws(seed * 10 + i), i) for i, params in enumerate(settings)]
        together = verify_rows(logits, drafts, rows)
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            alone = logits[starts[i] : starts[i] + len(draft) + 1]
            assert together[i] == verify_rows(alone, [draft], [row])[0]


def test_a_draw_at_the_top_of_the_cdf_takes_the_last_token_with_mass():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.2, 0.0, 0.8, 0.0], [0.1, 0.2, 0.3, 0.4]])
    top = torch.ones(3, dtype=torch.float64)  # a target of exactly cdf[-1], past every cdf entry
    assert sample_tokens(probs, top).tolist() == [1, 2, 3]
    assert sample_tokens(probs, torch.zeros(3, dtype=torch.float64)).tolist() == [0, 0, 0]
    assert sample_tokens(probs, torch.full((3,), 0.55, dtype=torch.float64)).tolist() == [1, 2, 2]


def test_top_p_and_top_k_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.count_nonzero(probs) == 2
    full = torch.softmax(logits, dim=-1)[0]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-4))
    assert torch.nonzero(probs[0]).flatten().tolist() == [0, 1]
    assert torch.allclose(probs.sum(), torch.tensor(1.0))


def test_sampled_rows_under_penalties_keep_the_penalised_plain_distribution():
    """A sampled row with penalties: the first position follows the penalised distribution of
    the output so far, the position after an accepted draft token the distribution with that
    token counted, exactly what plain sampling would see. The same test rejects verification
    that forgets to count the draft."""
    # Small vocabulary, draft token 0 likely at both positions, so its penalty shows.
    logits = torch.tensor([[2.0, 1.6, 1.2, 0.4, 0.0], [2.2, 1.0, 1.4, 0.2, 0.6], [1.0, 0.5, 0.0, 0.3, 0.1]])
    draft = [0, 2]
    params = SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.3)
    stop_ids: list[int] = []

    def processors() -> LogitsProcessors:
        return LogitsProcessors(params, prompt_ids=[3], vocab_size=5, stop_ids=stop_ids)

    def plain_probs(position: int, output: list[int]) -> torch.Tensor:
        # Plain decoding's view: one position, the output so far observed.
        reference = processors()
        reference.observe(output)
        processed = reference.apply(logits[position : position + 1], [], len(output))
        return logits_to_probs(processed, params)[0]

    def run(count_drafts: bool) -> tuple[Counter, Counter]:
        first, second = Counter(), Counter()
        row_processors = processors()
        for trial in range(NUM_TRIALS):
            draws = TokenDraws(1000 + trial)
            if count_drafts:
                emitted = verify_rows(logits, [draft], [VerifyRow(params, draws, 0, row_processors)])[0]
            else:  # lossy: every position processed as if the drafts were not in the output
                targets = [
                    int(
                        sample_tokens(
                            logits_to_probs(row_processors.apply(logits[j : j + 1], [], 0), params),
                            torch.from_numpy(draws.uniforms(j, 1)),
                        )[0]
                    )
                    for j in range(len(draft) + 1)
                ]
                emitted = accept_prefix(targets, draft)
            first[emitted[0]] += 1
            if emitted[0] == draft[0] and len(emitted) > 1:
                second[emitted[1]] += 1
        return first, second

    first, second = run(count_drafts=True)
    assert chi_square_p(first, plain_probs(0, [])) > 1e-3
    assert sum(second.values()) > 1000
    assert chi_square_p(second, plain_probs(1, [draft[0]])) > 1e-3
    _, lossy_second = run(count_drafts=False)
    assert chi_square_p(lossy_second, plain_probs(1, [draft[0]])) < 1e-6
