"""harmony: gpt-oss replies in OpenAI's harmony format, parsed by `openai-harmony` from the
token ids. Channel `analysis` is reasoning, `final` is content, a message addressed
`to=functions.NAME` is a call of NAME whose message is its arguments (streamed as generated);
commentary without a recipient (a preamble) is content.

`openai-harmony` reads its vocabulary from an `o200k_base.tiktoken` file it would download; it
is rebuilt here, once, from the model's own `tokenizer.json` (the gpt-oss tokenizer: base tokens
rank = id, bytes from the byte-level alphabet) into ORCHARD_HOME/cache/harmony, so it works
offline."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from django.conf import settings

from engine.detokenizer import unicode_to_byte
from inference.parsers.base import ParsedDelta, ToolCallDelta, ToolParser

logger = logging.getLogger(__name__)

# o200k's base vocabulary; ids from here on are harmony's special tokens.
NUM_BASE_TOKENS = 199_998
_encoding = None
_lock = threading.Lock()


def _build_vocabulary(tokenizer_json: Path, folder: Path) -> None:
    vocab = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]["vocab"]
    table = unicode_to_byte()
    lines = [
        f"{base64.b64encode(bytes(table[c] for c in token)).decode()} {rank}"
        for token, rank in sorted(vocab.items(), key=lambda item: item[1])
        if rank < NUM_BASE_TOKENS
    ]
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f"o200k_base.tiktoken.{os.getpid()}"
    staging.write_text("\n".join(lines) + "\n", encoding="utf-8")
    staging.replace(folder / "o200k_base.tiktoken")


def harmony_encoding(model_path: str | Path):
    """The harmony encoding, its vocabulary built from the model's tokenizer on first use."""
    global _encoding
    with _lock:
        if _encoding is not None:
            return _encoding
        tokenizer_json = Path(model_path) / "tokenizer.json"
        digest = hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()[:16]
        folder = Path(settings.ORCHARD_HOME) / "cache" / "harmony" / digest
        if not (folder / "o200k_base.tiktoken").exists():
            _build_vocabulary(tokenizer_json, folder)
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        _encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        return _encoding


class HarmonyParser(ToolParser):
    name = "harmony"
    uses_token_ids = True
    also_reasoning = True

    def __init__(self, tools=(), *, parallel: bool = True, model_path: str = "", calls=True):
        super().__init__(tools, parallel=parallel)
        from openai_harmony import Role, StreamableParser

        self._parser = StreamableParser(harmony_encoding(model_path), role=Role.ASSISTANT)
        self._calls = calls  # False: tool calls are not parsed (tool_choice none): content
        self._message = -1  # the index of the message the current call belongs to
        self._call: ToolCallDelta | None = None
        self._broken = False

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        out = ParsedDelta()
        for token_id in token_ids:
            if self._broken:
                break
            try:
                self._parser.process(token_id)
            except Exception as exc:  # HarmonyError: not harmony after all
                logger.warning("harmony parsing stopped: %s", exc)
                self._broken = True
                break
            self._route(out, self._parser.last_content_delta or "")
        if self._broken:
            out.content += text
        return out

    def _route(self, out: ParsedDelta, delta: str) -> None:
        channel = self._parser.current_channel
        recipient = self._parser.current_recipient
        if channel is None:
            return
        if recipient and self._calls:
            message = len(self._parser.messages)
            if message != self._message:
                self._message = message
                self._call = self.start_call(recipient.removeprefix("functions."))
                if self._call is not None:
                    out.add(ParsedDelta(tool_calls=[self._call]))
            if delta and self._call is not None:
                out.add(
                    ParsedDelta(tool_calls=[ToolCallDelta(index=self._call.index, arguments=delta)])
                )
        elif channel == "analysis":
            out.reasoning += delta
        else:  # final, or commentary meant for the user
            out.content += delta

    def finish(self) -> ParsedDelta:
        if not self._broken:
            try:
                self._parser.process_eos()
            except Exception:
                pass
        return ParsedDelta()
