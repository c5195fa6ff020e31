"""vLLM's server habits in `nextn serve`: /tokenize, /detokenize, /version, and the vLLM request
fields, each implemented (include_stop_str_in_output, chat echo, prompt_logprobs) or refused with
a 400 naming it (never silently ignored). A real uvicorn server on loopback over the tiny dense
checkpoint, driven by raw httpx; greedy throughout.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_server import KEY, MODEL, LiveServer, ok, sse_events, user  # noqa: E402

from nextn import LLM  # noqa: E402
from nextn.config.serve import ServeConfig  # noqa: E402
from nextn.server.app import nextn_version  # noqa: E402

GREEDY = {"temperature": 0.0, "ignore_eos": True}
CFG = ServeConfig(api_key=KEY, served_model_name=MODEL)


@pytest.fixture(scope="module")
def llm(dense_ckpt) -> LLM:
    return LLM(model=dense_ckpt, max_model_len=512)


@pytest.fixture(scope="module")
def live(llm):
    with LiveServer(llm, CFG) as srv:
        yield srv


def test_tokenize_detokenize_version(live, llm):
    tok = llm.tokenizer
    text = "Hello, world! How are you today?"
    r = ok(live.post("/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}))
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    chat = ok(live.post("/tokenize", {"messages": [user("Hi")]}))
    assert chat["tokens"] == tok.encode(tok.apply_chat_template([user("Hi")])) and chat.get("token_strs") is None
    assert ok(live.post("/detokenize", {"tokens": r["tokens"]})) == {"prompt": text}
    # the chat prompt round-trips, its special tokens too (they were dropped)
    assert ok(live.post("/detokenize", {"tokens": chat["tokens"]})) == {"prompt": tok.apply_chat_template([user("Hi")])}
    # vLLM's add_special_tokens: known; nextn adds none, so only false is taken
    plain = ok(live.post("/tokenize", {"prompt": text, "add_special_tokens": False}))
    assert plain["tokens"] == r["tokens"]
    special = live.post("/tokenize", {"prompt": text, "add_special_tokens": True})
    assert special.status_code == 400 and special.json()["error"]["param"] == "add_special_tokens"
    assert "not supported" in special.json()["error"]["message"]
    bad = live.post("/detokenize", {"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = live.post("/tokenize", {"prompt": "x", "messages": [user("x")]})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    version = httpx.get(f"{live.url}/version", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert version == {"version": nextn_version()} and version["version"] != "unknown"


def test_include_stop_str_in_output(live):
    body = {"prompt": "Hello, world! How are you today?", "max_tokens": 24, **GREEDY}
    full = ok(live.post("/v1/completions", body))["choices"][0]["text"]
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].strip())
    cut = full[: full.find(stop)]
    plain = ok(live.post("/v1/completions", {**body, "stop": [stop]}))["choices"][0]
    assert plain["text"] == cut and plain["finish_reason"] == "stop"
    kept = ok(live.post("/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": True}))
    assert kept["choices"][0]["text"] == cut + stop
    streamed = sse_events(
        live.post("/v1/completions", {**body, "stop": stop, "include_stop_str_in_output": True, "stream": True})
    )
    assert "".join(e["choices"][0]["text"] for e in streamed) == cut + stop
    # a request that ends on length keeps its text as it is
    no_hit = ok(live.post("/v1/completions", {**body, "stop": ["\x00"], "include_stop_str_in_output": True}))
    assert no_hit["choices"][0]["text"] == full
    # vLLM's stop_reason: the stop string that ended it, streamed and not (left out when nothing did)
    assert plain["stop_reason"] == stop and "stop_reason" not in no_hit["choices"][0]
    assert [e["choices"][0].get("stop_reason") for e in streamed if e["choices"][0]["finish_reason"]] == [stop]


def test_chat_echo_continues_the_assistant_message(live):
    messages = [user("Write a function."), {"role": "assistant", "content": "def fibonacci(n):"}]
    body = {"messages": messages, "add_generation_prompt": False, "max_tokens": 8, **GREEDY}
    plain = ok(live.post("/v1/chat/completions", body))["choices"][0]["message"]["content"]
    echoed = ok(live.post("/v1/chat/completions", {**body, "echo": True}))["choices"][0]["message"]["content"]
    assert echoed == "def fibonacci(n):" + plain
    streamed = sse_events(live.post("/v1/chat/completions", {**body, "echo": True, "stream": True}))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in streamed if e["choices"]) == echoed
    # echo only repeats an assistant message
    user_last = {**body, "messages": [user("Hi")], "add_generation_prompt": True, "echo": True}
    assert not ok(live.post("/v1/chat/completions", user_last))["choices"][0]["message"]["content"].startswith("Hi")


def test_prompt_logprobs(live, llm):
    prompt = "The cache keeps the keys and values"
    ids = llm.tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 1, **GREEDY}
    choice = ok(live.post("/v1/completions", {**body, "prompt_logprobs": 2}))["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for tid, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(tid) in entry and 2 <= len(entry) <= 3  # the top 2, and the prompt token when outside them
        ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
        assert ranks == [1, 2] and all(
            e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values()
        )
    # the same numbers as the echo path's prompt logprobs
    echo = ok(live.post("/v1/completions", {**body, "echo": True, "logprobs": 2}))["choices"][0]["logprobs"]
    assert echo["token_logprobs"][1 : len(ids)] == pytest.approx(
        [entry[str(tid)]["logprob"] for tid, entry in zip(ids[1:], entries[1:], strict=True)]
    )
    assert all(len(t) <= 3 for t in echo["top_logprobs"][1 : len(ids)])  # logprobs=2 (+ the prompt token)
    chat = ok(live.post("/v1/chat/completions", {"messages": [user("Hi")], "max_tokens": 1, "prompt_logprobs": 0}))
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


@pytest.mark.parametrize(
    "field, value",
    [
        ("skip_special_tokens", False),
        ("use_beam_search", True),
        ("bad_words", ["x"]),
        ("allowed_token_ids", [1, 2]),
        ("continue_final_message", True),
    ],
)
def test_unsupported_vllm_fields_are_a_400_naming_them(live, field, value):
    for path, body in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [user("x")], "max_tokens": 2}),
    ):
        r = live.post(path, {**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # at their defaults they are accepted
    default = {"skip_special_tokens": True, "use_beam_search": False}.get(field)
    if default is not None:
        ok(live.post("/v1/completions", {"prompt": "x", "max_tokens": 2, field: default}))


def test_streamed_prompt_logprobs_are_a_400(live):
    r = live.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_stream_options_without_a_stream_are_a_400(live):
    """stream_options on a request that does not stream would do nothing (it was taken silently);
    OpenAI answers 400, and so does nextn, naming it. With a stream it is taken."""
    options = {"include_usage": True}
    for path, body in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [user("x")], "max_tokens": 2}),
    ):
        r = live.post(path, {**body, "stream_options": options})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
        assert live.post(path, {**body, "stream_options": None}).status_code == 200
        assert live.post(path, {**body, "stream": True, "stream_options": options}).status_code == 200


def test_min_tokens_reaches_the_engine(live, monkeypatch):
    """min_tokens is passed through (the engine enforces it); one past max_tokens is a 400 naming it."""
    worker, submitted = live.app.state.server.worker, []
    submit = worker.submit
    monkeypatch.setattr(worker, "submit", lambda job: submitted.append(job.params) or submit(job))
    ok(live.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 3}))
    ok(live.post("/v1/chat/completions", {"messages": [user("x")], "max_tokens": 4, "min_tokens": 2}))
    assert [p.min_tokens for p in submitted] == [3, 2]
    r = live.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_generation_config_defaults_apply_and_a_request_wins(dense_ckpt, tmp_path):
    """A checkpoint whose generation_config.json says do_sample false serves greedy by default; a
    request's own temperature wins over it."""
    model_dir = tmp_path / "greedy_default"
    shutil.copytree(dense_ckpt, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**gen, "do_sample": False, "top_k": 5}))
    with LiveServer(LLM(model=model_dir, max_model_len=512), CFG) as srv:
        worker, submitted = srv.app.state.server.worker, []
        submit = worker.submit
        worker.submit = lambda job: submitted.append(job.params) or submit(job)
        body = {"prompt": "The quick brown fox", "max_tokens": 8, "ignore_eos": True}
        ok(srv.post("/v1/completions", body))
        ok(srv.post("/v1/completions", {**body, "temperature": 0.7, "top_k": 50}))
    assert [(p.temperature, p.top_k) for p in submitted] == [(0.0, 5), (0.7, 50)]


def test_streams_send_prompt_token_ids_on_their_first_chunk(live, llm):
    """return_token_ids streamed: the prompt's ids ride on the first chunk, as vLLM's (they were
    sent only by an echoing completion)."""
    text, common = "Hello, world! How are you today?", {"max_tokens": 4, "return_token_ids": True, **GREEDY}
    for path, body in (("/v1/completions", {"prompt": text}), ("/v1/chat/completions", {"messages": [user(text)]})):
        body = {**body, **common}
        done = ok(live.post(path, body))
        ids = done.get("prompt_token_ids") or done["choices"][0]["prompt_token_ids"]
        events = sse_events(live.post(path, {**body, "stream": True}))
        sent = [e.get("prompt_token_ids") or e["choices"][0].get("prompt_token_ids") for e in events]
        assert sent[0] == ids and not any(sent[1:])
    ids = llm.tokenizer.encode(text)
    echoed = sse_events(live.post("/v1/completions", {**common, "prompt": text, "echo": True, "stream": True}))
    assert echoed[0]["choices"][0]["text"] == text and echoed[0]["choices"][0]["prompt_token_ids"] == ids
    assert not any(e["choices"][0].get("prompt_token_ids") for e in echoed[1:])


def test_continuous_usage_stats(live):
    """vLLM's stream_options.continuous_usage_stats puts the usage so far on every chunk (it was
    taken and ignored, as was any unknown stream_options key)."""
    for path, body in (
        ("/v1/completions", {"prompt": "Hello, world!"}),
        ("/v1/chat/completions", {"messages": [user("Hello")]}),
    ):
        body = {**body, "max_tokens": 5, "stream": True, **GREEDY}
        options = {"include_usage": True, "continuous_usage_stats": True}
        events = sse_events(live.post(path, {**body, "stream_options": options}))
        final = events[-1]["usage"]
        assert events[-1]["choices"] == [] and final["completion_tokens"] == 5
        counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
        assert counts == sorted(counts) and counts[-1] == 5 and len(counts) == len(events) - 1
        assert all(e["usage"]["prompt_tokens"] == final["prompt_tokens"] for e in events)
        assert all(
            e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"] for e in events
        )
        plain = sse_events(live.post(path, {**body, "stream_options": {"include_usage": True}}))
        assert all(e["usage"] is None for e in plain[:-1])
        for options, param in (
            ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
            ({"include_usage": "yes"}, "stream_options.include_usage"),
            ({"include_usag": True}, "stream_options.include_usag"),
        ):
            r = live.post(path, {**body, "stream_options": options})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_and_best_of_on_completions(live):
    """vLLM's n: n choices per prompt, each its own engine request, choice i seeded with seed + i, so
    each equals the request of n=1 with that seed (exact under speculation: the fixture drafts K=3);
    best_of: the n of best_of candidates with the largest cumulative logprob; best_of below n, or
    above it streamed, is a 400 naming it."""
    client = live.client()
    body = dict(model=MODEL, prompt=["The quick brown fox", "def f(x):"], max_tokens=12, temperature=0.8, seed=11)
    r = client.completions.create(n=3, extra_body={"ignore_eos": True}, **body)
    assert [c.index for c in r.choices] == list(range(6)) and r.usage.prompt_tokens < 2 * r.usage.completion_tokens
    again = client.completions.create(n=3, extra_body={"ignore_eos": True}, **body)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    texts = [c.text for c in r.choices]
    assert len(set(texts[:3])) > 1
    for i in range(3):
        alone = client.completions.create(**{**body, "prompt": body["prompt"][0], "seed": 11 + i},
                                          extra_body={"ignore_eos": True})  # fmt: skip
        assert alone.choices[0].text == texts[i]
    best = client.completions.create(
        **{**body, "prompt": body["prompt"][0]}, best_of=3, logprobs=0, extra_body={"ignore_eos": True}
    )
    scored = client.completions.create(**{**body, "prompt": body["prompt"][0]}, n=3, logprobs=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    top = max(scored.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert len(best.choices) == 1 and best.choices[0].text == top.text
    for extra in ({"n": 2, "best_of": 1}, {"n": 2, "best_of": 3, "stream": True}):  # vLLM's 400s too
        bad = live.post("/v1/completions", {"prompt": "x", "max_tokens": 2, **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of", bad.text


def streamed_choices(events: list[dict], n: int) -> tuple[list[list[int]], list[int]]:
    """(each choice's token ids, the choice index of each chunk that has one) of a stream of n."""
    ids: list[list[int]] = [[] for _ in range(n)]
    order = []
    for e in events:
        for c in e["choices"]:
            ids[c["index"]] += c.get("token_ids") or []
            order.append(c["index"])
    return ids, order


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_streamed_and_on_chat_equals_each_seed_alone(live, path):
    """n on streamed completions and on chat, streamed and not: choice i equals the n=1 request with
    seed + i token for token (sampled, the fixture drafting K=3: exact under speculation); streamed
    chunks carry their choice's index and interleave as the choices run together; usage sums the
    choices' tokens and counts the prompt once."""
    head = {"prompt": "The quick brown fox"} if "chat" not in path else {"messages": [user("The quick brown fox")]}
    body = dict(model=MODEL, **head, max_tokens=10, temperature=0.8, seed=5, ignore_eos=True, return_token_ids=True)
    alone = [ok(live.post(path, {**body, "seed": 5 + i})) for i in range(3)]
    alone_ids = [r["choices"][0]["token_ids"] for r in alone]
    assert len(set(map(tuple, alone_ids))) > 1
    whole = ok(live.post(path, {**body, "n": 3}))
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in whole["choices"]] == alone_ids
    prompt_tokens = alone[0]["usage"]["prompt_tokens"]
    assert whole["usage"]["prompt_tokens"] == prompt_tokens and whole["usage"]["completion_tokens"] == 30
    options = {"include_usage": True}
    events = sse_events(live.post(path, {**body, "n": 3, "stream": True, "stream_options": options}))
    ids, order = streamed_choices(events, 3)
    assert ids == alone_ids
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # choice 1 began before choice 0 ended
    finished = [c["index"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert sorted(finished) == [0, 1, 2]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 30
    assert events[-1]["usage"]["prompt_tokens"] == prompt_tokens
