"""One registry of parsers, offered everywhere a parser is chosen; detection from templates;
harmony from real gpt-oss token ids."""

import argparse
import json

import pytest
from django.core.exceptions import ValidationError
from transformers import AutoTokenizer

from inference.admin.registry import ModelEntryAdmin
from inference.management.commands.register_model import Command as RegisterModel
from inference.models import ModelEntry
from inference.parsers.harmony import HarmonyParser
from inference.parsers.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    detect_reasoning_parser,
    detect_tool_parser,
)
from inference.services.registry import model_register
from tests.fixtures.tiny_models import tokenizer_dir
from tests.inference.parsers.test_tool_parsers import Result


def test_the_registry_lists_every_parser_the_issue_names():
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "llama3_json", "mistral", "harmony"}
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "harmony"}


@pytest.mark.django_db
def test_admin_command_and_validation_offer_exactly_the_registry(admin_user, rf):
    from django.contrib.admin.sites import site

    request = rf.get("/")
    request.user = admin_user  # the draft model's field asks what the user may add
    form = ModelEntryAdmin(ModelEntry, site).get_form(request)()
    assert [value for value, _ in form.fields["tool_parser"].choices] == ["", *TOOL_PARSERS]
    assert [value for value, _ in form.fields["reasoning_parser"].choices] == [
        "",
        *REASONING_PARSERS,
    ]
    parser = argparse.ArgumentParser()
    RegisterModel().add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    assert actions["tool_parser"].choices == ["", *TOOL_PARSERS]
    assert actions["reasoning_parser"].choices == ["", *REASONING_PARSERS]
    entry = ModelEntry(name="m", path="/x", tool_parser="made-up")
    with pytest.raises(ValidationError) as caught:
        entry.full_clean()
    assert "tool_parser" in caught.value.message_dict


@pytest.mark.django_db
def test_an_unknown_parser_is_refused_not_stored(tiny_model_path):
    with pytest.raises(ValueError, match="Unknown tool parser"):
        model_register(name="m", path=tiny_model_path, tool_parser="hermes2")
    with pytest.raises(ValueError, match="Unknown reasoning parser"):
        model_register(name="m", path=tiny_model_path, reasoning_parser="o1")
    assert not ModelEntry.objects.filter(name="m").exists()
    entry = model_register(name="m", path=tiny_model_path, tool_parser="harmony")
    assert entry.tool_parser == "harmony"


def _template(name: str) -> str:
    config = json.loads((tokenizer_dir(name) / "tokenizer_config.json").read_text())
    return config.get("chat_template") or ""


def test_parsers_are_detected_from_real_templates():
    assert detect_tool_parser(_template("qwen3")) == "hermes"
    assert detect_reasoning_parser(_template("qwen3")) == "qwen3"
    # (the npm gpt-oss tokenizer ships no template; gpt-oss's own renders harmony headers)
    harmony = "{{- '<|start|>assistant<|channel|>final<|message|>' }}"
    assert detect_tool_parser(harmony) == "harmony"
    assert detect_reasoning_parser(harmony) == "harmony"
    assert detect_tool_parser("{{ messages }}") == ""
    assert detect_tool_parser("<tool_call>\n<function=x>\n<parameter=y>") == "qwen3_coder"
    assert detect_tool_parser("[TOOL_CALLS]") == "mistral"
    assert detect_tool_parser("<|python_tag|>") == "llama3_json"


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_harmony_reads_analysis_calls_and_final_from_gpt_oss_tokens(settings, tmp_path, chunk):
    settings.ORCHARD_HOME = tmp_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir("gptoss"))
    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    parser = HarmonyParser([], model_path=str(tokenizer_dir("gptoss")))
    result = Result()
    for at in range(0, len(ids), chunk):
        result.take(parser.feed("(text the engine decoded)", ids[at : at + chunk]))
    result.take(parser.finish())
    assert result.reasoning == "Need the weather."
    assert result.content == ""
    assert result.parsed_calls() == [("get_weather", {"city": "Paris"})]
    final = HarmonyParser([], model_path=str(tokenizer_dir("gptoss")), calls=False)
    answer = (
        "<|channel|>analysis<|message|>Easy.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4<|return|>"
    )
    result = Result()
    result.take(final.feed("", tokenizer.encode(answer, add_special_tokens=False)))
    result.take(final.finish())
    assert (result.reasoning, result.content, result.calls) == ("Easy.", "4", [])
