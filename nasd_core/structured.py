"""Structured output: a grammar constrains a request's tokens, exactly, under speculation.

A ``GrammarSpec`` (a JSON schema, a regex, a list of choices or a Lark grammar) is compiled by
llguidance for the engine's tokenizer (``Grammars``; each spec validated once and cached) into
one matcher per request (``RequestGrammar``). The matcher follows the tokens the request keeps
and gives, for any position, the mask of tokens the grammar allows next.

Exact under speculation: a step verifies ``[last token, d_1 .. d_g]``, and the logits at
position j pick the token after the output so far *plus d_1 .. d_j*; so position j is masked by
the grammar's state after those drafts (the matcher advances through the draft, one mask a
position, and is rolled back). A draft is cut before its first token the grammar forbids
(``valid_prefix``, a host-side check before the step): such a token could never be accepted.
Greedy output is then token for token that of constrained plain decoding, and a sampled row
samples the constrained distribution.

Jump-forward drafts: where the grammar allows exactly one continuation (a schema's next key, its
punctuation), the grammar itself drafts it (source ``GRAMMAR_SOURCE``), and the policy prices it
like any other source.

A step's masks are filled for all its rows in one call (``grammar_masks``), then applied to each
row's logits. Why llguidance rather than xgrammar: a schema it has not seen is ready in under a
millisecond, hundreds of times sooner than xgrammar compiles it (docs/results.md), and it
needs nothing but its wheel.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

from nasd_core.config import GrammarSpec, ReasoningSpec
from nasd_core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# Compiled grammars kept per engine (by spec), least recently used dropped first, by count and by
# the characters of their sources and grammars (a client may send large schemas).
MAX_CACHED_GRAMMARS = 256
MAX_CACHED_GRAMMAR_CHARS = 32 << 20
# JSON is written as json.dumps writes it: ", " and ": ", no other whitespace. Free whitespace
# lets a small model pad an answer with newlines, and a canonical form leaves the grammar whole
# runs of forced tokens to draft (after a name's value: ', "age":').
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The draft source name of tokens the grammar forces (``RequestGrammar.forced_tokens``).
GRAMMAR_SOURCE = "grammar"


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's per-step limits, ten times its defaults: a step masks up to 17 positions, and
    a schema of length-bounded strings hit the defaults ("ParserTooComplex") in a server run.
    Errors name no schema or state (they would land in logs)."""
    return llguidance.LLParserLimits(step_lexer_fuel=2_000_000, step_max_items=500_000, verbose_errors=False)


# Characters of a grammar builder's message an error keeps (it may quote the schema).
MAX_ERROR_CHARS = 200


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for ``spec`` (not yet checked); raises ``InvalidRequestError``
    naming ``spec.param`` for a source the builders refuse (a 400-digit integer in a schema, a
    schema nested past the parser's depth), never anything else."""
    try:
        return _grammar_text(spec)
    except (ValueError, TypeError, RecursionError) as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + "..."
        raise InvalidRequestError(f"{spec.param}: {message}", spec.param) from None


def _grammar_text(spec: GrammarSpec) -> str:
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(
                f"{spec.param}: the JSON schema is not valid JSON ({exc})", spec.param
            ) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{spec.param}: a JSON schema is an object", spec.param)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.source)
        except json.JSONDecodeError:
            choices = None
        if not isinstance(choices, list) or not all(
            isinstance(choice, str) and choice for choice in choices or [""]
        ):
            raise InvalidRequestError(
                f"{spec.param}: choices are a non-empty list of non-empty strings", spec.param
            )
        alternatives = " | ".join(json.dumps(choice) for choice in choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


def _chars(key: tuple[str, str], grammar: str) -> int:
    return len(key[1]) + len(grammar)


class Grammars:
    """The engine's grammar compiler: one llguidance tokenizer, grammars cached by spec.

    Args:
        tokenizer: the model's (fast) transformers tokenizer.
        vocab_size: the width of the model's logits (masks are this wide).
        eos_ids: the tokens that end a request; a finished grammar allows only these.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        # Computes a step's masks for all its rows at once, on its own threads.
        self.executor = llguidance.LLExecutor()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
        # By kind and source: the same schema sent through another field compiles once. Requests'
        # grammars are compiled on worker threads (``AsyncEngine``), the engine's matchers read them.
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> str:
        """``spec``'s grammar, checked; raises ``InvalidRequestError`` naming ``spec.param``.
        Thread-safe: a server compiles off the thread that runs steps."""
        key = (spec.kind, spec.source)
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        grammar = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=parser_limits())
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"{spec.param}: {error.splitlines()[0]}", spec.param)
        with self._lock:
            if key not in self._grammars:
                self._grammars[key] = grammar
                self._cached_chars += _chars(key, grammar)
            while len(self._grammars) > MAX_CACHED_GRAMMARS or self._cached_chars > MAX_CACHED_GRAMMAR_CHARS:
                dropped_key, dropped = self._grammars.popitem(last=False)
                self._cached_chars -= _chars(dropped_key, dropped)
        return grammar

    @property
    def cached_chars(self) -> int:
        return self._cached_chars

    def matcher(self, spec: GrammarSpec, reasoning: ReasoningSpec | None = None) -> RequestGrammar:
        """A new request's matcher for ``spec``, constraining what follows ``reasoning``."""
        matcher = llguidance.LLMatcher(
            self.tokenizer, self.compile(spec), log_level=0, limits=parser_limits()
        )
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.param}: {matcher.get_error().splitlines()[0]}", spec.param)
        return RequestGrammar(matcher, self.vocab_size, self.eos_ids, self.executor, reasoning)


def grammar_masks(
    rows: Sequence[tuple[RequestGrammar, int, Sequence[int]]], num_positions: int
) -> torch.Tensor:
    """The token bitmasks of a step's ``num_positions`` verified positions. For each row
    ``(grammar, first position, draft)``, position ``first + j`` gets the mask of the grammar's
    state after the kept tokens and ``draft[:j]``; all rows are filled in one call, in parallel.
    Other positions allow every token, as do those inside a row's reasoning (``ReasoningSpec``)."""
    grammar = rows[0][0]
    bitmask = llguidance.torch.allocate_token_bitmask(num_positions, grammar.vocab_size)
    jobs = []
    for row_grammar, first, draft in rows:
        answer = row_grammar.answer_start(draft)
        if answer is not None:
            jobs.append((row_grammar, first + answer, draft[answer:]))
        elif row_grammar.phase == MAYBE_REASONING:  # a draft that opens reasoning: its first position
            jobs.append((row_grammar, first, []))
    matcher_jobs = [
        (row_grammar.matcher, first, row_grammar.maskable(draft)) for row_grammar, first, draft in jobs
    ]
    with_drafts = [job for job in matcher_jobs if job[2]]
    if with_drafts:
        llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(grammar.executor, with_drafts, bitmask)
    if len(with_drafts) < len(matcher_jobs):  # llguidance takes rows without drafts apart
        plain = [(matcher, first) for matcher, first, draft in matcher_jobs if not draft]
        llguidance.torch.fill_next_token_bitmask_par(grammar.executor, plain, bitmask)
    for (row_grammar, first, draft), (_, _, maskable) in zip(jobs, matcher_jobs, strict=True):
        if len(maskable) < len(draft):
            # After a drafted end of sequence the grammar is done and allows only the end again
            # (what ignore_eos keeps): masked so, or such a row could emit what it forbids.
            bitmask[first + len(maskable) + 1 : first + len(draft) + 1] = row_grammar.end_only_mask()
    for row_grammar, first, _ in rows:
        if row_grammar.phase == MAYBE_REASONING:  # the answer's first token may open reasoning
            start = row_grammar.reasoning.start_id
            bitmask[first, start // 32] |= int(np.uint32(1 << (start % 32)).view(np.int32))
    return bitmask


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, what ``bitmask`` (one row per position of ``logits``; llguidance's
    layout, token t allowed where bit t % 32 of word t // 32 is set, tokens past its words
    forbidden) forbids. ``logits`` and ``bitmask`` have as many dimensions (a 1-D row takes a
    1-D mask); on a CPU the mask's words are contiguous, as llguidance allocates them.

    Not llguidance's kernel, which is torch.compile'd: tracing it took 2.7 s of every replica's
    start on a CPU. There NumPy unpacks the bits (11 us a row of the embedded model's vocabulary
    on a Zen 5, the compiled kernel 28 us); on a device, tensor ops do."""
    width = min(logits.shape[-1], 32 * bitmask.shape[-1])
    logits[..., width:] = float("-inf")
    if logits.is_cpu and logits.dtype == torch.float32:
        forbidden = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
        np.copyto(logits.numpy()[..., :width], -np.inf, where=forbidden.view(np.bool_)[..., :width])
        return
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1).flatten(-2)
    logits[..., :width].masked_fill_(allowed[..., :width] == 0, float("-inf"))


# A request grammar's phases with a ``ReasoningSpec``: the answer's first token may open reasoning;
# reasoning (no constraint) until its end tokens; the answer, which the grammar constrains.
MAYBE_REASONING, REASONING, ANSWER = "maybe_reasoning", "reasoning", "answer"


class RequestGrammar:
    """One request's grammar state: it follows the kept tokens and masks verification logits.

    With ``reasoning``, the grammar constrains only the answer after the reasoning: until its end
    tokens are kept, every token is allowed (and where the answer's first token may open
    reasoning, that token is allowed beside the grammar's)."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos_ids: frozenset[int],
        executor: llguidance.LLExecutor,
        reasoning: ReasoningSpec | None = None,
    ) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.executor = executor
        self.reasoning = reasoning
        if reasoning is None:
            self.phase = ANSWER
        elif reasoning.open:
            self.phase = REASONING
        else:
            self.phase = MAYBE_REASONING if reasoning.start_id is not None else ANSWER
        self._kept_tail: list[int] = []  # the last kept tokens, as long as a partial end marker

    def answer_start(self, draft: Sequence[int]) -> int | None:
        """Where in ``draft`` the answer the grammar constrains starts (None: not in it). A draft
        that opens reasoning ends there (``valid_prefix``), so reasoning is never opened and
        closed within one draft."""
        if self.phase == ANSWER:
            return 0
        if self.phase == MAYBE_REASONING:
            return None if draft and draft[0] == self.reasoning.start_id else 0
        end = self.reasoning.end_ids
        tokens = self._kept_tail + list(draft)
        for index in range(len(tokens) - len(end) + 1):
            if tokens[index : index + len(end)] == end:
                return index + len(end) - len(self._kept_tail)
        return None

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many of ``draft``'s first tokens the grammar allows after the kept tokens."""
        if not draft:
            return 0
        if self.phase == MAYBE_REASONING and draft[0] == self.reasoning.start_id:
            return 1
        answer = self.answer_start(draft)
        if answer is None:
            return len(draft)
        rest = list(draft[answer:])
        return answer + (self.matcher.validate_tokens(rest) if rest else 0)

    def end_only_mask(self) -> torch.Tensor:
        """The bitmask row (llguidance's: bit t of 32-bit word t // 32) that allows only the
        end-of-sequence tokens."""
        words = np.zeros(-(-self.vocab_size // 32), dtype=np.uint32)
        for token in self.eos_ids:
            words[token // 32] |= np.uint32(1 << (token % 32))
        return torch.from_numpy(words.view(np.int32))

    def maskable(self, draft: Sequence[int]) -> list[int]:
        """The drafts whose following positions the grammar's state masks: those before the first
        end of sequence (a matcher stopped by it cannot roll back; the positions after it are
        masked to the end alone, ``grammar_masks``)."""
        end = next((index for index, token in enumerate(draft) if token in self.eos_ids), len(draft))
        return list(draft[:end])

    def mask(self, logits: torch.Tensor, draft: Sequence[int]) -> None:
        """Set to -inf, in place, what the grammar forbids at each of the ``len(draft) + 1``
        positions of ``logits`` (position j: after the kept tokens and ``draft[:j]``); a step
        masks all its rows at once with ``grammar_masks``."""
        apply_masks(logits, grammar_masks([(self, 0, draft)], logits.shape[0]))

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (a schema's keys and
        punctuation): drafts that are always accepted. None before the answer."""
        return self.matcher.compute_ff_tokens() if self.phase == ANSWER else []

    def observe(self, tokens: Sequence[int]) -> None:
        """The request kept ``tokens`` (past the grammar's end, end-of-sequence tokens that
        ``ignore_eos`` keeps are all it can allow, and it takes no more). A matcher that failed
        (a parser limit) allows only the end of sequence: the request ends there, its error
        logged, and the other requests of the step go on."""
        tokens = list(tokens)
        if tokens and self.phase != ANSWER:
            tokens = self._past_reasoning(tokens)
        if not tokens or self.matcher.is_stopped() or self.matcher.is_error():
            return
        if not self.matcher.consume_tokens(tokens):
            logger.warning(
                "a request's grammar failed and ended it: %s", self.matcher.get_error().splitlines()[0]
            )

    def _past_reasoning(self, tokens: list[int]) -> list[int]:
        """Move through the reasoning with the kept ``tokens``; those of the answer after it."""
        if self.phase == MAYBE_REASONING:
            if tokens[0] != self.reasoning.start_id:
                self.phase = ANSWER
                return tokens
            self.phase, tokens = REASONING, tokens[1:]
        answer = self.answer_start(tokens)
        if answer is None:
            keep = len(self.reasoning.end_ids) - 1
            self._kept_tail = (self._kept_tail + tokens)[-keep:] if keep else []
            return []
        self.phase, self._kept_tail = ANSWER, []
        return tokens[answer:]
