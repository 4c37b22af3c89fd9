"""Streaming detokenization with stop strings, one token at a time.

`StreamDetokenizer.add` returns only text that is final: never half a UTF-8 character (byte-level
BPE tokens split multi-byte characters) and never a tail that could still grow into a stop
string. The concatenation of everything emitted equals `tokenizer.decode(ids)` cut at the first
stop string.

Byte-level BPE tokenizers (GPT-2 style: Qwen, Llama 3, gpt-oss, ...) are decoded from each token's
bytes through an incremental UTF-8 decoder, which is exact and O(1) per token. Other tokenizers
(SentencePiece, ...) fall back to decoding a short window of recent tokens, as vLLM does.
"""

from __future__ import annotations

import codecs
import functools
import re
import weakref
from collections.abc import Sequence
from typing import Any

from tokenizers import decoders

_TOKEN_INFO: weakref.WeakKeyDictionary[Any, _TokenizerInfo] = weakref.WeakKeyDictionary()


@functools.cache
def unicode_to_byte() -> dict[str, int]:
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are shifted
    # to code points 256+ in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in mapping.values())
    mapping.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return mapping


class _TokenizerInfo:
    """What detokenizing needs from one tokenizer, computed once and shared by all streams."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        probe = hf_tokenizer.encode("a ,b", add_special_tokens=False)
        cleans_spaces = hf_tokenizer.decode(probe) != "a ,b"
        self.byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel) and (
            not cleans_spaces
        )
        # Ask decode itself which added tokens skip_special_tokens drops, rather than trusting
        # one of the several "special" lists tokenizers carry.
        self.skipped_ids = frozenset(
            token_id
            for token_id in getattr(hf_tokenizer, "added_tokens_decoder", {})
            if hf_tokenizer.decode([token_id], skip_special_tokens=True) == ""
        )
        self._bytes: dict[int, bytes] = {}
        self._added: dict[str, int] | None = None

    def token_id(self, token: str) -> int | None:
        """The id of an added token given by its text (None if the tokenizer has no such one)."""
        if self._added is None:
            decoder = getattr(self.hf, "added_tokens_decoder", {})
            self._added = {str(added): token_id for token_id, added in decoder.items()}
        return self._added.get(token)

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            table = unicode_to_byte()
            token = self.hf.convert_ids_to_tokens(token_id) or ""
            # Characters outside the alphabet (added tokens' content) decode as themselves,
            # as the tokenizers ByteLevel decoder does.
            cached = b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in token)
            self._bytes[token_id] = cached
        return cached

    def piece_bytes(self, token_id: int) -> bytes:
        # Not byte-level (SentencePiece, ...): byte-fallback pieces are one byte; others decode
        # alone, keeping the word-start space that decoding a lone piece drops.
        cached = self._bytes.get(token_id)
        if cached is None:
            piece = self.hf.convert_ids_to_tokens(token_id) or ""
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                cached = bytes([int(piece[3:5], 16)])
            else:
                text = self.hf.decode([token_id], skip_special_tokens=False)
                if piece.startswith("\u2581") and not text.startswith(" "):
                    text = " " + text
                cached = text.encode("utf-8")
            self._bytes[token_id] = cached
        return cached


def _info(tokenizer: Any) -> _TokenizerInfo:
    # Imported here: mlx-lm imports MLX, and a web process that only parses replies (its
    # engines in other processes) never needs it.
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    info = _TOKEN_INFO.get(hf)
    if info is None:
        info = _TOKEN_INFO[hf] = _TokenizerInfo(hf)
    return info


def token_text(tokenizer: Any, token_id: int) -> str:
    """The raw text of one token, for logprobs.

    Byte-level tokens that are not valid UTF-8 on their own (part of a multi-byte character)
    come back as "bytes:" plus escaped bytes, e.g. "bytes:\\xe6\\x97", the form OpenAI's API
    uses. Special tokens come back as their text ("<|im_end|>"). Tokenizers that are not
    byte-level give what `decode([token_id])` gives.
    """
    info = _info(tokenizer)
    if not info.byte_level:
        return info.hf.decode([token_id], skip_special_tokens=False)
    raw = info.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """One token's bytes as streaming decodes them: exact for byte-level BPE; for other
    tokenizers the piece decoded alone, which can differ from in-context decoding in spacing."""
    info = _info(tokenizer)
    return info.token_bytes(token_id) if info.byte_level else info.piece_bytes(token_id)


def skipped_token_ids(tokenizer: Any) -> frozenset[int]:
    """The special tokens that decoding drops (they add no text to a completion)."""
    return _info(tokenizer).skipped_ids


class _ByteLevelDecoder:
    def __init__(
        self, info: _TokenizerInfo, skip_special_tokens: bool, keep: frozenset[int]
    ) -> None:
        self._info = info
        self._skipped = (info.skipped_ids - keep) if skip_special_tokens else frozenset()
        # Holds the bytes of an incomplete character; invalid bytes become U+FFFD, as in decode.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if token_id in self._skipped:
            return ""
        return self._utf8.decode(self._info.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _WindowDecoder:
    """Decodes recent tokens with the tokenizer itself: the text added by the newest tokens is
    decode(window) minus decode(window without them), emitted once it is not a partial char."""

    def __init__(
        self, info: _TokenizerInfo, skip_special_tokens: bool, keep: frozenset[int]
    ) -> None:
        self._hf = info.hf
        self._skip = skip_special_tokens
        self._skipped = info.skipped_ids - keep if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._read_offset = 0  # ids before this are emitted; the window starts one step earlier

    def _new_text(self) -> str:
        # Skipped tokens are left out here (not by decode), so that kept ones stay.
        ids = [t for t in self._ids if t not in self._skipped]
        cut = sum(1 for t in self._ids[: self._read_offset] if t not in self._skipped)
        prefix = self._hf.decode(ids[:cut], skip_special_tokens=False)
        full = self._hf.decode(ids, skip_special_tokens=False)
        return full[len(prefix) :]

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._new_text()
        if not text or text.endswith("\ufffd"):
            return ""
        # Keep the last emitted step as context, so spacing rules see the previous token.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return text

    def flush(self) -> str:
        text = self._new_text()
        self._ids.clear()
        self._read_offset = 0
        return text


class StreamDetokenizer:
    """Turns generated token ids into text that is safe to stream, honouring stop strings.

    `tokenizer` is what the engine loader returns (mlx-lm's TokenizerWrapper) or a Hugging Face
    tokenizer. After a stop string matches, `stopped` is True, the stop string and everything
    after it are dropped, and further tokens add nothing.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        keep: Sequence[str] = (),
    ) -> None:
        """`keep`: special tokens (by text) that stay in the text when others are skipped."""
        info = _info(tokenizer)
        decoder_class = _ByteLevelDecoder if info.byte_level else _WindowDecoder
        kept = frozenset(info.token_id(token) for token in keep) - {None}
        self._decoder = decoder_class(info, skip_special_tokens, kept)
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text not yet emitted: a possible start of a stop string
        self.text = ""
        self.stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the text

    def add(self, token_id: int, *, match_stop: bool = True) -> str:
        """Feed one token; return the newly final text (possibly empty).

        With `match_stop` False (before min_tokens) stop strings are neither matched nor held
        back, so text completed then can no longer end the stream (vLLM does the same).
        """
        if self.stopped:
            return ""
        return self._emit(self._decoder.add(token_id), final=not match_stop, match=match_stop)

    def flush(self) -> str:
        """Return the text still held back; call once after the last token."""
        if self.stopped:
            return ""
        return self._emit(self._decoder.flush(), final=True)

    def _emit(self, new_text: str, *, final: bool, match: bool = True) -> str:
        held = self._held + new_text
        stops = self._stop if match else ()
        found = [(at, s) for s in stops if (at := held.find(s)) >= 0]
        match_at = min(found)[0] if found else -1
        if match_at >= 0:
            self.stopped = True
            self.matched_stop = min(found)[1]
            out, self._held = held[:match_at], ""
        else:
            keep = 0 if final else self._partial_stop_length(held)
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self.text += out
        return out

    def _partial_stop_length(self, text: str) -> int:
        # The longest tail of text that is a proper prefix of some stop string. Held text never
        # contains a whole stop string, so it stays shorter than the longest one.
        for length in range(min(len(text), max(map(len, self._stop), default=1) - 1), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
