"""An incremental recogniser of prefixes of a JSON object, for the tool-call parsers: where a
streamed call's arguments stand, and the text that would close them (arguments cut short are
closed after their last complete value).

`advance_text` reads characters into an immutable state (RFC 8259 grammar, top level `{...}`
after optional whitespace), so trying text never copies or undoes anything; `closing_text`
gives the shortest text that closes the object from a state.
"""

from __future__ import annotations

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
