"""The generation service's own policies, without a model: how the size of a request the caller
did not size is decided (renders share the fair preparation gate: test_prework.py)."""

import pytest

from engine import (
    InvalidRequestError,
    ModelInfo,
    RenderedPrompt,
    ServiceClass,
    completion_budget,
    validate_generation,
)
from inference.errors import APIError
from inference.models import ModelEntry
from inference.services.generation import (
    ERROR_OVER_KEY_CEILING,
    ERROR_OVER_MODEL_CEILING,
    GenerationCall,
    Sizing,
    _sampling,
)

INFO = ModelInfo(name="m", context_length=4096, vocab_size=1000, eos_token_ids=(0,))
SERVICE = ServiceClass(tenant="team:7", weight=3.0, principal="key:9", tier="flex")


def sized(call, entry, prompt_lengths, **kwargs):
    sampling, limit = _sampling(call, entry)
    prompts = [RenderedPrompt(token_ids=(1,) * length) for length in prompt_lengths]
    return Sizing("req", "m", prompts, sampling, limit, INFO, "team:7", SERVICE).requests(**kwargs)


def max_tokens(requests):
    return [request.sampling.max_tokens for request in requests]


def test_every_request_of_a_call_carries_its_cache_scope_and_service_class():
    entry = ModelEntry(name="m")
    call = GenerationCall("completions", "m", (), "prompt", sampling={"max_tokens": 5})
    requests = sized(call, entry, [10, 20, 30])
    assert [r.cache_scope for r in requests] == ["team:7"] * 3
    assert [r.service for r in requests] == [SERVICE] * 3
    assert requests[0].request_id != requests[1].request_id


def test_a_registry_default_max_tokens_is_an_upper_bound_not_a_caller_value():
    entry = ModelEntry(name="m", default_max_tokens=100_000, default_sampling={"temperature": 0.5})
    call = GenerationCall("chat.completions", "m", (), "messages", sampling={"max_tokens": None})
    sampling, limit = _sampling(call, entry)
    assert sampling.max_tokens is None and sampling.temperature == 0.5 and limit == 100_000
    # Capped to what the context leaves, instead of a context_length_exceeded the caller
    # never asked for; the request stays flexible (admission may grant less).
    assert max_tokens(sized(call, entry, [4000])) == [96]
    small = ModelEntry(name="m", default_max_tokens=20)
    assert max_tokens(sized(call, small, [10])) == [20]
    # A caller's own max_tokens is theirs: neither capped nor flexible.
    own = GenerationCall("chat.completions", "m", (), "messages", sampling={"max_tokens": 5000})
    assert _sampling(own, entry)[1] is None and max_tokens(sized(own, entry, [10])) == [5000]


def test_output_ceilings_refuse_more_and_bound_what_the_server_sizes():
    entry = ModelEntry(name="m", default_max_tokens=512, max_output_tokens=1000)
    unset = GenerationCall("chat.completions", "m", (), "messages")
    assert _sampling(unset, entry)[1] == 512
    assert _sampling(unset, entry, key_ceiling=100)[1] == 100  # the key's is lower
    assert _sampling(unset, ModelEntry(name="m", max_output_tokens=64))[1] == 64
    at_ceiling = GenerationCall("chat.completions", "m", (), "messages", {"max_tokens": 1000})
    assert _sampling(at_ceiling, entry)[0].max_tokens == 1000
    names = {"max_tokens": "max_output_tokens"}
    over = GenerationCall("responses", "m", (), "input", {"max_tokens": 1001}, param_names=names)
    with pytest.raises(APIError) as caught:
        _sampling(over, entry)
    assert (caught.value.status, caught.value.param) == (400, "max_output_tokens")
    assert caught.value.message == ERROR_OVER_MODEL_CEILING.format(
        param="max_output_tokens", asked=1001, ceiling=1000, model="m"
    )
    with pytest.raises(APIError) as caught:
        _sampling(at_ceiling, entry, key_ceiling=999)
    assert caught.value.message == ERROR_OVER_KEY_CEILING.format(
        param="max_tokens", asked=1000, ceiling=999, model="m"
    )


def test_the_endpoint_default_applies_when_neither_caller_nor_registry_sizes_it():
    call = GenerationCall("completions", "m", (), "prompt", default_max_tokens=16)
    assert _sampling(call, ModelEntry(name="m"))[1] == 16
    assert max_tokens(sized(call, ModelEntry(name="m"), [4090])) == [6]
    # No room: sized to 1, so that validation refuses it as too long for the context.
    [full] = sized(call, ModelEntry(name="m"), [4096])
    with pytest.raises(InvalidRequestError) as caught:
        validate_generation(full, INFO)
    assert caught.value.code == "context_length_exceeded"


def test_a_smaller_grant_is_shared_out_equally_within_each_prompts_own_size():
    call = GenerationCall("completions", "m", (), "prompt", sampling={"n": 2, "min_tokens": 50})
    # Two prompts of 100 and 4000 tokens, two choices each: without a grant each gets the rest
    # of its context; with one, each of the 4 choices an equal share of what the prompts leave.
    assert max_tokens(sized(call, ModelEntry(name="m"), [100, 4000])) == [3996, 96]
    granted = sized(call, ModelEntry(name="m"), [100, 4000], granted=4100 + 4 * 40)
    assert max_tokens(granted) == [40, 40]
    assert [r.sampling.min_tokens for r in granted] == [40, 40]  # cut to fit, not refused
    # A grant larger than the sizes changes nothing.
    assert max_tokens(sized(call, ModelEntry(name="m"), [100, 4000], granted=10**6)) == [3996, 96]


def test_the_budget_is_the_callers_else_the_rest_of_the_context_within_limit_and_grant():
    assert completion_budget(num_prompt_tokens=10, context_length=100) == 90
    assert completion_budget(num_prompt_tokens=10, context_length=100, max_tokens=500) == 500
    assert completion_budget(num_prompt_tokens=10, context_length=100, size_limit=20) == 20
    assert completion_budget(num_prompt_tokens=10, context_length=100, grant=5) == 5
    assert completion_budget(num_prompt_tokens=100, context_length=100) == 1
