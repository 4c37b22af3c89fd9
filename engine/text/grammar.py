"""Structured output: a sequence's tokens constrained by a grammar, through llguidance.

A request's `SamplingParams.grammar` is an llguidance grammar (from a JSON schema, a Lark
grammar or a regex), built and checked by the server at its edge. Each loaded model has one
`Grammars`: its llguidance tokenizer (built once, on first use) and its compiled grammars,
cached by content, so a schema sent again costs a copy. Each constrained sequence gets a
`GrammarConstraint`, its own copy of the compiled matcher. The cache is keyed by a digest of
the grammar's text (the text itself, up to the server's grammar budget, is not kept).

Before every sampling step `allowed_tokens` computes the masks of the step's constrained rows
together (llguidance's thread pool, outside the GIL) and the sampler draws from the masked
logits: only allowed tokens can come out, with the model's own distribution among them. A batch
without constrained rows pays nothing; unconstrained rows beside constrained ones are not
masked. A grammar that can only end allows only EOS; the engine also ends a sequence ("stop")
as soon as its grammar is complete, without waiting for that EOS. A length stop may cut the
output short of the grammar (finish_reason "length").
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from engine.protocol import InvalidRequestError

logger = logging.getLogger(__name__)

COMPILED_GRAMMARS_PER_MODEL = 256
_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()
# llguidance tokenizers (about a second to build) by the tokenizer and vocabulary they read:
# engines of one loaded model (a reload with the same folder, tests) share one.
_ll_tokenizers: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def _shared_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


class Constraint(Protocol):
    """What the engine needs of a constrained sequence (a grammar; tests script one too)."""

    @property
    def is_complete(self) -> bool: ...

    def fill_mask(self, words: np.ndarray) -> None:
        """Write the allowed next tokens into `words` (int32, bit t of word t // 32)."""

    def accept(self, token_id: int) -> None: ...


class GrammarConstraint:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    @property
    def is_complete(self) -> bool:
        return self.matcher.is_stopped()

    def fill_mask(self, words: np.ndarray) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, words[None, :], 0)

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            # Not expected (the sampler drew from the mask); the matcher then allows only
            # EOS, so the sequence ends rather than running on unconstrained.
            logger.error("grammar refused token %d: %s", token_id, self.matcher.get_error())


class Grammars:
    """One model's llguidance tokenizer and compiled grammars (thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: collections.OrderedDict[bytes, llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                with _executor_lock:
                    built = _ll_tokenizers.setdefault(self._hf_tokenizer, {})
                key = (self._vocab_size, tuple(self._eos_token_ids))
                if key not in built:
                    built[key] = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
                    )
                self._tokenizer = built[key]
            return self._tokenizer

    def constraint(self, grammar: str, *, param: str = "response_format") -> GrammarConstraint:
        """A fresh constraint for one sequence; InvalidRequestError if the grammar is refused
        (naming `param`, the body field it came from)."""
        tokenizer = self.tokenizer()
        key = hashlib.sha256(grammar.encode()).digest()
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
        if matcher is None:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise InvalidRequestError(
                    f"The grammar could not be compiled: {matcher.get_error()}", param=param
                )
            with self._lock:
                self._compiled[key] = matcher
                while len(self._compiled) > COMPILED_GRAMMARS_PER_MODEL:
                    self._compiled.popitem(last=False)
        return GrammarConstraint(matcher.deep_copy())


def allowed_tokens(constraints: Sequence[Constraint | None], vocab_size: int) -> mx.array | None:
    """The (rows, vocab) boolean mask of a step's rows, None when no row is constrained.
    Unconstrained rows allow everything."""
    rows = [(row, c) for row, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    words = np.full((len(constraints), (vocab_size + 31) // 32), -1, dtype=np.int32)
    grammar_rows = [(c.matcher, row) for row, c in rows if isinstance(c, GrammarConstraint)]
    if grammar_rows:
        llguidance.numpy.fill_next_token_bitmask_par(_shared_executor(), grammar_rows, words)
    for row, constraint in rows:
        if not isinstance(constraint, GrammarConstraint):
            constraint.fill_mask(words[row])
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return mx.array(bits.astype(np.bool_))
