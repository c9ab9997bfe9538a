"""Structured output and tool calling on the serving surfaces: HTTP with the `openai` SDK (response_format, vLLM's
structured_outputs, tools and tool_choice, streamed tool-call deltas) and gRPC (SamplingParams' oneof constraint),
on the embedded model given a Qwen-style chat template that renders tools (SmolLM2's own renders none)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import grpc
import jsonschema
import openai
import pytest

from jaxserve import tool_calls
from jaxserve.client import Client
from jaxserve.config import BatchConfig, SamplingParams
from jaxserve.engine.grammar import compile_grammar
from jaxserve.jobs.runner import BatchJob
from jaxserve.runner import build_engine
from tests.helpers import SERVING_ENGINE, free_port, openai_client
from tests.test_jobs import read_output, write_lines
from tests.test_server import start_server

pytestmark = pytest.mark.slow

ENGINE = SERVING_ENGINE
TEMPLATE = os.path.join(os.path.dirname(__file__), "data", "qwen2_tools.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
MODEL = "SmolLM2-135M-Instruct"  # (the HTTP API serves the config's model_name)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_model(smollm):
    with open(TEMPLATE) as f:
        return dataclasses.replace(smollm, tokenizer=dataclasses.replace(smollm.tokenizer, chat_template=f.read()))


@pytest.fixture(scope="module")
def server(tools_model):
    engine = build_engine(tools_model, ENGINE)
    engine.start()
    server = start_server(engine, tools_model, http_port=free_port(), engine=ENGINE)
    yield server
    server.stop()
    engine.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai_client(server)


def chat(oai, **kw):
    return oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=60, **kw)


def test_response_format_json_schema_and_json_object(oai):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    result = chat(oai, messages=[{"role": "user", "content": "Invent a person."}],
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person,
                                                                          "strict": True}})
    jsonschema.validate(json.loads(result.choices[0].message.content), person)
    assert result.choices[0].finish_reason == "stop"
    anything = chat(oai, messages=[{"role": "user", "content": "Describe a cat."}],
                    response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_structured_outputs_extras_regex_choice_and_completions(oai):
    regex = chat(oai, messages=ASK, extra_body={"structured_outputs": {"regex": r"[0-9]{2} degrees"}})
    assert re.fullmatch(r"[0-9]{2} degrees", regex.choices[0].message.content)
    choice = chat(oai, messages=ASK, extra_body={"structured_outputs": {"choice": ["sunny", "rainy", "cloudy"]}})
    assert choice.choices[0].message.content in ("sunny", "rainy", "cloudy")
    completion = oai.completions.create(model=MODEL, prompt="The answer is", max_tokens=20, temperature=0,
                                        extra_body={"structured_outputs": {"json": {"type": "array", "items": {
                                            "type": "integer"}, "minItems": 2, "maxItems": 3}}})
    assert 2 <= len(json.loads(completion.choices[0].text)) <= 3


@pytest.mark.parametrize("body, field, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema", "frobnicate"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": 'start: x\nx: "a" y'}}, "structured_outputs.grammar", "unknown name"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format", "send one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "bad name"),
])
def test_bad_constraints_are_400_naming_them(oai, body, field, words):
    with pytest.raises(openai.BadRequestError) as info:
        chat(oai, messages=ASK, extra_body=body)
    message = info.value.body["message"]
    assert field in message and words in message


def test_tool_call_round_trip_with_the_sdk(oai, tools_model):
    """A named tool_choice forces a call to that function with arguments valid under its parameters; the call and
    the tool's result go back through the template; the answer after them is text."""
    called = chat(oai, messages=ASK, tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = chat(oai, messages=history, tools=[WEATHER, TIME], tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    rendered = tools_model.tokenizer.render_chat(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": arguments}}]}, {**history[2]}], tools=[WEATHER, TIME])
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' in rendered and "<tool_response>" in rendered
    assert answer.usage.prompt_tokens == len(tools_model.tokenizer.encode(rendered, add_special_tokens=False))


def test_required_tool_choice_and_streamed_deltas(oai):
    """tool_choice "required" lets the model pick the function; streamed, the call arrives as OpenAI's deltas (index,
    id, type and name first, then the arguments) and adds up to what the whole response holds."""
    whole = chat(oai, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    stream = chat(oai, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                  stream=True)
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert entry["id"] is None and d.type == "function" and d.function.name
                entry["id"], entry["name"] = d.id, d.function.name
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == call.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_tools_need_a_template_that_renders_them(smollm):
    with pytest.raises(Exception, match="renders no tools"):
        from jaxserve.engine import validation

        validation.tool_calling([WEATHER], "auto", None, smollm.tokenizer.chat_template)


def test_grpc_constraints_and_a_bad_one(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with Client(f"127.0.0.1:{server.port}") as client:
        result = client.complete(messages=ASK, max_tokens=20, json_schema=json.dumps(schema))
        assert json.loads(result.text) in ({"ok": True}, {"ok": False})
        from jaxserve.v1 import inference_pb2 as pb

        picked = client.complete(messages=ASK, max_tokens=20, choice=pb.Choices(choices=["north", "south"]))
        assert picked.text in ("north", "south")
        with pytest.raises(grpc.RpcError) as info:
            client.complete(messages=ASK, max_tokens=20, regex="a(b")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.regex" in info.value.details() and "unclosed group" in info.value.details()


@pytest.fixture(scope="module")
def engine(tools_model):
    return build_engine(tools_model, ENGINE)


def test_batch_lines_take_the_same_constraints_and_tools(engine, tmp_path):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    lines = [{"custom_id": "schema", "messages": [{"role": "user", "content": "Invent a name."}], "max_tokens": 30,
              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}},
             {"custom_id": "regex", "url": "/v1/completions", "method": "POST",
              "body": {"prompt": "Code:", "max_tokens": 10, "structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}}},
             {"custom_id": "tool", "messages": ASK, "max_tokens": 60, "tools": [WEATHER],
              "tool_choice": "required", "parallel_tool_calls": False},
             {"custom_id": "bad", "prompt": "x", "structured_outputs": {"regex": "(("}}]
    cfg = BatchConfig(input=write_lines(tmp_path / "in.jsonl", lines), output=str(tmp_path / "out.jsonl"),
                      engine=ENGINE, sampling=SamplingParams(max_tokens=8), progress=False)
    with BatchJob(cfg, shard_index=0) as job:
        job.run(engine, MODEL)
    out = {r["custom_id"]: r for r in read_output(cfg.output)}
    body = {k: r["response"]["body"]["choices"][0] for k, r in out.items() if r["error"] is None}
    jsonschema.validate(json.loads(body["schema"]["message"]["content"]), person)
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", body["regex"]["text"])
    assert body["tool"]["finish_reason"] == "tool_calls"
    (call,) = body["tool"]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert "structured_outputs.regex" in out["bad"]["error"]["message"]


def test_llama3_json_tool_calls_parse_and_constrain(engine, smollm):
    """Llama 3's JSON format: the grammar forces a call whose output parses into OpenAI's tool_calls; text that is
    not a call stays content."""
    lark = tool_calls.grammar_lark("llama3", [WEATHER, TIME], "get_time", parallel=False)
    prompt = smollm.tokenizer.encode_chat([{"role": "user", "content": "What time is it in Oslo?"}])
    (done,) = engine.generate([prompt], [SamplingParams(max_tokens=40, grammar=compile_grammar("grammar", lark))])
    content, calls = tool_calls.parse("llama3", done.text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), TIME["function"]["parameters"])
    two = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls.parse("llama3", two)[1]] == \
        [("a", '{"x": 1}'), ("b", "{}")]
    assert tool_calls.parse("llama3", "It is noon.") == ("It is noon.", [])
    assert tool_calls.format_of("{{ '<|python_tag|>' }}") == "llama3"
