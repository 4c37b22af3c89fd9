"""Pulls from the hub, engine side (engine/models/hub.py, pull.py, convert.py), against the local
hub of tests/fixtures/hub.py: the files a model needs and nothing else, a download resumed with
a Range request, conversion and 4-bit quantization into a folder mlx-lm loads, and each failure
as its own sentence, with nothing left behind."""

import errno
import json
from pathlib import Path

import pytest

from engine.models import hub as hub_module
from engine.models.convert import architecture_problem
from engine.models.hub import PullError, PullStopped, hub_plan, needed_files
from engine.models.pull import PullAbandoned, PullRequest, pull_model, staging_folder
from tests.fixtures.hub import (
    BIN_REPO,
    EMBEDDING_REPO,
    EXTRA_FILES,
    GATED_REPO,
    GATED_TOKEN,
    HF_REPO,
    MLX_REPO,
    ODD_REPO,
    QUANTIZED_REPO,
)

NEEDED = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


class Monitor:
    def __init__(self, stop_after: int | None = None, abandon_after: int | None = None):
        self.phases: list[str] = []
        self.last: dict[str, tuple[int, int]] = {}
        self.commit = None
        self.stop_after, self.abandon_after = stop_after, abandon_after

    def resolved(self, plan):
        self.commit = plan.commit

    def phase(self, phase):
        if not self.phases or self.phases[-1] != phase:
            self.phases.append(phase)

    def progress(self, done, total):
        self.last[self.phases[-1]] = (done, total)

    def should_stop(self):
        done = self.last.get("downloading", (0, 0))[0]
        if self.abandon_after is not None and done > self.abandon_after:
            raise PullAbandoned
        return self.stop_after is not None and done > self.stop_after


def pull(hub, models: Path, repo: str, name: str = "m", monitor=None, **options):
    endpoint = options.pop("endpoint", None) or hub.url
    revision = options.pop("revision", None)
    return pull_model(
        PullRequest(repo_id=repo, revision=revision, name=name, **options),
        models_dir=models,
        endpoint=endpoint,
        monitor=monitor or Monitor(),
    )


def leftovers(models: Path) -> list[str]:
    return (
        sorted(p.relative_to(models).as_posix() for p in models.rglob("*"))
        if models.exists()
        else []
    )


def weights_requested(hub, since: int) -> list:
    return [
        r for r in hub.requests[since:] if r.method == "GET" and r.path.endswith(".safetensors")
    ]


def test_a_plan_lists_only_the_files_a_model_needs(local_hub):
    plan = hub_plan(HF_REPO, revision=None, kind="chat", endpoint=local_hub.url)
    assert [f.path for f in plan.files] == NEEDED
    assert plan.commit == local_hub.repos[HF_REPO].refs["main"] and len(plan.commit) == 40
    assert not plan.hub_says_mlx
    assert plan.file("model.safetensors").sha256 is not None
    assert hub_plan(MLX_REPO, revision="v1", kind="chat", endpoint=local_hub.url).hub_says_mlx


def test_a_vision_models_plan_has_its_processor_files(local_hub):
    from tests.fixtures.tiny_vision import build_tiny_vision_model

    local_hub.add_repo("vision-org/tiny-smolvlm", build_tiny_vision_model(), files=EXTRA_FILES)
    plan = hub_plan("vision-org/tiny-smolvlm", revision=None, kind="chat", endpoint=local_hub.url)
    assert [f.path for f in plan.files] == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_an_mlx_checkpoint_is_served_as_downloaded(local_hub, tmp_path):
    models = tmp_path / "models"
    since = len(local_hub.requests)
    monitor = Monitor()
    pulled = pull(local_hub, models, f"{MLX_REPO}", name="tiny", monitor=monitor, revision="v1")
    assert pulled.folder == models / "tiny" and not pulled.converted and pulled.bits is None
    assert pulled.commit == local_hub.repos[MLX_REPO].refs["v1"]
    source = local_hub.repos[MLX_REPO].files
    assert sorted(p.name for p in pulled.folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for file in pulled.folder.iterdir():
        assert file.read_bytes() == source[file.name]
    asked = {r.path.rsplit("/", 1)[-1] for r in local_hub.requests[since:] if r.method == "GET"}
    assert not asked & {"pytorch_model.bin", "model.onnx", "consolidated.pth", "model.gguf"}
    assert monitor.phases == ["downloading"]
    assert monitor.last["downloading"] == (pulled.size_bytes, pulled.size_bytes)
    names = sorted(f"tiny/{p.name}" for p in pulled.folder.iterdir())
    assert leftovers(models) == [".pulls", "tiny", *names]


def test_an_interrupted_download_resumes_with_a_range_request(local_hub, tmp_path):
    models = tmp_path / "models"
    commit = local_hub.repos[MLX_REPO].refs["main"]
    staging = staging_folder(models, MLX_REPO, commit)
    staging.mkdir(parents=True)
    weights = local_hub.repos[MLX_REPO].files["model.safetensors"]
    half = len(weights) // 2
    (staging / "model.safetensors.incomplete").write_bytes(weights[:half])
    since = len(local_hub.requests)
    pulled = pull(local_hub, models, MLX_REPO, name="resumed")
    assert [r.range for r in weights_requested(local_hub, since)] == [f"bytes={half}-"]
    assert (pulled.folder / "model.safetensors").read_bytes() == weights
    assert not staging.exists()


def test_a_partial_file_that_does_not_match_is_refused_and_removed(local_hub, tmp_path):
    models = tmp_path / "models"
    staging = staging_folder(models, MLX_REPO, local_hub.repos[MLX_REPO].refs["main"])
    staging.mkdir(parents=True)
    (staging / "model.safetensors.incomplete").write_bytes(b"not these bytes" * 1000)
    with pytest.raises(PullError) as caught:
        pull(local_hub, models, MLX_REPO, name="corrupt")
    assert caught.value.code == "corrupt"
    assert "arrived corrupted" in str(caught.value)
    assert not (models / "corrupt").exists() and not staging.exists()


def test_a_checkpoint_is_converted_and_quantized_to_4_bits(local_hub, tmp_path):
    from mlx_lm import load

    models = tmp_path / "models"
    monitor = Monitor()
    pulled = pull(local_hub, models, HF_REPO, name="tiny-q4", bits=4, monitor=monitor)
    assert pulled.converted and (pulled.bits, pulled.group_size) == (4, 64)
    config = json.loads((pulled.folder / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert monitor.phases == ["downloading", "converting", "quantizing"]
    done, total = monitor.last["quantizing"]
    assert done == total > 0
    _model, tokenizer = load(str(pulled.folder))
    assert tokenizer.chat_template  # the tokenizer files came along
    header = (pulled.folder / "model.safetensors").read_bytes()[:100_000]
    assert b"inv_freq" not in header and b"lm_head" not in header  # sanitized
    assert b"scales" in header
    assert not staging_folder(models, HF_REPO, pulled.commit).exists()
    assert sorted(p.name for p in models.iterdir()) == [".pulls", "tiny-q4"]


def test_a_checkpoint_without_quantizing_is_converted_at_its_precision(local_hub, tmp_path):
    from mlx_lm import load

    from engine.models.config import folder_facts

    published = local_hub.repos[HF_REPO].files["model.safetensors"][:100_000]
    assert b"inv_freq" in published and b"lm_head" in published
    pulled = pull(local_hub, tmp_path / "models", HF_REPO, name="tiny-f32")
    assert pulled.converted and pulled.bits is None
    config = json.loads((pulled.folder / "config.json").read_text())
    assert "quantization" not in config
    header = (pulled.folder / "model.safetensors").read_bytes()[:100_000]
    assert b"inv_freq" not in header and b"lm_head" not in header
    assert folder_facts(pulled.folder).quantization == "float32"
    load(str(pulled.folder))


def test_a_vision_checkpoint_is_converted_by_mlx_vlm_and_quantized_to_4_bits(local_hub, tmp_path):
    """A vision-language checkpoint (not listed as MLX) goes through mlx-vlm's conversion: its
    language model quantized, its vision tower kept, the processor's files beside it; the
    folder then serves image prompts with the language model's layers quantized."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine.models.loader import load_model
    from tests.fixtures.tiny_vision import build_tiny_qwen_vision_model, image_bytes

    local_hub.add_repo("vision-org/tiny-qwen-vl", build_tiny_qwen_vision_model())
    monitor = Monitor()
    pulled = pull(
        local_hub, tmp_path / "models", "vision-org/tiny-qwen-vl", bits=4, monitor=monitor
    )
    assert pulled.converted and pulled.bits == 4
    assert monitor.phases == ["downloading", "converting", "quantizing"]
    files = {p.name for p in pulled.folder.iterdir()}
    assert {"preprocessor_config.json", "video_preprocessor_config.json"} <= files
    assert json.loads((pulled.folder / "config.json").read_text())["quantization"]["bits"] == 4
    loaded = load_model(pulled.folder, name="tiny-qwen-vl-4bit")
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    tower = loaded.vision.model.vision_tower
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in tower.named_modules())
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
    ids, counts = loaded.vision.expand(prompt, [image_bytes("red")])
    assert counts == [6] and len(ids) > 6
    # Unquantized, the pulled folder gives the checkpoint's own logits.
    plain = pull(local_hub, tmp_path / "models", "vision-org/tiny-qwen-vl", name="plain")
    assert plain.converted and plain.bits is None
    probe = mx.array([ids])
    original = load_model(build_tiny_qwen_vision_model(), name="original").model(probe)
    assert mx.allclose(load_model(plain.folder, name="plain").model(probe), original).item()
    assert architecture_problem({"model_type": "paligemma", "vision_config": {}}, kind="chat")


def test_an_embedding_model_comes_with_its_sentence_transformers_files(local_hub, tmp_path):
    pulled = pull(local_hub, tmp_path / "models", EMBEDDING_REPO, name="minilm", kind="embedding")
    assert not pulled.converted
    files = sorted(p.relative_to(pulled.folder).as_posix() for p in pulled.folder.rglob("*.*"))
    assert files == [
        "1_Pooling/config.json",
        "config.json",
        "config_sentence_transformers.json",
        "model.safetensors",
        "modules.json",
        "sentence_bert_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    with pytest.raises(PullError, match="Orchard's embedding encoder runs BERT-family"):
        pull(local_hub, tmp_path / "models", MLX_REPO, name="not-an-encoder", kind="embedding")


@pytest.mark.parametrize(
    ("repo", "options", "code", "message"),
    [
        ("nobody/nothing", {}, "repo_not_found", "There is no model nobody/nothing on "),
        (MLX_REPO, {"revision": "no-such-branch"}, "revision_not_found", "has no revision"),
        (GATED_REPO, {}, "gated", "is gated: accept its conditions at "),
        (ODD_REPO, {}, "unsupported", "has no model for its model_type 'no_such_architecture'"),
        (BIN_REPO, {}, "no_weights", "has no safetensors weights (model*.safetensors)"),
        (QUANTIZED_REPO, {"bits": 8}, "already_quantized", "is quantized already (4-bit)"),
    ],
)
def test_each_failure_has_its_sentence_before_any_weights_and_leaves_nothing(
    local_hub, tmp_path, monkeypatch, repo, options, code, message
):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    models = tmp_path / "models"
    since = len(local_hub.requests)
    with pytest.raises(PullError) as caught:
        pull(local_hub, models, repo, name="x", **options)
    assert caught.value.code == code
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert weights_requested(local_hub, since) == []
    assert leftovers(models) in ([], [".pulls"])


def test_a_gated_repo_with_a_token_it_does_not_know_and_with_one_it_does(
    local_hub, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(PullError) as caught:
        pull(local_hub, tmp_path / "models", GATED_REPO, name="x")
    assert "the account of HF_TOKEN has no access to it" in str(caught.value)
    monkeypatch.setenv("HF_TOKEN", GATED_TOKEN)
    pulled = pull(local_hub, tmp_path / "models", GATED_REPO, name="gated")
    assert pulled.converted
    assert local_hub.requests[-1].authorization == f"Bearer {GATED_TOKEN}"


def test_an_unreachable_hub(tmp_path):
    with pytest.raises(PullError) as caught:
        pull(None, tmp_path / "models", MLX_REPO, endpoint="http://127.0.0.1:9")
    assert caught.value.code == "network"
    assert "Could not download mlx-community/tiny-qwen3-mlx from http://127.0.0.1:9" in str(
        caught.value
    )


def test_too_little_disk_is_refused_before_downloading(local_hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_module, "free_disk_bytes", lambda path: 1_000_000)
    models = tmp_path / "models"
    since = len(local_hub.requests)
    with pytest.raises(PullError) as caught:
        pull(local_hub, models, HF_REPO, name="big", bits=4)
    assert caught.value.code == "disk_full"
    assert "Not enough disk space for tiny-org/Tiny-Llama-HF: it needs " in str(caught.value)
    assert "1.0 MB is free" in str(caught.value)
    assert weights_requested(local_hub, since) == []
    assert leftovers(models) == [".pulls"]


def test_a_disk_that_fills_up_while_downloading(local_hub, tmp_path, monkeypatch):
    real_open = open

    class Full:
        def __init__(self, stream):
            self.stream = stream

        def __getattr__(self, name):
            return getattr(self.stream, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stream.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(path, *args, **kwargs):
        stream = real_open(path, *args, **kwargs)
        return Full(stream) if str(path).endswith(".incomplete") else stream

    monkeypatch.setattr(hub_module, "open", full_open, raising=False)
    models = tmp_path / "models"
    with pytest.raises(PullError) as caught:
        pull(local_hub, models, MLX_REPO, name="full")
    assert caught.value.code == "disk_full"
    assert str(caught.value) == (
        "The disk filled up while downloading mlx-community/tiny-qwen3-mlx "
        "(No space left on device)."
    )
    assert leftovers(models) == [".pulls"]


def test_a_stop_cleans_up_and_an_abandoned_pull_keeps_its_files(local_hub, tmp_path):
    models = tmp_path / "models"
    with pytest.raises(PullStopped):
        pull(local_hub, models, MLX_REPO, name="stopped", monitor=Monitor(stop_after=1))
    assert leftovers(models) == [".pulls"]
    with pytest.raises(PullAbandoned):
        pull(local_hub, models, MLX_REPO, name="left", monitor=Monitor(abandon_after=1))
    staging = staging_folder(models, MLX_REPO, local_hub.repos[MLX_REPO].refs["main"])
    assert (staging / "config.json").exists()


def test_a_name_whose_folder_exists_is_refused(local_hub, tmp_path):
    (tmp_path / "models" / "taken").mkdir(parents=True)
    with pytest.raises(PullError) as caught:
        pull(local_hub, tmp_path / "models", MLX_REPO, name="taken")
    assert caught.value.code == "exists"


def test_names_from_the_hub_never_leave_the_folder():
    names = [
        "config.json",
        "../config.json",
        "a/../../x.jinja",
        "/etc/x.jinja",
        "x.jinja",
        "1_Pooling/config.json",
        "1_Pooling/../config.json",
        "onnx/model.onnx",
        "model-00001-of-00002.safetensors",
        "original/model.safetensors",
    ]
    assert needed_files(names, kind="embedding") == [
        "1_Pooling/config.json",
        "config.json",
        "model-00001-of-00002.safetensors",
        "x.jinja",
    ]
    assert "1_Pooling/config.json" not in needed_files(names, kind="chat")
