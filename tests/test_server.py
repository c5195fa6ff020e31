"""`nextn serve` end to end: a real uvicorn server on 127.0.0.1 (background thread, pre-bound
socket) over the tiny dense checkpoint, driven by the official `openai` client and raw httpx.

Exactness is checked against a second LLM on the same checkpoint run cold (use_sessions=False):
streamed == non-streamed, concurrent == solo, and resumed / rewound sessions == cold, all greedy.
Every wait is bounded; all traffic stays on loopback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import random
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import hf_fixtures  # noqa: E402

from nextn import LLM, SamplingParams  # noqa: E402
from nextn.config.serve import ServeConfig, ServerOptions  # noqa: E402
from nextn.server.app import GracefulServer, create_app  # noqa: E402

KEY = "test-key"
MODEL = "tiny"
NUM_SPECIAL = len(hf_fixtures.SPECIAL_TOKENS)  # the fixture vocabulary ends with them
GREEDY = {"temperature": 0.0}


class LiveServer:
    def __init__(self, llm: LLM, cfg: ServeConfig, opts: ServerOptions | None = None):
        self.llm = llm
        # proto IPPROTO_TCP, as the sockets uvicorn binds for `nextn serve` (getaddrinfo's): asyncio
        # sets TCP_NODELAY on a connection only then; without it a response's headers and body meet
        # Nagle and the client's delayed ACK, and every request on a kept-alive connection waits 40 ms
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.app = create_app(llm, cfg, opts)
        self.server = GracefulServer(self.app, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def post(self, path: str, body, key: str = KEY, timeout: float = 30) -> httpx.Response:
        """A raw POST: `body` as bytes as they are, or as JSON with non-ASCII escaped (so a lone
        surrogate travels as the \\udXXX escape a client's encoder would write)."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }


@pytest.fixture(scope="module")
def llm(dense_ckpt) -> LLM:
    return LLM(model=dense_ckpt, max_model_len=512)


@pytest.fixture(scope="module")
def cold(dense_ckpt) -> LLM:
    """The reference: the same checkpoint, run without sessions."""
    return LLM(model=dense_ckpt, max_model_len=512)


@pytest.fixture(scope="module")
def live(llm):
    # The module's client reuses its kept-alive connections from test to test, and retries nothing
    # (max_retries=0: no retry hides a failure). A connection reused just as the server's idle timer
    # closes it is reset ("Connection reset by peer": HTTP keep-alive's race, which openai's default
    # client retries); CI met it once on a slow machine. The idle timers here outlast the module.
    opts = ServerOptions(timeout_keep_alive=900, request_read_timeout=900)
    with LiveServer(llm, ServeConfig(api_key=KEY, served_model_name=MODEL), opts) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return live.client()


def cold_ids(cold: LLM, prompt_ids: list[int], max_tokens: int, **kw) -> list[int]:
    return cold.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)).token_ids


def extra(obj, name):
    """A nextn/vLLM extra field of an openai response object."""
    return getattr(obj, name)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---------------------------------------------------------------------------------------------


def test_models_and_health(live, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other")
    assert e.value.code == "model_not_found" and "org/other" in e.value.message
    assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
    assert httpx.head(f"{live.url}/health", timeout=10).status_code == 200  # was 405


def test_chat_completion(client, llm, cold):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[user("Hello, how are you?")],
        max_tokens=12,
        extra_body={"return_token_ids": True},
        **GREEDY,
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    prompt_ids = extra(r, "prompt_token_ids")
    assert u.prompt_tokens == len(prompt_ids) and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert prompt_ids == llm.tokenizer.encode(llm.tokenizer.apply_chat_template([user("Hello, how are you?")]))
    assert extra(choice, "token_ids") == cold_ids(cold, prompt_ids, 12)
    assert u.prompt_tokens_details.cached_tokens >= 0
    spec = extra(u, "spec_decode")
    assert spec["num_draft_tokens"] > 0 and len(spec["accepted_per_position"]) == llm.num_speculative_tokens
    assert spec["num_accepted_tokens"] == sum(spec["accepted_per_position"])
    assert spec["mean_acceptance_length"] >= 1.0


def test_stream_equals_non_streamed(client):
    kw = dict(
        model=MODEL,
        messages=[user("Tell me about the quick brown fox.")],
        max_tokens=20,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20

    prompt = "def fibonacci(n):"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY)
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 16  # the usage chunk, last
    assert all(c.usage is None for c in streamed[:-1])


def test_text_completion_and_logprobs(client, llm, cold):
    prompt = "The cache keeps the keys and values"
    ids = llm.tokenizer.encode(prompt)
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, logprobs=3, **GREEDY)
    by_ids = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, extra_body={"return_token_ids": True}, **GREEDY
    )
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert extra(by_ids.choices[0], "token_ids") == cold_ids(cold, ids, 10)
    lp = by_text.choices[0].logprobs
    n = by_text.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 4 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))

    # lm-eval's loglikelihood request: echo the prompt with its logprobs
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=1, echo=True, **GREEDY)
    elp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(prompt)
    assert len(elp.tokens) == len(ids) + 1 and elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    assert elp.text_offset[0] == 0 and elp.text_offset[len(ids)] == len(prompt)


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[user("Hi")],
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy
    text = bytes(b for t in content if t.token not in hf_fixtures.SPECIAL_TOKENS for b in t.bytes)
    assert text.decode("utf-8", "replace") == r.choices[0].message.content


def test_stop_strings(client):
    kw = dict(
        model=MODEL, prompt="Hello, world! How are you today?", max_tokens=24, extra_body={"ignore_eos": True}, **GREEDY
    )
    full = client.completions.create(**kw).choices[0].text
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].strip())
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.find(stop)]
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_streamed_token_ids_and_offsets_equal_the_non_streamed(live):
    """A token whose text is held back (split UTF-8: the fixture model emits stray bytes; a stop
    string not yet complete) still streams its id and logprobs; text_offset counts each token's
    text, as the non-streamed response does, not the text sent so far."""
    body = {"prompt": "Hello, world! How are you today?", "max_tokens": 16, "return_token_ids": True, **GREEDY}
    tokens = ok(live.post("/v1/completions", {**body, "logprobs": 1}))["choices"][0]["logprobs"]["tokens"]
    stop = tokens[1] + tokens[2]  # held back from the second token on, completed by the third
    for fields in ({}, {"stop": stop}):
        done = ok(live.post("/v1/completions", {**body, **fields, "logprobs": 1}))["choices"][0]
        assert done["finish_reason"] == ("stop" if fields else "length") and len(done["token_ids"]) >= 3
        for logprobs in (None, 1):
            stream = {**body, **fields, "logprobs": logprobs, "stream": True, "stream_options": {"include_usage": True}}
            events = sse_events(live.post("/v1/completions", stream))
            choices = [e["choices"][0] for e in events if e["choices"]]
            ids = [t for c in choices for t in c.get("token_ids") or ()]
            assert ids == done["token_ids"] and events[-1]["usage"]["completion_tokens"] == len(ids)
            if logprobs:
                offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
                assert offsets == done["logprobs"]["text_offset"]
            assert any(c["text"] == "" and c.get("token_ids") for c in choices)  # some text was held back


def test_seeded_sampling_reproduces(client):
    kw = dict(
        model=MODEL,
        prompt="A model reads the prompt",
        max_tokens=12,
        temperature=0.9,
        seed=1234,
        top_p=0.95,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_chat_turns_reuse_the_session_and_equal_cold(client, llm, cold):
    """The checkpoint sits where the conversation ends and the generation prompt starts, so a turn
    whose previous reply re-tokenizes differently (or was rewritten) still resumes from there."""
    tok = llm.tokenizer
    kw = dict(model=MODEL, max_tokens=8, extra_body={"return_token_ids": True}, **GREEDY)
    for reply_edit in (lambda text: text, lambda text: "I rewrote this reply."):
        messages = [{"role": "system", "content": "You are terse."}, user("What is the time?")]
        first = client.chat.completions.create(messages=messages, **kw)
        history = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False))
        messages += [
            {"role": "assistant", "content": reply_edit(first.choices[0].message.content)},
            user("And the date?"),
        ]
        second = client.chat.completions.create(messages=messages, **kw)
        assert second.usage.prompt_tokens_details.cached_tokens >= len(history) > 0
        assert extra(second.choices[0], "token_ids") == cold_ids(cold, extra(second, "prompt_token_ids"), 8)


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab - NUM_SPECIAL) for _ in range(n)]


def test_resumed_and_rewound_sessions_equal_cold(client, llm, cold):
    """Token-level turns through /v1/completions: a resumed turn prefills only its suffix, a rewound
    one restarts from the previous prompt end; both must emit exactly the cold run's tokens."""
    rng = random.Random(7)
    vocab = llm.model.cfg.vocab_size
    body = {"ignore_eos": True, "return_token_ids": True}
    for i in range(4):
        prompt = _random_ids(rng, rng.randrange(8, 90), vocab)
        first = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=rng.randrange(4, 12), extra_body=body, **GREEDY
        )
        generated = extra(first.choices[0], "token_ids")
        if i % 2 == 0:  # resume: the client sends back exactly what it got, then a new turn
            turn = prompt + generated + _random_ids(rng, rng.randrange(1, 20), vocab)
            expect_cached = len(prompt) + len(generated) - 1  # the last token was never fed
        else:  # rewind: the client rewrote the reply (as when it strips a <think> block)
            turn = prompt + generated[:1] + _random_ids(rng, 3, vocab) + _random_ids(rng, 5, vocab)
            expect_cached = len(prompt)
        second = client.completions.create(model=MODEL, prompt=turn, max_tokens=12, extra_body=body, **GREEDY)
        assert second.usage.prompt_tokens_details.cached_tokens == expect_cached
        assert extra(second.choices[0], "token_ids") == cold_ids(cold, turn, 12, ignore_eos=True)


@pytest.mark.parametrize(
    "make_request",
    [
        pytest.param(
            lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}]),
            id="invalid-role",
        ),
        pytest.param(
            lambda c: c.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}
                ],
            ),
            id="image-content",
        ),
        pytest.param(
            lambda c: c.chat.completions.create(model=MODEL, messages=[user("x")], max_tokens=-1),
            id="negative-max-tokens",
        ),
        pytest.param(
            lambda c: c.chat.completions.create(model=MODEL, messages=[user("x")], max_tokens=10**9),
            id="huge-max-tokens",
        ),
        pytest.param(
            lambda c: c.chat.completions.create(model=MODEL, messages=[user("x")], temperature=3.5), id="temperature"
        ),
        pytest.param(lambda c: c.chat.completions.create(model=MODEL, messages=[user("x")], top_p=1.5), id="top-p"),
        pytest.param(lambda c: c.chat.completions.create(model="gpt-4o", messages=[user("x")]), id="unknown-model"),
        pytest.param(lambda c: c.chat.completions.create(model=MODEL, messages=[user("x")], n=65), id="n"),
        pytest.param(lambda c: c.chat.completions.create(model=MODEL, messages=[]), id="no-messages"),
        pytest.param(lambda c: c.completions.create(model=MODEL, prompt="fox " * 600), id="prompt-too-long"),
        pytest.param(lambda c: c.completions.create(model=MODEL, prompt=[1, 2, 10**6]), id="token-out-of-range"),
    ],
)
def test_bad_input_is_a_400(client, make_request):
    with pytest.raises(openai.BadRequestError) as info:
        make_request(client)
    err = info.value.body
    assert set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]


def test_malformed_json_is_a_400_and_the_server_keeps_serving(live, client):
    """The message says what is wrong with the body; `param` names no field (a character offset is none)."""
    whole = json.dumps({"model": MODEL, "messages": [user("Hello there")], "max_tokens": 4}).encode()
    for body, says in (
        (b"{not json", "the body is not valid JSON: Expecting property name enclosed in double quotes at character 1"),
        (whole[:-1], f"the body is not valid JSON: Expecting ',' delimiter at character {len(whole) - 1}"),
        (
            whole[:-12],
            f"the body is not valid JSON: Unterminated string starting at character {whole.rfind(b'max') - 1}",
        ),
        (b"", "the request body is empty"),
    ):
        r = live.post("/v1/chat/completions", body)
        assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
        assert r.json()["error"]["message"] == says and r.json()["error"]["param"] is None, r.text
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2, **GREEDY).choices


CHAT = ("/v1/chat/completions", {"model": MODEL, "messages": [user("x")], "max_tokens": 2})
COMPLETION = ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})


@pytest.mark.parametrize(
    "route, fields, param, says",
    [
        (CHAT, {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        (CHAT, {"logprobs": False, "top_logprobs": 0}, "top_logprobs", "needs logprobs: true"),
        # wrong JSON types are refused, not coerced
        (CHAT, {"max_tokens": True}, "max_tokens", "valid integer"),
        (CHAT, {"max_tokens": "4"}, "max_tokens", "valid integer"),
        (CHAT, {"max_tokens": 4.0}, "max_tokens", "valid integer"),
        (CHAT, {"temperature": "0"}, "temperature", "valid number"),
        (CHAT, {"temperature": False}, "temperature", "valid number"),
        (CHAT, {"stream": "yes"}, "stream", "valid boolean"),
        (CHAT, {"logprobs": "yes"}, "logprobs", "valid boolean"),
        (CHAT, {"n": True}, "n", "valid integer"),
        (COMPLETION, {"logprobs": True}, "logprobs", "valid integer"),
        (COMPLETION, {"echo": 1}, "echo", "valid boolean"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
            "missing",
        ),
        # fields OpenAI documents and nextn does not implement
        (CHAT, {"reasoning_effort": "high"}, "reasoning_effort", "not supported"),
        (CHAT, {"modalities": ["text", "audio"]}, "modalities", 'not supported by this server (send ["text"]'),
        (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "not supported"),
        (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
        (CHAT, {"web_search_options": {}}, "web_search_options", "not supported"),
        (CHAT, {"functions": [{"name": "f"}]}, "functions", "not supported"),
        (CHAT, {"function_call": "auto"}, "function_call", "not supported"),
        (CHAT, {"verbosity": "low"}, "verbosity", "not supported"),
        (COMPLETION, {"logit_bias": {"5": 10}}, "logit_bias", "not supported"),
        (COMPLETION, {"suffix": "x"}, "suffix", "not supported"),
        # a stop id the model cannot emit (the test model's vocabulary is smaller)
        (COMPLETION, {"stop_token_ids": [3, 1_000_000]}, "stop_token_ids", "out of range"),
        (CHAT, {"seed": 2**64}, "seed", "signed 64-bit integer"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "unknown role 'robot'"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(live, route, fields, param, says):
    path, body = route
    r = live.post(path, {**body, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and says in err["message"], err


def test_unknown_fields_are_a_400_and_openai_fields_are_taken(live, client):
    """A misspelled field is refused (it used to leave its default in force: max_tokens ran to the
    context's end); OpenAI's informational fields, integer floats and the assistant message as the
    SDK echoes it back (its null `refusal`, `audio`, ... keys) are taken."""
    for path, body in (CHAT, COMPLETION, ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = live.post(path, {**body, "foo_bar": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "foo_bar", r.text
        assert r.json()["error"]["message"] == "foo_bar: unknown field"
    r = live.post(CHAT[0], {**CHAT[1], "max_token": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_token"
    assert r.json()["error"]["message"] == "max_token: unknown field; did you mean 'max_tokens'?"
    assert live.post(COMPLETION[0], {**COMPLETION[1], "store": True}).json()["error"]["param"] == "store"  # chat's only

    informational = dict(
        user="u-1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        safety_identifier="s-1",
        prompt_cache_key="c-1",
        prompt_cache_retention="24h",
    )
    first = client.chat.completions.create(
        model=MODEL, messages=[user("Hi")], max_tokens=4, temperature=0, top_p=1, **informational
    )
    echoed = first.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= set(echoed)
    second = client.chat.completions.create(
        model=MODEL,
        messages=[user("Hi"), echoed, user("More")],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"reasoning_effort": None, "modalities": ["text"], "use_beam_search": False, "ignore_eos": True},
    )
    assert list(second)[-1].usage.completion_tokens == 4
    assert ok(live.post(COMPLETION[0], {**COMPLETION[1], "user": "u-1", "suffix": "", "logit_bias": {}}))["choices"]


def test_api_key_is_required(live):
    with pytest.raises(openai.AuthenticationError) as info:
        live.client(api_key="wrong").models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    no_key = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"


def test_eight_concurrent_requests_match_their_solo_answers(client, llm, cold):
    prompts = [f"Question {i}: what is {i} plus {i + 3}?" for i in range(8)]
    kw = dict(model=MODEL, max_tokens=16, extra_body={"ignore_eos": True, "return_token_ids": True}, **GREEDY)

    def ask(prompt):
        return client.completions.create(prompt=prompt, **kw)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, prompts, timeout=120))
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = llm.tokenizer.encode(prompt)
        assert extra(answer.choices[0], "token_ids") == cold_ids(cold, ids, 16, ignore_eos=True)
        assert answer.usage.completion_tokens == 16


def _open_stream(live: LiveServer, max_tokens: int) -> tuple[httpx.Client, contextlib.AbstractContextManager]:
    http = httpx.Client(timeout=30)
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return http, http.stream(
        "POST", f"{live.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )


def wait_for(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_cancels_the_work(live, client):
    aborted = live.metrics().get("nextn:request_aborted_total", 0)
    http, stream = _open_stream(live, max_tokens=400)
    with stream as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert got and json.loads(got[-1][6:])["choices"][0]["finish_reason"] is None
    http.close()  # drop the connection mid-stream
    assert wait_for(lambda: live.metrics()["nextn:request_aborted_total"] == aborted + 1)
    assert wait_for(lambda: live.metrics()["nextn:num_requests_running"] == 0)
    assert client.completions.create(model=MODEL, prompt="still there?", max_tokens=3, **GREEDY).choices


def test_disconnect_while_waiting_for_a_full_response_cancels_the_work(live):
    aborted = live.metrics().get("nextn:request_aborted_total", 0)
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    assert wait_for(lambda: live.metrics()["nextn:request_aborted_total"] == aborted + 1)
    assert wait_for(lambda: live.metrics()["nextn:num_requests_running"] == 0)


def test_disconnect_after_a_batch_s_first_prompt_finished_cancels_the_rest(dense_ckpt):
    """A batch of two prompts, the first ending at once on a stop string (the dense fixture's
    greedy text after [5, 9, 11] starts with it; after [14, 9, 11] it never comes): the client
    gone, the second prompt's job is aborted (it ran on to max_tokens, as only the first job
    watched for the disconnect). Ordered by events, not sleeps: once a step has finished the first
    prompt the engine steps no more (the second job cannot end on its own), and only then does the
    client close its connection. The first prompt finishes in a step (a stop string the engine
    found) or through `Engine.stop` (one the API process found: the served path)."""
    llm = LLM(model=dense_ckpt, max_model_len=512)
    step, stop, first_done = llm.engine.step, llm.engine.stop, threading.Event()

    def held_step():
        if first_done.is_set():  # the second job waits for the disconnect (its abort is applied between steps)
            time.sleep(0.01)
            return []
        events = step()
        if any(ev.output is not None for _, ev in events):
            first_done.set()
        return events

    def held_stop(*args, **kwargs):
        first_done.set()  # before the output goes out: no step runs after it
        return stop(*args, **kwargs)

    llm.engine.step, llm.engine.stop = held_step, held_stop
    with LiveServer(llm, ServeConfig(api_key=KEY, served_model_name=MODEL)) as srv:
        body = {"prompt": [[5, 9, 11], [14, 9, 11]], "max_tokens": 480, "stop": ["|"], **GREEDY, "ignore_eos": True}
        content = json.dumps(body).encode()
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(content)}\r\n\r\n"
            conn.sendall(head.encode() + content)
            assert first_done.wait(60)
            stopped = 'nextn:request_success_total{finished_reason="stop"}'
            assert wait_for(lambda: srv.metrics().get(stopped) == 1, timeout=30)  # the first prompt's job
            assert srv.metrics()["nextn:request_aborted_total"] == 0 and srv.app.state.server.worker.num_open == 1
        assert wait_for(lambda: srv.metrics()["nextn:request_aborted_total"] == 1, timeout=30)
        m = srv.metrics()
        assert m[stopped] == 1 and m["nextn:num_requests_running"] == 0
        assert srv.app.state.server.worker.num_open == 0


def test_a_batch_past_the_server_s_capacity_is_a_400(dense_ckpt):
    """A batch of more prompts than slots plus queue could never be admitted: it was a 503 asking to
    retry (its own prompts counted as the load); now a 400 naming the prompt. One that fits runs."""
    llm = LLM(model=dense_ckpt, max_model_len=512, max_num_seqs=2)
    with LiveServer(llm, ServeConfig(api_key=KEY, served_model_name=MODEL, max_queue=1)) as srv:
        body = {"model": MODEL, "max_tokens": 2, **GREEDY}
        r = srv.post("/v1/completions", {**body, "prompt": [[5, 9, 11]] * 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "fewer" in r.text
        r = srv.post("/v1/completions", {**body, "prompt": [[5, 9, 11]] * 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_a_full_queue_answers_503_at_once(dense_ckpt):
    llm = LLM(model=dense_ckpt, max_model_len=512, max_num_seqs=1)
    with LiveServer(llm, ServeConfig(api_key=KEY, served_model_name=MODEL, max_queue=1)) as srv:
        http_a, stream_a = _open_stream(srv, max_tokens=400)
        http_b, stream_b = _open_stream(srv, max_tokens=400)
        with stream_a as a:
            lines_a = a.iter_lines()  # held: dropping the iterator would close the connection
            next(line for line in lines_a if line.startswith("data: "))  # A is running
            with stream_b:  # B is answered 200 at once and waits in the queue for its first token
                assert wait_for(lambda: srv.metrics()["nextn:num_requests_waiting"] == 1)
                t0 = time.monotonic()
                with pytest.raises(openai.InternalServerError) as info:
                    srv.client().completions.create(model=MODEL, prompt="C", max_tokens=2)
                assert info.value.status_code == 503 and time.monotonic() - t0 < 5
        http_a.close()
        http_b.close()
        assert wait_for(
            lambda: (
                srv.metrics()["nextn:num_requests_running"] == 0 and srv.metrics()["nextn:num_requests_waiting"] == 0
            )
        )
        assert srv.metrics()['nextn:request_rejected_total{reason="queue_full"}'] == 1


def test_metrics_expose_spec_and_session_counters(live, llm):
    # its own turns: under xdist the module's other tests may run on the other worker (a resumed
    # turn, cached tokens; then a rewound one)
    client, body = live.client(), {"ignore_eos": True, "return_token_ids": True}
    rng = random.Random(11)
    for rewind in (False, True):
        prompt = _random_ids(rng, 30, llm.model.cfg.vocab_size)
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_body=body, **GREEDY)
        got = extra(first.choices[0], "token_ids")
        turn = prompt + got[:1] + [9, 10, 11] if rewind else prompt + got + [7, 8]
        client.completions.create(model=MODEL, prompt=turn, max_tokens=4, extra_body=body, **GREEDY)
    for _ in range(4):  # and four bad requests
        bad = {"model": MODEL, "prompt": "x", "max_tokens": -1}
        r = httpx.post(f"{live.url}/v1/completions", json=bad, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400
    m = live.metrics()
    assert m["nextn:spec_decode_num_drafts_total"] > 0
    assert m["nextn:spec_decode_num_draft_tokens_total"] >= m["nextn:spec_decode_num_drafts_total"]
    assert "nextn:spec_decode_num_accepted_tokens_total" in m
    for j in range(llm.num_speculative_tokens):
        assert f'nextn:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}' in m
    assert m["nextn:session_lookups_total"] >= m["nextn:session_hits_total"] > 0
    assert m["nextn:session_rewinds_total"] > 0 and m["nextn:prompt_tokens_cached_total"] > 0
    assert m['nextn:request_success_total{finished_reason="length"}'] > 0
    assert m["nextn:generation_tokens_total"] > 0 and m["nextn:prompt_tokens_total"] > 0
    assert m["nextn:time_to_first_token_seconds_count"] > 0 and m["nextn:inter_token_latency_seconds_count"] > 0
    assert m['nextn:request_rejected_total{reason="bad_request"}'] >= 4


def test_metrics_show_batched_rounds(live, client):
    """Concurrent requests share batched rounds: the batch-size histogram shows rounds of several."""
    before = live.metrics()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(
            pool.map(
                lambda i: client.completions.create(model=MODEL, prompt=[5 + i, 9, 11], max_tokens=24, **GREEDY),
                range(4),
            )
        )
    m = live.metrics()
    rounds = m["nextn:batch_size_count"] - before["nextn:batch_size_count"]
    alone = m['nextn:batch_size_bucket{le="1"}'] - before['nextn:batch_size_bucket{le="1"}']
    assert rounds > alone  # some rounds held several requests
    assert m["nextn:batch_size_sum"] - before["nextn:batch_size_sum"] > rounds
    assert m["nextn:num_requests_running"] == 0 and m["nextn:num_requests_waiting"] == 0


def test_health_after_everything(live):
    assert httpx.get(f"{live.url}/health", timeout=10).json() == {"status": "ok"}


def test_max_tokens_0_with_logprobs_scores_the_prompt(live, llm):
    """lm-eval's loglikelihood request, max_tokens 0 with echo and logprobs, lists the prompt's
    logprobs alone (it was a 500: no token, so no logprobs list); chat's logprobs are an empty list."""
    prompt = "The cache keeps the keys and values"
    ids = llm.tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 0, "logprobs": 1, **GREEDY}
    echo = ok(live.post("/v1/completions", {**body, "echo": True}))["choices"][0]
    lp = echo["logprobs"]
    assert echo["text"] == prompt and echo["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    plain = ok(live.post("/v1/completions", body))["choices"][0]
    assert plain["text"] == "" and plain["logprobs"] == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    chat = {"messages": [user("Hi")], "max_tokens": 0, "logprobs": True, "top_logprobs": 2}
    assert ok(live.post("/v1/chat/completions", chat))["choices"][0]["logprobs"] == {"content": []}


def test_metrics_declare_the_type_of_every_sample():
    """Text format 0.0.4 (the Content-Type /metrics sends): a sample's TYPE line names it, a
    counter's `_total` included, as prometheus_client writes it (the TYPE lines named counters
    without it, so a strict parser took every counter for an untyped metric)."""
    from nextn.server.metrics import Metrics

    declared: dict[str, str] = {}
    for line in Metrics(3).render().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            declared[name] = kind
        elif line and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            family = next((name.removesuffix(s) for s in ("_bucket", "_sum", "_count") if name.endswith(s)), name)
            kind = declared.get(name) or declared.get(family)
            assert kind is not None, line
            assert kind != "counter" or name.endswith("_total"), line
    assert declared["nextn:request_success_total"] == "counter"


def test_a_body_not_sent_as_json_says_so(live):
    """`curl -d` sends a JSON body as a form: the 400 names the Content-Type (it said "Input should
    be a valid dictionary", of a body that is one); a JSON body that is no object says that."""
    body = json.dumps(COMPLETION[1]).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(
            f"{live.url}/v1/completions",
            content=body,
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": content_type},
            timeout=30,
        )
        assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text
    for not_an_object in ([COMPLETION[1]], 5, "x"):
        r = live.post("/v1/completions", not_an_object)
        assert r.status_code == 400 and r.json()["error"]["message"] == "the body must be a JSON object", r.text


def test_echoed_logprobs_offsets_never_go_back(live, llm):
    """Echo with logprobs: text_offset counts each token's text from the prompt's first token on
    (vLLM's); the generated tokens' offsets started at the prompt's length instead, behind the
    echoed ones where a character of the prompt is split over tokens (their texts are each "�")."""
    prompt = "a \U0001d518 b"
    ids = llm.tokenizer.encode(prompt)
    assert len(ids) > len(prompt) - 1  # the character is split
    body = {"prompt": prompt, "max_tokens": 3, "logprobs": 0, "echo": True, **GREEDY}
    lp = ok(live.post("/v1/completions", body))["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
