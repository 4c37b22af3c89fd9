"""Streaming detokenization against real tokenizers: UTF-8 splits, stop strings, special tokens."""

import engine  # noqa: F401  (first: it preloads OpenBLAS for mlx)

# isort: split
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.text.detokenizer import StreamDetokenizer, token_bytes, token_text

TOKENIZERS = Path(__file__).resolve().parents[2] / "var" / "cache" / "tokenizers"
TEXT = "Héllo wörld! 😀🎉 日本語のテキスト, naïve café.\n  Indented   spaces\tand tabs 👩‍👩‍👧 end"


@pytest.fixture(scope="module", params=["qwen3", "llama3_1"])
def tokenizer(request):
    return load(TOKENIZERS / request.param)


@pytest.fixture(scope="module")
def spm_tokenizer():
    # A SentencePiece-style tokenizer (metaspace + byte fallback), to exercise the generic path.
    chars = "▁abcdefghijklmnopqrstuvwxyzHTE.,!"
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({c: 256 + i for i, c in enumerate(chars)})
    vocab["<unk>"] = len(vocab)
    vocab["</s>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, ids, **kwargs):
    detok = StreamDetokenizer(tokenizer, **kwargs)
    chunks = [detok.add(i) for i in ids]
    chunks.append(detok.flush())
    return detok, chunks


def test_stream_equals_decode_and_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The test is only meaningful if some token carries part of a character.
    assert any(token_text(tokenizer, i).startswith("bytes:") for i in ids)
    detok, chunks = stream(tokenizer, ids)
    assert "".join(chunks) == detok.text == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert not detok.stopped


def test_generic_path_equals_decode(spm_tokenizer):
    text = "Hello world, héllo 😀 日本. The End!"
    ids = spm_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # byte-fallback tokens present
    detok, chunks = stream(spm_tokenizer, ids, stop=("The E",))
    expected = spm_tokenizer.decode(ids)
    assert "".join(chunks) == expected[: expected.index("The E")]
    assert detok.stopped and not any("\ufffd" in c for c in chunks)
    _, chunks = stream(spm_tokenizer, ids)
    assert "".join(chunks) == expected


@pytest.mark.parametrize(
    "stop",
    ["日本語の", "😀🎉", "naïve café", "wörld!", "\n  Indented"],
)
def test_stop_string_across_tokens_is_never_emitted(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert not any(stop in token_text(tokenizer, i) for i in ids)  # it spans tokens
    expected = TEXT[: TEXT.index(stop)]
    detok = StreamDetokenizer(tokenizer, stop=["never there", stop])
    emitted = ""
    for token_id in ids:
        emitted += detok.add(token_id)
        assert expected.startswith(emitted)  # nothing past the stop, even for a moment
    assert detok.stopped
    assert detok.flush() == ""
    assert emitted == detok.text == expected


def test_partial_stop_match_is_held_then_released(tokenizer):
    text = "The END is not ENDX, but END! is"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, chunks = stream(tokenizer, ids, stop=["END!"])
    assert "".join(chunks) == "The END is not ENDX, but "
    detok, chunks = stream(tokenizer, ids, stop=["ENDZ"])
    assert "".join(chunks) == text and not detok.stopped
    # At the end a held-back partial match comes out through flush.
    ids = tokenizer.encode("stops at EN", add_special_tokens=False)
    detok = StreamDetokenizer(tokenizer, stop=["END"])
    assert "".join(detok.add(i) for i in ids) == "stops at "
    assert detok.flush() == "EN"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    eos = sorted(tokenizer.eos_token_ids)[0]
    ids = [*tokenizer.encode("Hi 😀", add_special_tokens=False), eos]
    ids += tokenizer.encode(" after", add_special_tokens=False)
    _, chunks = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=skip)
    special = tokenizer.convert_ids_to_tokens(eos)
    assert (special in "".join(chunks)) is not skip
    # A stop string can match special-token text when it is kept.
    detok, chunks = stream(tokenizer, ids, skip_special_tokens=skip, stop=[special])
    assert detok.stopped is not skip


def test_kept_special_tokens_stay_in_the_text_and_others_are_still_skipped(
    tokenizer, spm_tokenizer
):
    """What a tool parser reads (e.g. mistral's [TOOL_CALLS]) is kept when asked for."""
    for tok in (tokenizer, spm_tokenizer):
        eos = tok.eos_token_id
        special = tok.convert_ids_to_tokens(eos)
        ids = [*tok.encode("ab", add_special_tokens=False), eos]
        ids += tok.encode("cd", add_special_tokens=False)
        _, kept = stream(tok, ids, keep=[special])
        _, skipped = stream(tok, ids)
        assert special in "".join(kept) and special not in "".join(skipped)
        assert "".join(kept).replace(special, "") == "".join(skipped)
        _, unknown = stream(tok, ids, keep=["<no such token>"])
        assert unknown == skipped


def test_token_text(tokenizer):
    hello, world = tokenizer.encode("Hello world", add_special_tokens=False)
    assert (token_text(tokenizer, hello), token_text(tokenizer, world)) == ("Hello", " world")
    eos = sorted(tokenizer.eos_token_ids)[0]
    assert token_text(tokenizer, eos) == tokenizer.convert_ids_to_tokens(eos)
    pieces = [token_text(tokenizer, i) for i in tokenizer.encode("😀", add_special_tokens=False)]
    raw = b"".join(
        bytes.fromhex(p[6:].replace("\\x", "")) if p.startswith("bytes:") else p.encode()
        for p in pieces
    )
    assert raw.decode() == "😀"


def test_token_bytes_concatenate_to_the_decoded_text(tokenizer, spm_tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert b"".join(token_bytes(tokenizer, i) for i in ids).decode() == TEXT
    # Generic path: pieces keep their word-start space, so only the first one differs.
    text = "Hello world, héllo 😀 日本. The End!"
    ids = spm_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(spm_tokenizer, i) for i in ids).decode() == " " + text
