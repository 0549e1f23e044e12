"""The reference engine's OpenAI surface, driven by the official ``openai`` client against the real
``coldsnap-reference-engine`` process (``python -m coldsnap_engines.reference.server``) on the tiny
model: chat and completions, streamed and not, stop strings, usage, the refused parameters (400
naming each), an unknown model (404), and ColdSnap's own validation probe, whose replies must not
change. The stream-failure case runs the same serving handler in-process over a real engine whose
decoding fails part-way."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from engines_testlib import REPO, free_port, make_reference_model  # noqa: E402

sys.path.insert(0, str(REPO / "runtime_image" / "activation"))
from coldsnap_activation import probes  # noqa: E402

SERVED = "reference-tiny"
PROMPT = "ColdSnap says:"
# The tiny model's greedy reply to the validation prompt (recorded in
# tests/fixtures/artifacts/reference-tiny-n610.json): the OpenAI surface must not change it.
REPLY16 = "2VD{D{DDDDDDDDDD"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / SERVED
    make_reference_model(d)
    return d


@pytest.fixture(scope="module", params=[False, True], ids=["one-process", "engine-core-process"])
def server(model_dir, tmp_path_factory, request):
    """The real engine process on the tiny model: its port. Also in the vLLM V1 shape
    (``--engine-core-process``: HTTP here, the model in a child), which must answer the same."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "runtime_image" / "integrations"),
                                         env.get("PYTHONPATH", "")])
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "coldsnap_engines.reference.server", "--model",
                                 str(model_dir), "--port", str(port), "--device", "cpu",
                                 *(["--engine-core-process"] if request.param else [])],
                                env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(REPO))
    try:
        try:
            probes.wait_http_ready("127.0.0.1", port, "/health", timeout=120, alive=lambda: proc.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}: {log.read_text()[-3000:]}") from exc
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", max_retries=0, timeout=60)


def _raw(port: int, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _events(raw: bytes) -> list:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            data = line[6:]
            out.append(None if data == b"[DONE]" else json.loads(data))
    return out


def _complete(client, prompt: str = PROMPT, **kw) -> str:
    return client.completions.create(model=SERVED, prompt=prompt, max_tokens=kw.pop("max_tokens", 16), **kw
                                     ).choices[0].text


# ------------------------------------------------------------------ models, the validation probe
def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [SERVED]


def test_validation_probe_and_plain_clients_get_the_recorded_reply(client, server):
    done = probes.stream_completion("127.0.0.1", server, model=SERVED, prompt=PROMPT, max_tokens=16)
    assert done.text == REPLY16 and done.first_ns > 0 and done.logprobs is None
    assert probes.stream_completion("127.0.0.1", server, model="", prompt=PROMPT, max_tokens=16).text == REPLY16
    status, body = _raw(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16})  # no model, no options
    assert status == 200 and json.loads(body)["choices"][0]["text"] == REPLY16
    assert _complete(client, temperature=0) == REPLY16
    # A stream is one chunk per token, then a finish chunk, then [DONE].
    events = _events(_raw(server, "/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 4,
                                                      "stream": True})[1])
    assert [e["choices"][0]["text"] for e in events[:-1]] == [*REPLY16[:4], ""]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] is None


# ------------------------------------------------------------------------------ completions
def test_completions_usage_and_a_list_of_prompts(client):
    r = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16)
    assert r.object == "text_completion" and r.model == SERVED
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (15, 16, 31)

    other = _complete(client, "Hello", max_tokens=8)
    r = client.completions.create(model=SERVED, prompt=[PROMPT, "Hello"], max_tokens=8)
    assert [(c.index, c.text) for c in r.choices] == [(0, REPLY16[:8]), (1, other)]
    assert r.usage.prompt_tokens == 15 + 6 and r.usage.completion_tokens == 16


def test_n_is_honoured_with_identical_greedy_choices(client):
    r = client.completions.create(model=SERVED, prompt=[PROMPT, "Hello"], max_tokens=4, n=2)
    hello = _complete(client, "Hello", max_tokens=4)
    assert [(c.index, c.text) for c in r.choices] == [(0, REPLY16[:4]), (1, REPLY16[:4]), (2, hello), (3, hello)]
    assert r.usage.completion_tokens == 16


@pytest.mark.parametrize("stop, want", [("{D", "2VD"), (["DDD", "{"], "2VD"), (["zz", "D{DD"], "2VD{"),
                                        ("2V", "")])
def test_stop_truncates_before_the_stop_string(client, stop, want):
    r = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, stop=stop)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    stops = [stop] if isinstance(stop, str) else stop
    # Decoding ends at the token that completes the first stop string seen.
    assert r.usage.completion_tokens == min(REPLY16.find(s) + len(s) for s in stops if s in REPLY16)
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_never_seen_changes_nothing(client):
    r = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, stop=["D{DX", "zz"])
    assert r.choices[0].text == REPLY16 and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, stop="D{DX", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == REPLY16  # held-back text released at the end


def test_streamed_completions_with_usage(client):
    chunks = list(client.completions.create(model=SERVED, prompt=[PROMPT, "Hello"], max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    usage = chunks[-1]
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (21, 10)
    by_index: dict[int, str] = {}
    finish = {}
    for c in chunks[:-1]:
        assert c.usage is None
        ch = c.choices[0]
        by_index[ch.index] = by_index.get(ch.index, "") + ch.text
        if ch.finish_reason:
            finish[ch.index] = ch.finish_reason
    assert by_index == {0: REPLY16[:5], 1: _complete(client, "Hello", max_tokens=5)}
    assert finish == {0: "length", 1: "length"}


# ------------------------------------------------------------------------------------- chat
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
TEMPLATED = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_chat_applies_the_documented_template(client):
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=12)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0]
    assert msg.message.role == "assistant" and msg.finish_reason == "length"
    assert msg.message.content == _complete(client, TEMPLATED, max_tokens=12)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(TEMPLATED) + 1, 12)
    parts = client.chat.completions.create(model=SERVED, messages=[
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Hi"}], max_completion_tokens=12)
    assert parts.choices[0].message.content == msg.message.content


def test_chat_streams_deltas_then_finish_then_usage(client, server):
    full = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=10).choices[0].message.content
    chunks = list(client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-2].choices[0].finish_reason == "stop" or chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    stopped = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=10, stop=full[3:5])
    assert stopped.choices[0].message.content == full[:full.index(full[3:5])]
    assert stopped.choices[0].finish_reason == "stop"
    raw = _raw(server, "/v1/chat/completions", {"model": SERVED, "messages": MESSAGES, "max_tokens": 3,
                                                "stream": True})[1]
    assert raw.endswith(b"data: [DONE]\n\n")


# ---------------------------------------------------------------------------------- refusals
REFUSED_COMPLETIONS = [("echo", True), ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("best_of", 2), ("suffix", "!"),
                       ("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"65": 10}),
                       ("temperature", 0.7), ("top_p", 0), ("n", 17), ("stop", ["a", "b", "c", "d", "e"]),
                       ("tools", [{"type": "function"}]), ("max_tokens", 0), ("prompt", [1, 2, 3])]


@pytest.mark.parametrize("param, value", REFUSED_COMPLETIONS)
def test_completions_refuse_what_they_do_not_implement(client, param, value):
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 4, param: value}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**{k: v for k, v in body.items() if k in ("model", "prompt")},
                                  extra_body={k: v for k, v in body.items() if k not in ("model", "prompt")})
    e = err.value
    assert e.status_code == 400 and e.param == param and param in e.message
    assert e.body["type"] == "invalid_request_error"


REFUSED_CHAT = [("logprobs", True), ("top_logprobs", 2), ("presence_penalty", 1), ("logit_bias", {"65": 1}),
                ("temperature", 1), ("response_format", {"type": "json_object"}),
                ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto")]


@pytest.mark.parametrize("param, value", REFUSED_CHAT)
def test_chat_refuses_what_it_does_not_implement(client, param, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=4, extra_body={param: value})
    assert err.value.param == param and param in err.value.message


def test_no_op_values_of_unimplemented_parameters_are_accepted(client):
    r = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, echo=False, best_of=1, suffix="",
                                  presence_penalty=0, frequency_penalty=0, logit_bias={}, temperature=0,
                                  top_p=1, seed=7, user="u")
    assert r.choices[0].text == REPLY16


def test_chat_refuses_tool_messages_and_images(client):
    for messages in ([{"role": "tool", "content": "x", "tool_call_id": "1"}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=SERVED, messages=messages, max_tokens=4)
        assert err.value.param == "messages"


def test_an_unknown_model_is_a_404_model_not_found(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    status, body = _raw(server, "/v1/completions", {"model": "nope", "prompt": PROMPT})
    assert status == 404
    assert json.loads(body) == {"error": {"message": json.loads(body)["error"]["message"],
                                          "type": "invalid_request_error", "param": "model",
                                          "code": "model_not_found"}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_context_overflow_is_a_400_before_any_stream(client, server, stream):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SERVED, prompt=["ok", "x" * 1020], max_tokens=8, stream=stream)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=1000, stream=stream)
    assert err.value.param == "messages"
    status, body = _raw(server, "/v1/completions", {"prompt": "x" * 1020, "max_tokens": 8, "stream": True})
    assert status == 400 and b"data:" not in body


# ------------------------------------------------------------------ log-probabilities
def test_completions_logprobs_stream_and_not_agree_and_describe_greedy_decoding(client, server):
    r = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == REPLY16 and "".join(lp.tokens) == REPLY16
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 16
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(16)]
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # greedy: the chosen token is the step's most likely one; log-probabilities are <= 0
        assert len(top) == 3 and top[chosen] == value == max(top.values()) and value <= 0
    streamed = probes.stream_completion("127.0.0.1", server, model="", prompt=PROMPT, max_tokens=16, logprobs=3)
    assert streamed.text == REPLY16 and len(streamed.logprobs) == 16
    as_records = [{"token": t, "logprob": v, "top": sorted([k, x] for k, x in top.items())}
                  for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)]
    assert probes.logprobs_digest(streamed.logprobs) == probes.logprobs_digest(as_records)
    # the same request twice: the same values, bit for bit
    again = probes.stream_completion("127.0.0.1", server, model="", prompt=PROMPT, max_tokens=16, logprobs=3)
    assert probes.logprobs_digest(again.logprobs) == probes.logprobs_digest(streamed.logprobs)
    zero = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2, logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs == [{}, {}]


def test_logprobs_with_stop_is_refused_naming_logprobs(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, logprobs=2, stop=["D"])
    assert err.value.param == "logprobs" and "stop" in err.value.message


@pytest.fixture
def in_process_engine(model_dir):
    """A real engine in this process, served by the real handler: its weights can be changed."""
    from coldsnap_engines.common.lifecycle import Lifecycle
    from coldsnap_engines.reference.control import ReferenceControl
    from coldsnap_engines.reference.engine import Engine
    from coldsnap_engines.reference.server import _Server, make_serving_handler
    from coldsnap_engines.reference.transport import Transport

    engine = Engine(model_dir, device="cpu", rank=0, world=1, served_model_name=SERVED)
    engine.start(Transport(rank=0, world=1, device="cpu", endpoint_file=None, scope="local"))
    lifecycle = Lifecycle(ReferenceControl(engine))
    lifecycle.mark_ready()
    httpd = _Server(("127.0.0.1", 0), make_serving_handler(engine, lifecycle))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield engine, httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_one_wrong_extent_keeps_the_reply_but_changes_the_logprobs_digest(in_process_engine):
    """What the acceptance check is for: a hydration that got one 4 KiB extent of one weight wrong
    (here: the lowest mantissa bit of every value in it flipped) still replies the accepted text,
    and only the log-probabilities tell."""
    import torch

    engine, port = in_process_engine
    before = probes.stream_completion("127.0.0.1", port, model="", prompt=PROMPT, max_tokens=16, logprobs=5)
    name, weight = max(engine.loaded.weights.items(), key=lambda nt: nt[1].numel())
    as_int = {2: torch.int16, 4: torch.int32}[weight.element_size()]
    extent = weight.view(-1)[: 4096 // weight.element_size()].view(as_int)
    extent ^= 1
    after = probes.stream_completion("127.0.0.1", port, model="", prompt=PROMPT, max_tokens=16, logprobs=5)
    assert after.text == before.text == REPLY16, name
    assert probes.logprobs_digest(after.logprobs) != probes.logprobs_digest(before.logprobs), name
    extent ^= 1  # put the bits back: the values come back exactly
    restored = probes.stream_completion("127.0.0.1", port, model="", prompt=PROMPT, max_tokens=16, logprobs=5)
    assert probes.logprobs_digest(restored.logprobs) == probes.logprobs_digest(before.logprobs)


# ------------------------------------------------------------------ a failure while streaming
@pytest.fixture
def failing_server(in_process_engine):
    """The serving handler in-process over a real engine whose decoding fails after 3 tokens."""
    engine, port = in_process_engine
    real = engine._generate

    def failing(ids, max_tokens, emit=None, logprobs=None):
        seen: list = []

        def counted(text, *lp):
            seen.append(text)
            if len(seen) > 3:
                raise RuntimeError("decoder fault")
            return emit(text, *lp)
        return real(ids, max_tokens, counted if emit else None, logprobs)

    engine._generate = failing
    return port


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_a_failure_while_streaming_sends_an_error_event_then_done(failing_server, path, body):
    status, raw = _raw(failing_server, path, {"model": SERVED, "max_tokens": 8, "stream": True, **body})
    events = _events(raw)
    assert status == 200 and events[-1] is None
    assert events[-2]["error"]["type"] == "server_error" and "decoder fault" in events[-2]["error"]["message"]
    assert all("choices" in e for e in events[:-2]) and len(events) > 2

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{failing_server}/v1", api_key="unused", max_retries=0)
    create = client.completions.create if "prompt" in body else client.chat.completions.create
    with pytest.raises(openai.APIError, match="decoder fault"):
        list(create(model=SERVED, max_tokens=8, stream=True, **body))
    # Not streamed: a 500 with an error body.
    with pytest.raises(openai.InternalServerError):
        create(model=SERVED, max_tokens=8, **body)
