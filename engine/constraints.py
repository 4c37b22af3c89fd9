"""JSON mode: constrain a sequence's output to one syntactically valid JSON object.

`JsonPrefix` is an incremental, character-level recogniser of prefixes of a JSON object
(RFC 8259 grammar, top level `{...}` after optional whitespace). Its states are immutable
tuples, so trying a candidate token costs only the characters of that token and never copies
or undoes anything.

`JsonConstraint` applies it to one sequence's tokens. Sampling stays unconstrained and fully
batched on the device; after the batch's tokens reach the host, each json-mode row's token is
checked here, and only a row whose token is invalid pays for ranking its top candidates
(engine/runner.py). When the tokens left under max_tokens only just suffice to close the object,
the constraint forces the shortest completion; the engine ends the sequence ("stop") as soon as
the object closes, so no EOS token is needed.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable

_WHITESPACE = " \t\n\r"
# Longest run of whitespace between tokens of the object: a newline and an indentation
# (llama.cpp's JSON grammar allows a newline and 20 more).
MAX_WHITESPACE_RUN = 24
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrt'
_DIGITS = "0123456789"

# Modes. Every state is (mode, stack, aux); stack holds the open containers ("{" / "["), aux is
# mode-specific (string: is-key; escape \u: (is-key, hex digits left); number: its part;
# literal: the letters still expected; structural modes: length of the whitespace run).
START, OBJECT_OPEN, OBJECT_KEY, COLON, VALUE, ARRAY_OPEN, AFTER_VALUE = range(7)
STRING, ESCAPE, UNICODE, NUMBER, LITERAL, DONE = range(7, 13)

# Number parts: the ones a number may end in are complete.
_MINUS, _ZERO, _INT, _DOT, _FRAC, _EXP, _EXP_SIGN, _EXP_DIGITS = range(8)
_COMPLETE_NUMBER = frozenset({_ZERO, _INT, _FRAC, _EXP_DIGITS})
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}

State = tuple[int, str, object]
INITIAL: State = (START, "", None)


def _closers(stack: str) -> str:
    return "".join("}" if c == "{" else "]" for c in reversed(stack))


def _value_start(stack: str, ch: str) -> State | None:
    if ch == '"':
        return (STRING, stack, False)
    if ch == "{":
        return (OBJECT_OPEN, stack + "{", None)
    if ch == "[":
        return (ARRAY_OPEN, stack + "[", None)
    if ch == "-":
        return (NUMBER, stack, _MINUS)
    if ch == "0":
        return (NUMBER, stack, _ZERO)
    if ch in _DIGITS:
        return (NUMBER, stack, _INT)
    if ch in _LITERALS:
        return (LITERAL, stack, _LITERALS[ch])
    return None


def _close(stack: str, ch: str) -> State | None:
    if not stack or ch != ("}" if stack[-1] == "{" else "]"):
        return None
    rest = stack[:-1]
    return (AFTER_VALUE, rest, None) if rest else (DONE, "", None)


def _number(stack: str, part: int, ch: str) -> State | None:
    if ch in _DIGITS:
        if part in (_MINUS, _INT):
            return (NUMBER, stack, _ZERO if part == _MINUS and ch == "0" else _INT)
        if part in (_DOT, _FRAC):
            return (NUMBER, stack, _FRAC)
        if part in (_EXP, _EXP_SIGN, _EXP_DIGITS):
            return (NUMBER, stack, _EXP_DIGITS)
        return None  # a leading zero takes no more digits
    if ch == "." and part in (_ZERO, _INT):
        return (NUMBER, stack, _DOT)
    if ch in "eE" and part in (_ZERO, _INT, _FRAC):
        return (NUMBER, stack, _EXP)
    if ch in "+-" and part == _EXP:
        return (NUMBER, stack, _EXP_SIGN)
    if part in _COMPLETE_NUMBER:
        # The number ended; the character belongs to what follows it.
        return advance((AFTER_VALUE, stack, None), ch)
    return None


def advance(state: State, ch: str) -> State | None:
    """The state after one more character, or None when no JSON object starts this way."""
    mode, stack, aux = state
    if mode == STRING:
        if ch == '"':
            return (COLON, stack, None) if aux else (AFTER_VALUE, stack, None)
        if ch == "\\":
            return (ESCAPE, stack, aux)
        return None if ch < " " else state
    if mode == ESCAPE:
        if ch == "u":
            return (UNICODE, stack, (aux, 4))
        return (STRING, stack, aux) if ch in _ESCAPES else None
    if mode == UNICODE:
        is_key, left = aux
        if ch not in _HEX:
            return None
        return (STRING, stack, is_key) if left == 1 else (UNICODE, stack, (is_key, left - 1))
    if mode == NUMBER:
        return _number(stack, aux, ch)
    if mode == LITERAL:
        if ch != aux[0]:
            return None
        return (LITERAL, stack, aux[1:]) if len(aux) > 1 else (AFTER_VALUE, stack, None)
    if ch in _WHITESPACE:
        # Structural states keep their whitespace run length in aux. Bounding it keeps a model
        # from filling the whole budget with blanks, which JSON allows and weak models love.
        run = (aux or 0) + 1
        return (mode, stack, run) if mode != DONE and run <= MAX_WHITESPACE_RUN else None
    if mode == START:
        return (OBJECT_OPEN, "{", None) if ch == "{" else None
    if mode == OBJECT_OPEN:
        return (STRING, stack, True) if ch == '"' else _close(stack, ch)
    if mode == OBJECT_KEY:
        return (STRING, stack, True) if ch == '"' else None
    if mode == COLON:
        return (VALUE, stack, None) if ch == ":" else None
    if mode == VALUE:
        return _value_start(stack, ch)
    if mode == ARRAY_OPEN:
        return _value_start(stack, ch) or _close(stack, ch)
    if mode == AFTER_VALUE:
        if ch == ",":
            return (OBJECT_KEY if stack[-1] == "{" else VALUE, stack, None)
        return _close(stack, ch)
    return None  # DONE: nothing may follow the object


def advance_text(state: State, text: str) -> State | None:
    for ch in text:
        state = advance(state, ch)
        if state is None:
            return None
    return state


def closing_text(state: State) -> str:
    """The shortest text that completes the object from `state`.

    Each of its prefixes leads to a state whose closing text is the rest of it, so forcing its
    first token again and again closes the object.
    """
    mode, stack, aux = state
    if mode == STRING:
        return ('":0' if aux else '"') + _closers(stack)
    if mode == ESCAPE:
        return "n" + closing_text((STRING, stack, aux))
    if mode == UNICODE:
        return "0" * aux[1] + closing_text((STRING, stack, aux[0]))
    if mode == NUMBER:
        return _closers(stack) if aux in _COMPLETE_NUMBER else "0" + _closers(stack)
    if mode == LITERAL:
        return aux + _closers(stack)
    prefix = {START: "{}", OBJECT_KEY: '"":0', COLON: ":0", VALUE: "0"}.get(mode, "")
    return prefix + _closers(stack)


class JsonConstraint:
    """One sequence's JSON-object constraint over token ids.

    `token_bytes(id)` gives a token's bytes exactly as the detokenizer decodes them; `banned`
    are ids that add no text (special tokens, EOS, stop ids) and so are never valid.
    `encode(text)` tokenizes the closing text when the object must be closed.
    """

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        encode: Callable[[str], list[int]],
        banned: Iterable[int],
    ) -> None:
        self._token_bytes = token_bytes
        self._encode = encode
        self._banned = frozenset(banned)
        self._state = INITIAL
        self._pending = b""  # bytes of a character split across tokens

    @property
    def is_complete(self) -> bool:
        return self._state[0] == DONE

    def _after(self, token_id: int) -> tuple[State, bytes] | None:
        if token_id in self._banned:
            return None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = decoder.decode(self._pending + self._token_bytes(token_id))
        state = advance_text(self._state, text)
        pending = decoder.getstate()[0]
        # Half a character can only be valid inside a string.
        if state is None or (pending and state[0] != STRING):
            return None
        return state, pending

    def allows(self, token_id: int) -> bool:
        return self._after(token_id) is not None

    def forced_token(self, num_tokens_left: int) -> int | None:
        """The token that must come next to close the object in time, if it comes to that.

        A token covers at least one character, so closing never needs more tokens than its
        text has characters; start closing when that many are left. (Bytes of a split
        character still pending then decode as U+FFFD, which a string may hold.)
        """
        closing = closing_text(self._state)
        if len(closing) < num_tokens_left:
            return None
        return self._encode(closing)[0]

    def accept(self, token_id: int) -> None:
        after = self._after(token_id)
        assert after is not None, "accept only tokens the constraint allows"
        self._state, self._pending = after
