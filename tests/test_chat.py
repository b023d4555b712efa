"""POST /v1/chat/completions and the store behind the server: the official `openai` client over a real socket
(answers, usage, the `sicl` object, reuse across queries, streaming, 400 / 401 / 404 error objects), /v1/calibrate
reusing, the chat rendering (spans = the assistant turns' content tokens, the shape rule) and the stream's deltas.
A tiny random-weight Llama with SmolLM2's tokenizer and chat template; one end-to-end test on SmolLM2."""
from __future__ import annotations

import json
import re
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from sicl_fast import Engine  # noqa: E402
from sicl_fast.answering.chat import StreamCut, render  # noqa: E402
from sicl_fast.errors import RequestError  # noqa: E402
from sicl_fast.scheduler import engine_lock  # noqa: E402
from sicl_fast.serve.server import ServerThread  # noqa: E402
from sicl_fast.serve.settings import ServeSettings  # noqa: E402

KEY = "test-key"
KNOBS = {"max_steps": 3, "N": 4, "tau": 0.0, "patience": 0, "seed": 2}


def conversation(query: str) -> list[dict]:
    return [{"role": "system", "content": "Write each number word as a digit."},
            {"role": "user", "content": "one"}, {"role": "assistant", "content": "1"},
            {"role": "user", "content": "seven"}, {"role": "assistant", "content": "7"},
            {"role": "user", "content": query}]


@pytest.fixture(scope="module")
def engine(tiny_llama, one_thread):
    return Engine(tiny_llama, reuse="auto")


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, ServeSettings(port=0, api_key=KEY, max_new_tokens=8)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def own_answer(engine, query: str, max_new_tokens: int) -> tuple[str, int]:
    """The answer the engine gives this conversation calibrated on its own (no store)."""
    prompt = engine.prepare(render(engine.lm, conversation(query), "ref"), reserve=max_new_tokens)
    res = engine.calibrate(prompt, reuse="off", **KNOBS)
    gen = engine.generate(prompt, res.embeddings, max_new_tokens=max_new_tokens, stop_strings=())
    return gen.answer, len(gen.token_ids)


def test_render_marks_the_assistant_turns_as_output_spans(smol):
    req = render(smol, conversation("five"), "r")
    assert [req.prompt[a:e] for a, e in req.output_spans] == ["1", "7"]
    assert req.prompt.endswith("<|im_start|>assistant\n") and req.prompt[req.demos_start:].startswith("one")
    eng = Engine(smol)
    p = eng.prepare(req)
    assert [smol.tokenizer.decode(p.input_ids[s:e]) for s, e in p.token_spans] == ["1", "7"]
    assert "Write each number" in smol.tokenizer.decode(p.input_ids[:p.demo_start])  # the system turn: the prefix
    dev = [{**conversation("five")[0], "role": "developer"}] + conversation("five")[1:]
    assert render(smol, dev, "d").prompt == req.prompt


def test_the_template_comes_from_the_tokenizer_or_the_gguf_file(smol):
    import copy

    from sicl_fast.answering.chat import chat_template, gguf_chat_template
    from sicl_fast.models import LoadedModel

    assert gguf_chat_template(smol.extra["path"]) == smol.tokenizer.chat_template  # SmolLM2's GGUF carries it
    bare = copy.deepcopy(smol.tokenizer)
    bare.chat_template = None
    from_file = LoadedModel(model=smol.model, tokenizer=bare, name="m", extra={"path": smol.extra["path"]})
    assert chat_template(from_file) == smol.tokenizer.chat_template
    none = LoadedModel(model=smol.model, tokenizer=bare, name="m", extra={})
    with pytest.raises(RequestError, match="has no chat template"):
        render(none, conversation("five"), "r")


@pytest.mark.parametrize("roles", [["user"], ["system", "user", "assistant"], ["user", "user"],
                                   ["assistant", "user"], ["user", "assistant", "assistant", "user"],
                                   ["system", "system", "user", "assistant", "user"], ["user", "tool", "user"]])
def test_render_refuses_other_shapes_in_one_line(smol, roles):
    with pytest.raises(RequestError, match="system message, then alternating user / assistant") as e:
        render(smol, [{"role": r, "content": "x"} for r in roles], "r")
    assert "\n" not in str(e.value)


def test_stream_cut_deltas_add_up_to_the_answer():
    texts = [" ", " 4", " 42", " 42 E", " 42 EN", " 42 ENDING", " 42 ENDING more"]
    cut = StreamCut(["END"])
    sent = "".join(cut.push(t) for t in texts)
    assert sent == "42" and cut.finish("42") == ""
    cut = StreamCut([])
    sent = "".join(cut.push(t) for t in ["a", "ab\ufffd", "abc  "]) + cut.finish("abc")
    assert sent == "abc"


def test_chat_completion_with_the_openai_client(client, engine):
    first = client.chat.completions.create(model="tiny-llama", messages=conversation("five"), max_tokens=4,
                                           extra_body={"sicl": KNOBS})
    assert first.object == "chat.completion" and first.model == "tiny-llama"
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    answer, n = own_answer(engine, "five", 4)
    assert choice.message.content == answer
    assert first.usage.completion_tokens == n and first.usage.total_tokens == first.usage.prompt_tokens + n
    assert first.usage.prompt_tokens == engine.prepare(render(engine.lm, conversation("five"), "r")).length
    sicl = first.model_extra["sicl"]
    assert sicl["reuse"] == "fresh" and sicl["exact"] and sicl["steps"] == 3
    second = client.chat.completions.create(model="tiny-llama", messages=conversation("nine"), max_tokens=4,
                                            extra_body={"sicl": KNOBS})
    s2 = second.model_extra["sicl"]
    assert (s2["reuse"], s2["reused"], s2["key"]) == ("hit", True, sicl["key"])
    assert second.choices[0].message.content == own_answer(engine, "nine", 4)[0]


def test_streaming_returns_the_same_answer_as_chunks(client):
    kw = dict(model="tiny-llama", messages=conversation("three hundred"), max_tokens=6, extra_body={"sicl": KNOBS})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(pieces) >= 2, pieces  # streamed as it is decoded, not sent whole at the end
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["sicl"]["reuse"] == "hit"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_the_sampling_fields_at_their_neutral_values_are_served(client):
    """What front ends send with every request at its neutral value (logprobs false, top_logprobs 0, the penalties
    0, a seed, n 1, temperature 0, top_p 1) is served and changes nothing (before: 'logprobs', the penalties and
    'seed' were 400s, extra inputs); a value greedy decoding does not have is a 400 naming the field."""
    kw = dict(model="tiny-llama", messages=conversation("five"), max_tokens=4, extra_body={"sicl": KNOBS})
    plain = client.chat.completions.create(**kw)
    neutral = client.chat.completions.create(**kw, logprobs=False, top_logprobs=0, presence_penalty=0,
                                             frequency_penalty=0.0, seed=7, n=1, temperature=0, top_p=1)
    assert neutral.choices[0].message.content == plain.choices[0].message.content
    for field, value in (("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("top_logprobs", 2)):
        with pytest.raises(openai.BadRequestError, match=f"field '{field}': only 0 is supported"):
            client.chat.completions.create(**kw, **{field: value})


def test_stopping_fields_reach_the_chat_endpoint(client):
    """The stops of /v1/calibrate through `sicl`: a time budget of 0 ends the calibration after one step, and
    min_delta_rel (a knob) makes patience stop where the paper's rule goes on. Prompts of their own (other seeds):
    a stored calibration would answer without a run."""
    def sicl(**knobs) -> dict:
        r = client.chat.completions.create(model="tiny-llama", messages=conversation("five"), max_tokens=2,
                                           extra_body={"sicl": {**KNOBS, **knobs}})
        return r.model_extra["sicl"]

    cut = sicl(max_steps=5, seed=11, time_budget_s=0)
    assert (cut["stop_reason"], cut["steps"], cut["reused"]) == ("time_budget", 1, False)
    # steps that raise this random model's proxy at every step (at the default step size its changes sit in the last
    # bits, where either rule may stop as the rounding falls)
    ascent = dict(max_steps=12, patience=2, seed=2, eta=1.0, mu=0.05)
    paper = sicl(**ascent)
    rel = sicl(**ascent, min_delta_rel=1e-3)
    assert paper["stop_reason"] == "max_steps" and paper["best_step"] == 11
    assert rel["stop_reason"] == "patience" and rel["steps"] < paper["steps"]
    assert rel["key"] != paper["key"]  # a knob: part of the calibration's key
    with pytest.raises(openai.BadRequestError, match="time_budget_s"):
        sicl(time_budget_s=-1)


def test_openai_error_objects(server, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "five"}])
    assert bad.value.status_code == 400 and "alternating user / assistant" in bad.value.message
    body = bad.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "invalid_request"
    with pytest.raises(openai.BadRequestError, match="only 0 is supported"):
        client.chat.completions.create(model="tiny-llama", messages=conversation("five"), temperature=0.7)
    with pytest.raises(openai.BadRequestError, match="kappa must be < 1"):
        client.chat.completions.create(model="tiny-llama", messages=conversation("five"),
                                       extra_body={"sicl": {"kappa": 2.0}})
    with pytest.raises(openai.BadRequestError, match="field 'max_tokens': 9 exceeds"):
        client.chat.completions.create(model="tiny-llama", messages=conversation("five"), max_tokens=9)
    with pytest.raises(openai.BadRequestError, match="field 'max_completion_tokens': 9 exceeds"):  # it said max_tokens
        client.chat.completions.create(model="tiny-llama", messages=conversation("five"), max_completion_tokens=9)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model="tiny-llama", messages=conversation("five"), logprobs=True)
    # stop strings are checked before the job is queued (before: "" ended the answer of a reused calibration at
    # once, after the whole calibration; a lone surrogate never matched)
    with pytest.raises(openai.BadRequestError, match=r"field 'stop'\[0\]: an empty stop string"):
        client.chat.completions.create(model="tiny-llama", messages=conversation("five"), stop="")
    # a lone surrogate, which the openai client cannot encode: the JSON escape as another client sends it
    body = json.dumps({"model": "tiny-llama", "messages": conversation("five"), "stop": ["\n", "\ud800"]})
    bad = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=60,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert bad.status_code == 400 and "'stop'[1]: is not valid Unicode" in bad.json()["error"]["message"], bad.text
    body = json.dumps({"model": "tiny-llama", "messages": conversation("fi\ud800ve")})
    bad = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=60,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert bad.status_code == 400 and "field 'messages[5].content': is not valid Unicode" in bad.json()["error"][
        "message"], bad.text
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=conversation("five"))
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        wrong.chat.completions.create(model="tiny-llama", messages=conversation("five"))
    assert auth.value.status_code == 401 and auth.value.body["type"] == "authentication_error"


def _post_chat(server, messages, **extra) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny-llama", "messages": messages, **extra})


@pytest.mark.parametrize("turn,needles", [
    ({"role": "user", "content": [{"type": "text", "text": "five "},
                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
     ("messages[5]': content[1] is a part of type 'image_url': images are not supported",)),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]},
     ("content[0] is a part of type 'input_audio': audio is not supported",)),
    ({"role": "user", "content": 5}, ("field 'messages.5.content': Input should be a valid string",)),
    # issue 54 item 4: a text part whose text is no string was "is a part of type 'text'; content must be ... text
    # parts": what it is, said as what is wrong
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, ("messages[5]': content[0].text must be a string, "
                                                                  "got int",)),
])
def test_images_and_other_parts_are_refused_by_name(server, turn, needles):
    """#40: an image part gave `field 'messages.5.content.str': Input should be a valid string (and 3 more)`: the
    schema library's branches, not what is wrong."""
    bad = _post_chat(server, conversation("five")[:5] + [turn])
    msg = bad.json()["error"]["message"]
    assert bad.status_code == 400 and all(n in msg for n in needles), msg
    assert ".str'" not in msg and "list[" not in msg and "more)" not in msg, msg


def test_tool_calls_are_refused_by_name(server):
    """#40: an assistant turn with tool_calls (content null) gave the same branch names; a tool turn a shape error."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    convo = conversation("five")
    with_calls = convo[:4] + [{"role": "assistant", "content": None, "tool_calls": [call]}] + convo[5:]
    bad = _post_chat(server, with_calls)
    msg = bad.json()["error"]["message"]
    assert bad.status_code == 400 and "'messages[4]': an assistant turn with tool_calls: tool calls are not " \
        "supported" in msg, msg
    tool = convo[:5] + [{"role": "tool", "tool_call_id": "c1", "content": "7"}, convo[5]]
    msg = _post_chat(server, tool).json()["error"]["message"]
    assert "'messages[5]': role 'tool': tool calls are not supported" in msg, msg
    named = convo[:1] + [{**convo[1], "name": "ann"}] + convo[2:]  # issue 48: the name was dropped without a word
    msg = _post_chat(server, named).json()["error"]["message"]
    assert "field 'messages[1].name': participant names are not supported (the model's chat template renders roles " \
           "only, so the name would be dropped)" in msg, msg


def test_calibrate_endpoint_reuses(server, engine):
    req = {"id": "c1", "instruction": "Write each number word as a digit.",
           "demos": [{"input": "one", "output": "1"}, {"input": "four", "output": "4"}], "query": "five"}
    headers = {"Authorization": f"Bearer {KEY}"}
    bodies = [httpx.post(server.url + "/v1/calibrate", headers=headers, timeout=120,
                         json={"request": {**req, "query": q}, "config": KNOBS, "reuse": "auto",
                               "generate": True, "max_new_tokens": 3}).json() for q in ("five", "six")]
    assert [b["reuse"]["reuse"] for b in bodies] == ["fresh", "hit"]
    ref = engine.calibrate(engine.prepare({**req, "query": "six"}), reuse="off", **KNOBS)
    assert bodies[1]["summary"]["best_proxy"] == ref.best_proxy and bodies[1]["history"] == ref.history
    off = httpx.post(server.url + "/v1/calibrate", headers=headers, timeout=120,
                     json={"request": req, "config": KNOBS, "reuse": "off"}).json()
    assert off["summary"]["steps"] == 3  # a run without the store says so too (issue 48: the key was absent)
    assert off["reuse"] == {"reused": False, "reuse": "off", "key": None, "exact": True}


@pytest.mark.slow
def test_chat_end_to_end_on_smollm2(smol, one_thread):
    """The real model and its own chat template: a calibrated answer, then a second query answered from the
    stored calibration."""
    with ServerThread(Engine(smol, reuse="auto"), ServeSettings(port=0)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        sicl = {"max_steps": 2, "N": 2, "tau": 0.0}
        got = [client.chat.completions.create(model=smol.name, messages=conversation(q), max_tokens=4,
                                              extra_body={"sicl": sicl}) for q in ("five", "nine")]
    assert [g.choices[0].message.content for g in got] == ["5", "9"]
    assert [g.model_extra["sicl"]["reuse"] for g in got] == ["fresh", "hit"]
    assert all(g.choices[0].finish_reason == "stop" for g in got)
    assert json.loads(got[1].model_dump_json())["sicl"]["exact"] is True


# ---------------------------------------------------------------- the scheduler behind the server (issue 52)


class Pause:
    """Holds the server's scheduler after its n-th decoding unit (in its observer's hook, outside every lock) until
    released: a request can then join, disconnect or be drained at a known token."""

    def __init__(self, metrics, after: int) -> None:
        self.real, self.after = metrics.decoded, after
        self.rows: list[int] = []
        self.paused, self.release = threading.Event(), threading.Event()

    def __call__(self, rows: int, tokens: int, seconds: float) -> None:
        self.real(rows, tokens, seconds)
        self.rows.append(rows)
        if len(self.rows) == self.after:
            self.paused.set()
            self.release.wait(60)


def ask(client, query: str, stream: bool = False, max_tokens: int = 8) -> str:
    kw = dict(model="tiny-llama", messages=conversation(query), max_tokens=max_tokens, extra_body={"sicl": KNOBS})
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                   if c.choices)


def in_threads(fns) -> list:
    out = [None] * len(fns)
    threads = [threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f())) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    return threads, out


def wait_for(cond, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


def test_concurrent_clients_decode_together_with_their_answers_alone(server, client, engine, monkeypatch):
    """Six clients (three streaming) on one stored calibration are answered in one batch, each with the answer it
    gets alone; /metrics has the batch's figures."""
    sched, metrics = server.app.state.serve.scheduler, server.app.state.serve.metrics
    queries = ["five", "nine", "forty two", "seven hundred", "x", "one one one"]
    alone = {q: ask(client, q) for q in queries}  # one at a time: the first stores the calibration
    seen = Pause(metrics, after=0)  # records each decoding unit's rows
    monkeypatch.setattr(metrics, "decoded", seen)
    with engine_lock(engine):  # every request is in before the first token
        threads, out = in_threads([lambda q=q, s=s: ask(client, q, s) for q, s in zip(queries, [0, 1] * 3)])
        wait_for(lambda: sched.depth + sched.in_flight == len(queries))
    for t in threads:
        t.join(60)
    assert dict(zip(queries, out)) == alone
    assert max(seen.rows) == len(queries)  # one batch
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("sicl_fast_batch_size_bucket", "sicl_fast_generated_tokens_total", "sicl_fast_tokens_per_second",
                 "sicl_fast_batch_seconds_bucket", "sicl_fast_queue_wait_seconds_bucket", "sicl_fast_in_flight",
                 "sicl_fast_batch_rows"):
        assert name in text, name
    assert re.search(r'^sicl_fast_batch_size_bucket\{le="4.0"\} (\S+)$', text, re.M)[1] != re.search(
        r"^sicl_fast_batch_size_count (\S+)$", text, re.M)[1]  # a unit of more than 4 rows


def test_a_request_joins_a_running_batch_over_http(server, client, monkeypatch):
    """A request that arrives while another decodes joins its batch at the next token; both answers are theirs
    alone."""
    sched, metrics = server.app.state.serve.scheduler, server.app.state.serve.metrics
    first, second = "three hundred", "twelve"
    alone = {q: ask(client, q) for q in (first, second)}
    pause = Pause(metrics, after=2)
    monkeypatch.setattr(metrics, "decoded", pause)
    threads, out = in_threads([lambda: ask(client, first)])
    assert pause.paused.wait(60)  # the first has decoded two tokens
    more, out2 = in_threads([lambda: ask(client, second, stream=True)])
    wait_for(lambda: sched.depth == 1)
    pause.release.set()
    for t in threads + more:
        t.join(60)
    assert (out[0], out2[0]) == (alone[first], alone[second])
    assert pause.rows[:2] == [1, 1] and 2 in pause.rows[2:]  # decoded together from the third token


def test_a_disconnected_stream_leaves_its_batch(server, client, engine, monkeypatch):
    """A streaming client that goes away mid-answer cancels its request: its row leaves the batch at the next token,
    the others decode on to the answers they get alone."""
    sched, metrics = server.app.state.serve.scheduler, server.app.state.serve.metrics
    queries = ["six", "eight"]
    alone = {q: ask(client, q) for q in queries}
    pause = Pause(metrics, after=2)
    monkeypatch.setattr(metrics, "decoded", pause)
    body = {"model": "tiny-llama", "messages": conversation("four"), "max_tokens": 8, "stream": True,
            "sicl": KNOBS}
    hangup, streaming = threading.Event(), threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as reply:
            next(reply.iter_lines())  # the role's chunk: admitted
            streaming.set()
            hangup.wait(60)  # then the client goes away

    with engine_lock(engine):  # the three are in before the first token
        threads, out = in_threads([lambda q=q: ask(client, q) for q in queries] + [stream])
        wait_for(lambda: sched.depth + sched.in_flight == 3)
    assert pause.paused.wait(60) and streaming.wait(60)
    tickets = list(sched._open)
    hangup.set()
    wait_for(lambda: any(t.cancelled for t in tickets))
    pause.release.set()
    for t in threads:
        t.join(60)
    assert dict(zip(queries, out)) == alone
    wait_for(lambda: sched.in_flight == 0 and not sched.busy)
    assert sum(t.cancelled for t in tickets) == 1 and all(t.done for t in tickets)
    assert pause.rows[1:3] == [3, 2]  # all three in the paused unit, the next one without it


def test_a_deadline_stops_only_its_own_calibration(engine):
    """A calibration that would run for ever stops at its own deadline with the best X so far; answers decoding
    meanwhile and a calibration waiting behind it are unchanged."""
    headers = {"Authorization": f"Bearer {KEY}"}
    req = {"id": "d1", "instruction": "Copy the word.", "demos": [{"input": "a", "output": "a"},
                                                                  {"input": "b", "output": "b"}], "query": "c"}
    knobs = {"max_steps": 3, "N": 4, "tau": 0.0, "seed": 4}
    ref = engine.calibrate(engine.prepare(req), reuse="off", **knobs)
    long = {"request": req, "reuse": "off", "timeout_s": 1.0,
            "config": {"max_steps": 100_000, "patience": 0, "tau": 0.0, "N": 4}}
    with ServerThread(engine, ServeSettings(port=0, api_key=KEY, max_new_tokens=8, max_steps=100_000)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        alone = {q: ask(client, q) for q in ("five", "nine")}
        calls = [lambda: httpx.post(srv.url + "/v1/calibrate", json=long, headers=headers, timeout=60).json(),
                 lambda: httpx.post(srv.url + "/v1/calibrate", json={"request": req, "reuse": "off",
                                                                     "config": knobs},
                                    headers=headers, timeout=60).json()]
        first, out = in_threads(calls[:1])
        wait_for(lambda: srv.app.state.serve.scheduler.work.running is not None)
        second, out2 = in_threads(calls[1:])  # it waits for the calibration slot
        answers = {q: ask(client, q) for q in ("five", "nine")}
        assert first[0].is_alive()  # answered while the calibration ran
        for t in first + second:
            t.join(60)
    assert answers == alone
    assert out[0]["summary"]["stop_reason"] == "deadline" and out[0]["summary"]["steps"] >= 1
    assert out2[0]["summary"]["stop_reason"] == "max_steps" and out2[0]["history"] == ref.history


def test_sigterm_drains_the_batch_in_flight(engine, monkeypatch):
    """The drain (what SIGTERM does) lets the answers in flight decode to their stop (200) and answers the request
    still waiting for a row with the 503."""
    with ServerThread(engine, ServeSettings(port=0, api_key=KEY, max_new_tokens=8, max_batch_rows=1)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        alone = ask(client, "two")
        metrics = srv.app.state.serve.metrics
        pause = Pause(metrics, after=2)
        monkeypatch.setattr(metrics, "decoded", pause)
        threads, out = in_threads([lambda: ask(client, "two")])
        assert pause.paused.wait(60)
        later, late = in_threads([lambda: _post_chat(srv, conversation("ten"), max_tokens=8, sicl=KNOBS)])
        wait_for(lambda: srv.app.state.serve.scheduler.depth == 1)  # no row for it: it waits
        srv.server.drain.request()
        wait_for(lambda: late[0] is not None)
        pause.release.set()
        for t in threads + later:
            t.join(60)
        srv.thread.join(30)
    assert out[0] == alone
    assert late[0].status_code == 503 and late[0].json()["error"]["kind"] == "shutting_down"
    assert not srv.thread.is_alive()


def test_an_answer_over_a_batch_limit_is_refused_before_its_calibration(engine):
    """An answer that exceeds --max-batch-tokens by itself is refused before the request is queued: the chat
    endpoint's 400 (streaming too: before the stream begins) and /v1/calibrate's 422, each naming the flag, with no
    calibration step run. Before, the calibration ran first, then a chat stream that had begun with a 200 ended in
    an error event (a 422 without streaming)."""
    fresh = [{**conversation("five")[0], "content": "Spell the digit."}] + conversation("five")[1:]
    with ServerThread(engine, ServeSettings(port=0, api_key=KEY, max_new_tokens=64, max_batch_tokens=40)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match=r"exceed this server's limit of 40 \(--max-batch-tokens\)"):
            client.chat.completions.create(model="tiny-llama", messages=fresh, max_tokens=64,
                                           extra_body={"sicl": KNOBS})
        r = _post_chat(srv, fresh, max_tokens=64, stream=True, sicl=KNOBS)
        assert r.status_code == 400 and "--max-batch-tokens" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/calibrate", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"request": {"id": "g", "instruction": "Spell the digit.", "query": "five",
                                         "demos": [{"input": "one", "output": "1"}]},
                             "config": KNOBS, "generate": True, "max_new_tokens": 64})
        assert r.status_code == 422 and "(--max-batch-tokens)" in r.json()["error"]["message"]
        assert srv.app.state.serve.metrics.steps._value.get() == 0  # no calibration ran for them
        assert client.chat.completions.create(model="tiny-llama", messages=fresh, max_tokens=8,
                                              extra_body={"sicl": KNOBS}).usage.completion_tokens <= 8  # it fits


def test_a_calibration_over_a_batch_limit_is_the_chat_endpoints_400(engine):
    """A calibration that exceeds --max-batch-bytes by itself (refused as it is queued, before any step) is, on the
    chat endpoint, the 400 every other bad request there is (docs/openai.md), streaming or not; it was a 422."""
    fresh = [{**conversation("five")[0], "content": "Spell the number."}] + conversation("five")[1:]
    with ServerThread(engine, ServeSettings(port=0, api_key=KEY, max_new_tokens=8, max_batch_bytes=500_000)) as srv:
        for stream in (False, True):
            r = _post_chat(srv, fresh, max_tokens=4, stream=stream, sicl=KNOBS)
            assert r.status_code == 400, r.text
            assert "exceed this server's limit of 500000 (--max-batch-bytes)" in r.json()["error"]["message"]
