"""A vLLM user's command line in `nextn serve` (issue 47): the Qwen3.5 model card's `vllm serve`
line starts the server on the bundled model and it answers chat, tools and reasoning; every flag of
docs/vllm_serve_flags.md is parsed as its row says (mapped and ignored accepted, refused an error
naming it); ignored flags log one line each; --served-model-name takes several names and never
the model; the served name defaults to the model as given; the front-end flags (chat template,
CORS, docs, logprob cap, tool-call parser form) and the engine ones (seed, generation config,
revision / download dir) do what they say.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_server import KEY, LiveServer, ok, user  # noqa: E402
from test_server_core import _free_port, start_cli  # noqa: E402

import nextn  # noqa: E402
from nextn import LLM, SamplingParams  # noqa: E402
from nextn.cli import build_parser, main, parse_args  # noqa: E402
from nextn.cli_vllm import ignored_flags  # noqa: E402
from nextn.config import DEFAULT_MODEL_DIR  # noqa: E402
from nextn.config.serve import ServeConfig, ServerOptions  # noqa: E402
from nextn.server import protocol as P  # noqa: E402
from nextn.server import structured  # noqa: E402
from nextn.server.chat_output import ChatOutputParser  # noqa: E402
from nextn.server.completions import output_parser  # noqa: E402
from nextn.server.core_client import CoreProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_CARD = (
    "--reasoning-parser",
    "qwen3",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "qwen3_coder",
    "--speculative-config",
    '{"method":"qwen3_next_mtp","num_speculative_tokens":2}',
)
EXTRA = ("--gpu-memory-utilization", "0.9", "--enable-prefix-caching", "--trust-remote-code", "--seed", "0")
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]},
    },
}

STRING_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def doc_rows() -> list[tuple[str, str]]:
    """(flag, status) for every flag named in the docs table (short forms too)."""
    rows = []
    for line in (ROOT / "docs" / "vllm_serve_flags.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("mapped", "ignored", "refused"):
            rows += [(flag, cells[1]) for flag in re.findall(r"`(-[-\w]+)`", cells[0])]
    return rows


def serve_options() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    return set(sub._option_string_actions)


def test_every_vllm_flag_in_the_table_is_parsed_as_its_row_says(capsys):
    rows = doc_rows()
    assert len(rows) > 150 and len({f for f, _ in rows}) == len(rows)
    known, table = serve_options(), dict(rows)
    for flag, status in rows:
        assert (flag in known) == (status != "refused"), (flag, status)
    # every ignored flag is in the table as ignored (its --no- form aside)
    assert {f for f in ignored_flags() if not f.startswith("--no-")} == {f for f, s in rows if s == "ignored"}
    for flag in [f for f, s in rows if s == "refused"]:
        with pytest.raises(SystemExit):
            parse_args(["serve", flag, "1"])
        assert flag in capsys.readouterr().err
    assert table["--served-model-name"] == "mapped" and table["-tp"] == "mapped"


def test_the_model_card_line_parses_and_maps():
    args = parse_args(["serve", "Qwen/Qwen3.5-9B", *MODEL_CARD, "-tp", "1", "-q", "fp8", "--dtype", "half"])
    assert args.model == "Qwen/Qwen3.5-9B" and args.tool_call_parser == "qwen3_coder"
    assert args.speculative_config["num_speculative_tokens"] == 2 and args.reasoning_parser == "qwen3"
    assert args.tensor_parallel_size == 1 and args.quantization == "fp8"
    assert [flag for flag, _ in args.vllm_ignored] == ["--enable-auto-tool-choice"]
    assert parse_args(["generate", "--prompt", "x", "--max-model-len", "4k"]).max_model_len == 4000
    assert parse_args(["serve", "--max-model-len", "4K"]).max_model_len == 4096


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-pp", "2"], "-pp 2: nextn takes only 1"),
        (["--load-format", "pt"], "--load-format pt: nextn takes only auto or safetensors"),
        (["--enable-lora"], "unrecognized arguments: --enable-lora"),
        (["--config", "x.yaml"], "unrecognized arguments: --config"),  # no abbreviation of --config-format
        (["--tool-call-parser", "mistral"], "invalid choice: 'mistral'"),
        (["--enable-chunked-prefill", "--prefill", "steps"], "--enable-chunked-prefill means --prefill chunked"),
        (["--chat-template", "missing.jinja"], "argument --chat-template: missing.jinja: no such file"),
    ],
)
def test_vllm_flags_nextn_cannot_honour_are_one_line_errors(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(CoreProcess, "launch", _no_launch)
    try:
        code = main(["serve", *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2 and message in capsys.readouterr().err


def _no_launch(*args, **kwargs):
    raise ValueError("launch reached")


def test_ignored_flags_log_one_line_each_and_mapped_ones_reach_the_server(monkeypatch, caplog, capsys):
    seen = {}

    def launch(llm_args, log_level=None):
        seen["llm"] = llm_args
        raise ValueError("launch reached")

    monkeypatch.setattr(CoreProcess, "launch", launch)
    flags = [*MODEL_CARD, *EXTRA, "--block-size", "16", "--swap-space", "4", "--enforce-eager"]
    flags += ["--generation-config", "vllm", "--revision", "v1", "--download-dir", "/tmp/d"]
    with caplog.at_level(logging.INFO, logger="nextn"):
        assert main(["serve", *flags, "--port", str(_free_port())]) == 2
    assert "launch reached" in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "nextn.serve"]
    named = ["--enable-auto-tool-choice", "--trust-remote-code", "--block-size"]  # (--enable-prefix-caching is mapped)
    assert len(lines) == 4 and [line.split()[0] for line in lines] == [*named, "--swap-space"]
    assert all("does nothing in nextn" in line for line in lines)
    args = seen["llm"]
    assert args.seed == 0 and args.enforce_eager and args.generation_config == "vllm"
    assert (args.revision, args.download_dir, args.prefill) == ("v1", "/tmp/d", "steps")


def test_served_model_name_takes_names_and_never_the_model(dense_ckpt, capsys, monkeypatch):
    args = parse_args(["serve", str(dense_ckpt), "--served-model-name", "a", "b"])
    assert args.model == str(dense_ckpt) and args.served_model_name == ["a", "b"]
    monkeypatch.setattr(CoreProcess, "launch", _no_launch)
    assert main(["serve", "--served-model-name", "a", str(dense_ckpt)]) == 2
    assert f"--served-model-name took {dense_ckpt}, a directory" in capsys.readouterr().err


def test_the_served_names_and_the_default_name_is_the_model_as_given(dense_ckpt):
    """vLLM's: the first name in responses, every name listed and taken; without names, the path
    as given (guidellm and `vllm bench serve` load the tokenizer from it)."""
    llm = LLM(model=str(dense_ckpt), max_model_len=256)
    with LiveServer(llm, ServeConfig(api_key=KEY, served_model_name=("a", "b"))) as srv:
        models = ok(httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10))
        assert [m["id"] for m in models["data"]] == ["a", "b"]
        body = {"prompt": "x", "max_tokens": 2, "temperature": 0.0}
        assert ok(srv.post("/v1/completions", {**body, "model": "b"}))["model"] == "a"
        assert srv.post("/v1/completions", {**body, "model": "c"}).status_code == 400
    with LiveServer(llm, ServeConfig(api_key=KEY)) as srv:
        models = ok(httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10))
        assert [m["id"] for m in models["data"]] == [str(dense_ckpt)]
    assert LLM(model=None, max_model_len=64).model_name == DEFAULT_MODEL_DIR.name  # the bundled model


def test_the_front_end_flags(dense_ckpt, tmp_path):
    """--chat-template (its text), --default-chat-template-kwargs (a request's win), CORS,
    --disable-fastapi-docs and --max-logprobs."""
    llm = LLM(model=dense_ckpt, max_model_len=256)
    opts = ServerOptions(
        chat_template="{{ messages[0]['content'] }}/{{ flavor }}",
        default_chat_template_kwargs={"flavor": "plain"},
        allowed_origins=("http://ui.example",),
        docs=False,
        max_logprobs=2,
    )
    with LiveServer(llm, ServeConfig(api_key=KEY), opts) as srv:
        r = ok(srv.post("/tokenize", {"messages": [user("Hi")]}))
        assert r["tokens"] == llm.tokenizer.encode("Hi/plain")
        r = ok(srv.post("/tokenize", {"messages": [user("Hi")], "chat_template_kwargs": {"flavor": "own"}}))
        assert r["tokens"] == llm.tokenizer.encode("Hi/own")
        preflight = httpx.options(
            f"{srv.url}/v1/completions",
            headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"},
            timeout=10,
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
        assert httpx.get(f"{srv.url}/docs", timeout=10).status_code in (401, 404)
        assert httpx.get(f"{srv.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
        body = {"prompt": "x", "max_tokens": 2, "logprobs": 3}
        r = srv.post("/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        assert ok(srv.post("/v1/completions", {**body, "logprobs": 2}))["choices"][0]["logprobs"]
    with LiveServer(llm, ServeConfig(api_key=KEY)) as srv:  # the defaults: no CORS headers, docs served
        preflight = httpx.options(
            f"{srv.url}/v1/completions",
            headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"},
            timeout=10,
        )
        assert "access-control-allow-origin" not in preflight.headers
        assert httpx.get(f"{srv.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_tool_call_parser_picks_the_form_read_and_the_template_the_form_forced(dense_ckpt):
    tools = [P.Tool.model_validate(TOOL)]
    json_body = '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>'
    xml_body = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    for form, body, parsed in [
        (None, json_body, True),
        (None, xml_body, True),
        ("json", json_body, True),
        ("json", xml_body, False),
        ("xml", xml_body, True),
        ("xml", json_body, False),
    ]:
        parser = ChatOutputParser(None, tools, form=form)
        parts = parser.push(body)
        rest = parser.finish()
        calls = parts.tool_calls + rest.tool_calls
        assert (len(calls) == 1) == parsed, (form, body)
        if parsed:
            assert calls[0].function.name == "get_weather" and calls[0].function.arguments == '{"days": 2}'
    # a forced call: written in the chat template's form (here JSON) under any parser, and read in it
    tok = LLM(model=dense_ckpt, max_model_len=64).tokenizer
    srv = SimpleNamespace(prompts=SimpleNamespace(tok=tok), opts=ServerOptions(tool_call_parser="qwen3_coder"))
    for choice, parsed in [("required", True), ("auto", False)]:
        req = P.ChatCompletionRequest.model_validate({"messages": [user("x")], "tools": [TOOL], "tool_choice": choice})
        assert (structured.tool_grammar(req, tok) is not None) == parsed
        parser = output_parser(srv, req, None)
        calls = parser.push(json_body).tool_calls + parser.finish().tool_calls
        assert len(calls) == parsed, choice  # "auto" under qwen3_coder reads XML only
    assert "<function=" not in structured.tool_grammar(req.model_copy(update={"tool_choice": "required"}), tok)


def test_seed_generation_config_and_hub_settings(dense_ckpt, tmp_path, monkeypatch):
    """LLM(seed=): unseeded sampled requests repeat from a fresh LLM and differ with another seed;
    generation_config "vllm" drops the checkpoint's defaults, an override sets its own, a bad key is
    named; revision and download_dir reach huggingface_hub."""
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    prompts = ["The quick brown fox", "def fibonacci(n):"]

    def run(seed):
        llm = LLM(model=dense_ckpt, max_model_len=128, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    first = run(7)
    assert run(7) == first and run(8) != first and first[0] != first[1]
    assert LLM(model=dense_ckpt, max_model_len=64, generation_config="vllm").sampling_defaults == {}
    over = LLM(model=dense_ckpt, max_model_len=64, override_generation_config={"temperature": 0.3, "top_k": 4})
    assert over.sampling_defaults["temperature"] == 0.3 and over.sampling_defaults["top_k"] == 4
    with pytest.raises(ValueError, match="'beams'"):
        LLM(model=dense_ckpt, max_model_len=64, override_generation_config={"beams": 2})
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw.get("revision"), kw.get("cache_dir")))
        out = tmp_path / "snap"
        if not out.exists():
            shutil.copytree(dense_ckpt, out)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    llm = nextn.LLM("org/tiny", max_model_len=64, revision="r1", download_dir=str(tmp_path / "dl"))
    assert calls == [("org/tiny", "r1", str(tmp_path / "dl"))] and llm.model_name == "org/tiny"


def test_the_model_card_command_serves_chat_tools_and_reasoning(tmp_path):
    """The Qwen3.5 model card's vLLM line (plus a vLLM user's usual extras and two names) on the
    bundled model, as `nextn serve` itself."""
    flags = (*MODEL_CARD, *EXTRA, "--served-model-name", "qwen", "q2", "--max-model-len", "1024")
    proc, url, log = start_cli(DEFAULT_MODEL_DIR, tmp_path, "model_card", flags)
    try:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["qwen", "q2"]

        def chat(**body) -> dict:
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "qwen", "temperature": 0, **body}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        reply = chat(messages=[user("Write hello world in Python.")], max_tokens=16)
        assert reply["message"]["content"] and reply["finish_reason"] == "length"
        call = chat(messages=[user("Weather in Paris?")], tools=[TOOL], tool_choice="required", max_tokens=64)
        assert call["finish_reason"] == "tool_calls" and call["message"]["tool_calls"][0]["function"]["name"] == (
            "get_weather"
        )
        # a named call with a string argument and an open schema, under qwen3_coder on a model whose
        # template writes JSON calls: forced in the template's form, it closes (in XML it ran on)
        lookup = {"type": "function", "function": {"name": "lookup", "parameters": STRING_PARAMS}}
        named = {"type": "function", "function": {"name": "lookup"}}
        call = chat(messages=[user("Look up Paris.")], tools=[lookup], tool_choice=named, max_tokens=64)
        assert call["finish_reason"] == "stop", call
        assert isinstance(json.loads(call["message"]["tool_calls"][0]["function"]["arguments"])["city"], str)
        # an assistant turn that opened <think>: its continuation is reasoning (qwen3 parser)
        thinking = [user("What is 2+3?"), {"role": "assistant", "content": "<think>\nThe user asks"}]
        reasoned = chat(messages=thinking, add_generation_prompt=False, max_tokens=8)
        assert reasoned["message"]["reasoning_content"] and not reasoned["message"]["content"]
        text = log.read_text()
        assert "--trust-remote-code does nothing in nextn" in text and "serving qwen, q2" in text
    finally:
        proc.send_signal(signal.SIGTERM)  # the core goes with it
        proc.wait(30)


# --- the Python API's vLLM habits


def test_vllm_python_api_habits(dense_ckpt, capsys):
    """use_tqdm (a bar over the prompts, off with False), get_tokenizer(), StructuredOutputsParams,
    and logprobs as vLLM's Logprob objects beside nextn's own entries."""
    llm = LLM(model=dense_ckpt, max_model_len=128)
    assert llm.get_tokenizer() is llm.tokenizer
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(["The quick brown fox", "def f(x):"], params)
    assert "Processed prompts" in capsys.readouterr().err
    assert llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].token_ids == outs[0].token_ids
    assert "Processed prompts" not in capsys.readouterr().err
    out = outs[0]
    assert [e["token_id"] for e in out.logprobs] == out.token_ids  # nextn's form, as it was
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(out.token_ids)
    for tid, entry, own in zip(out.token_ids, completion.logprobs, out.logprobs, strict=True):
        assert isinstance(entry[tid], nextn.Logprob) and entry[tid].logprob == own["logprob"]
        assert entry[tid].rank == 1 and entry[tid].decoded_token == llm.tokenizer.decode([tid])  # greedy: the top
        assert 2 <= len(entry) <= 3 and sorted(lp.rank for lp in entry.values())[:2] == [1, 2]
    assert completion.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in out.logprobs))
    # a token that is not the most probable gets its true rank
    sampled = llm.generate(["def f(x):"], SamplingParams(max_tokens=24, temperature=5.0, seed=3, logprobs=0))[0]
    ranks = [e["rank"] for e in sampled.logprobs]
    assert max(ranks) > 1 and all(r >= 1 for r in ranks)
    so = nextn.StructuredOutputsParams(choice=["yes", "no"])
    constrained = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=so)
    assert constrained.structured_outputs == {"choice": ["yes", "no"]}
    assert llm.generate(["Is it?"], constrained, use_tqdm=False)[0].text in ("yes", "no")
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=nextn.StructuredOutputsParams(regex="a", choice=["b"]))
