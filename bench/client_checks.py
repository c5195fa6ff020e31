"""Third-party clients against a running `nextn serve` (issue 47's must-shows).

Runs the openai client and instructor (and short guidellm and `vllm bench serve` runs) against a
server already started, prints one line per check, and writes the outcomes, the command and the
client versions as JSON. It imports no nextn code: it is meant to run from a separate venv that holds
only the clients, e.g.

    python3 -m venv /tmp/venv-clients && /tmp/venv-clients/bin/pip install instructor openai guidellm jsonschema
    /tmp/venv-clients/bin/pip install vllm   # for --checks vllm_bench only (large: CUDA torch)
    nextn serve nextn/default_model --port 8199 &
    /tmp/venv-clients/bin/python bench/client_checks.py --base-url http://127.0.0.1:8199/v1 \\
        --checks openai instructor guidellm vllm_bench --out bench/results/clients_cpu.json

Against the model card's line (`--reasoning-parser qwen3 --tool-call-parser qwen3_coder ...
--served-model-name qwen`) run `--checks model_card --model qwen`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import instructor
import jsonschema
from openai import OpenAI
from pydantic import BaseModel, Field

# an integer parameter: under --tool-call-parser qwen3_coder a string parameter is free text up to the
# line "</parameter>", which the bundled model does not write (see NOTES in the results)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast.",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]},
    },
}
# an open schema: no additionalProperties, so any further key is allowed and the object must still close.
# The age is bounded: unbounded, the bundled model's greedy digits run on ("age": 1000...) to max_tokens
# whatever the server does (at "age": 1 it ranks "0" above "," and "}"), which is the model, not the schema.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
}


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)  # bounded for the reason OPEN_SCHEMA's age is


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# --- the openai client


def check_n_seed(client: OpenAI, model: str) -> dict:
    def ask(seed: int) -> list[str]:
        r = client.chat.completions.create(
            model=model, messages=[user("Tell me a story.")], n=3, temperature=0.8, seed=seed, max_tokens=16
        )
        assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2], r.choices
        return [c.message.content for c in r.choices]

    first, again, other = ask(1234), ask(1234), ask(99)
    assert first == again, f"seed 1234 not reproducible: {first} vs {again}"
    assert len(set(first)) > 1, f"three equal choices at T=0.8: {first}"
    assert other != first, "another seed gave the same three choices"
    return {"choices": first}


def check_open_schema_response_format(client: OpenAI, model: str) -> dict:
    r = client.chat.completions.create(
        model=model,
        messages=[user("Give me a person as JSON.")],
        temperature=0,
        max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": OPEN_SCHEMA}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}: {choice.message.content!r}"
    obj = json.loads(choice.message.content)
    jsonschema.validate(obj, OPEN_SCHEMA)
    return {"content": choice.message.content, "finish_reason": choice.finish_reason}


def check_open_schema_named_tool(client: OpenAI, model: str) -> dict:
    tool = {"type": "function", "function": {"name": "add_person", "parameters": OPEN_SCHEMA}}
    r = client.chat.completions.create(
        model=model,
        messages=[user("Add a person.")],
        temperature=0,
        max_tokens=200,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "add_person"}},
    )
    choice = r.choices[0]
    # a named tool_choice finishes with `stop` in the OpenAI API (and vLLM); `tool_calls` is for auto
    assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add_person"
    jsonschema.validate(json.loads(call.function.arguments), OPEN_SCHEMA)
    return {"arguments": call.function.arguments, "finish_reason": choice.finish_reason}


def check_responses(client: OpenAI, model: str) -> dict:
    r = client.responses.create(model=model, input="Say hello.", max_output_tokens=16, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text, r
    events, text = [], []
    with client.responses.create(
        model=model, input="Say hello.", max_output_tokens=16, temperature=0, stream=True
    ) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "response.output_text.delta":
                text.append(event.delta)
            if event.type == "response.completed":
                final = event.response
    assert events[0] == "response.created" and events[-1] == "response.completed", events
    assert "".join(text) == r.output_text == final.output_text, ("".join(text), r.output_text)
    return {"output_text": r.output_text, "status": r.status, "stream_events": sorted(set(events))}


# --- instructor


def check_instructor(client: OpenAI, model: str, mode: instructor.Mode) -> dict:
    patched = instructor.from_openai(client, mode=mode)
    person = patched.chat.completions.create(
        model=model,
        response_model=Person,
        messages=[user("Extract the person: Ada is 36 years old.")],
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )
    assert isinstance(person, Person), person
    return {"object": person.model_dump()}


# --- the model card's line (served as `qwen`, with the qwen3 reasoning parser and qwen3_coder tools)


def check_model_card(client: OpenAI, model: str) -> dict:
    names = [m.id for m in client.models.list().data]
    assert model in names, names
    chat = client.chat.completions.create(
        model=model, messages=[user("Write hello world in Python.")], temperature=0, max_tokens=16
    ).choices[0]
    assert chat.message.content, chat
    tools = client.chat.completions.create(
        model=model,
        messages=[user("Weather in Paris?")],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=64,
    ).choices[0]
    assert tools.finish_reason == "tool_calls" and tools.message.tool_calls[0].function.name == "get_weather", tools
    # an assistant turn that opened <think>: its continuation is reasoning (qwen3 parser)
    thinking = [user("What is 2+3?"), {"role": "assistant", "content": "<think>\nThe user asks"}]
    reasoned = client.chat.completions.create(
        model=model,
        messages=thinking,
        temperature=0,
        max_tokens=8,
        extra_body={"add_generation_prompt": False},
    ).choices[0]
    reasoning = getattr(reasoned.message, "reasoning_content", None) or (reasoned.message.model_extra or {}).get(
        "reasoning_content"
    )
    assert reasoning and not reasoned.message.content, reasoned.message
    return {
        "models": names,
        "chat": chat.message.content,
        "tool_call": tools.message.tool_calls[0].function.model_dump(),
        "reasoning_content": reasoning,
    }


# --- guidellm


def check_guidellm(base_url: str, model: str) -> dict:
    """A short synthetic run with no --tokenizer: guidellm loads the tokenizer from the served name, which
    is the model as given to `nextn serve` (a path, relative to where both run)."""
    exe = str(Path(sys.executable).with_name("guidellm"))
    out = Path(tempfile.mkdtemp()) / "guidellm.json"
    cmd = [
        exe,
        "run",
        "--backend",
        f"kind=openai_http,target={base_url.removesuffix('/v1')},model={model}",
        "--profile",
        "kind=synchronous",
        "--constraint",
        "kind=max_requests,count=4",
        "--data",
        "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"rc {done.returncode}: {log[-2000:]}"
    (bench,) = json.loads(out.read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["successful"] == 4 and made["errored"] == made["incomplete"] == 0, made
    tokenizer = [line.strip() for line in log.splitlines() if "Tokenizer resolved" in line]
    assert tokenizer, "guidellm did not say which tokenizer it loaded"
    return {"command": " ".join(cmd[1:]), "requests_made": made, "tokenizer": tokenizer[0]}


def check_vllm_bench(base_url: str, model: str) -> dict:
    """`vllm bench serve` (random data, 4 prompts) with no --tokenizer: it loads the served name."""
    out = Path(tempfile.mkdtemp())
    cmd = [str(Path(sys.executable).with_name("vllm")), "bench", "serve", "--base-url", base_url.removesuffix("/v1")]
    cmd += ["--model", model, "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "16"]
    cmd += ["--num-prompts", "4", "--save-result", "--result-dir", str(out), "--result-filename", "vllm.json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"rc {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"
    report = json.loads((out / "vllm.json").read_text())
    assert report["completed"] == 4, {k: report.get(k) for k in ("completed", "num_prompts", "errors")}
    keep = ("completed", "total_input_tokens", "total_output_tokens", "request_throughput", "mean_ttft_ms")
    return {"command": " ".join(cmd[1:]), **{k: report.get(k) for k in keep}}


def versions() -> dict:
    names = ("openai", "instructor", "guidellm", "vllm", "pydantic", "jsonschema", "transformers")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8199/v1")
    ap.add_argument("--model", default="nextn/default_model", help="the served name")
    groups_named = ("openai", "instructor", "guidellm", "vllm_bench", "model_card")
    ap.add_argument("--checks", nargs="+", choices=groups_named, required=True)
    ap.add_argument("--server-command", default="", help="recorded in the results")
    ap.add_argument("--label", default="", help="the key the results go under in --out")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key="none", timeout=300)
    groups = {
        "openai": {
            "openai_n3_seed": lambda: check_n_seed(client, args.model),
            "openai_open_schema_response_format": lambda: check_open_schema_response_format(client, args.model),
            "openai_open_schema_named_tool": lambda: check_open_schema_named_tool(client, args.model),
            "openai_responses": lambda: check_responses(client, args.model),
        },
        "instructor": {
            "instructor_json_schema": lambda: check_instructor(client, args.model, instructor.Mode.JSON_SCHEMA),
            "instructor_tools": lambda: check_instructor(client, args.model, instructor.Mode.TOOLS),
        },
        "guidellm": {"guidellm_benchmark": lambda: check_guidellm(args.base_url, args.model)},
        "vllm_bench": {"vllm_bench_serve": lambda: check_vllm_bench(args.base_url, args.model)},
        "model_card": {"model_card_chat_tools_reasoning": lambda: check_model_card(client, args.model)},
    }
    results = {}
    for group in args.checks:
        for name, run in groups[group].items():
            start = time.perf_counter()
            try:
                results[name] = {"pass": True, **run()}
            except Exception as e:  # a check's failure is a result to record, not a crash
                results[name] = {"pass": False, "error": f"{type(e).__name__}: {e}"[:3000]}
                traceback.print_exc()
            results[name]["seconds"] = round(time.perf_counter() - start, 2)
            print(f"{'PASS' if results[name]['pass'] else 'FAIL'} {name}", flush=True)
    if args.out:
        label = args.label or " ".join(args.checks)
        saved = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
        saved["runs"][label] = {
            "client_versions": versions(),
            "server_command": args.server_command,
            "client_command": " ".join([Path(sys.executable).name, *sys.argv]),
            "base_url": args.base_url,
            "model": args.model,
            "checks": results,
        }
        args.out.write_text(json.dumps(saved, indent=2) + "\n")
    return 0 if all(r["pass"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
