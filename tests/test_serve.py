"""`sicl-fast serve`: the real server (uvicorn on a free loopback port, in a thread) with a tiny random-weight model.

Every endpoint, the auth, every limit, 429 under a full queue, deadline, cancellation (queued and running), bad
JSON, bad spans, deep nesting, non-JSON bodies, an oversized body, a crash inside a job, one connection surviving
every error reply, and the embeddings round trip bit for bit; the drain on SIGTERM / SIGINT of a `sicl-fast serve`
process (real signals, real sockets).
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import sicl_fast  # noqa: E402
from sicl_fast import Calibrator, Engine  # noqa: E402
from sicl_fast.commands.cli import main  # noqa: E402
from sicl_fast.serve.client import Client, QueueFullError, ServerError  # noqa: E402
from sicl_fast.errors import RequestError, SiclError  # noqa: E402
from sicl_fast.formats.requests import parse_request  # noqa: E402
from sicl_fast.serve.server import ServerThread  # noqa: E402
from sicl_fast.serve.settings import ServeSettings, check_bind, is_loopback  # noqa: E402
from sicl_fast.scheduler import engine_lock  # noqa: E402

REQ = {"id": "q1", "instruction": "Write each number word as a digit.",
       "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"}], "query": "five"}
# runs until its deadline (or cancellation): no gate, no patience, a huge step budget
LONG = {"max_steps": 100_000, "patience": 0, "tau": 0.0}
LIMITS = dict(max_queue=1, max_body_bytes=256 * 1024, max_tokens=300, max_steps=100_000, max_n=16, max_new_tokens=16)


@pytest.fixture(scope="module")
def engine(tiny_llama, one_thread):
    return Engine(tiny_llama)


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, ServeSettings(port=0, **LIMITS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url) as c:
        yield c


@pytest.fixture(autouse=True)
def idle(request):
    """Each test starts with the engine idle (a previous test's long jobs have ended)."""
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        wait_for(lambda: not srv.app.state.serve.scheduler.busy and srv.app.state.serve.scheduler.depth == 0, 30)


def wait_for(cond, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """Run fn(*args) on a thread; the dict gets its result under 'r'."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=fn(*args)))
    t.start()
    return t, out


def metric(client: Client, name: str, **labels) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = re.compile(
        rf"^{re.escape(name)}(?:\{{{re.escape(want)}\}})? (\S+)$" if want else rf"^{re.escape(name)} (\S+)$", re.M
    )
    m = pat.search(client.metrics())
    return float(m.group(1)) if m else 0.0


JSON = {"Content-Type": "application/json"}


def post(server, path: str, body=None, content: bytes | None = None, headers=JSON, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=60, **kw)


def error_of(r: httpx.Response) -> dict:
    """The error object's own fields (kind, message, status), after checking the OpenAI ones every error carries."""
    err = dict(r.json()["error"])
    assert err["status"] == r.status_code and "Traceback" not in err["message"]
    assert err.pop("code") == err["kind"] and err.pop("param") is None and isinstance(err.pop("type"), str)
    return err


def raw_http(server, head: str, body: bytes = b"", close_after: float | None = None) -> bytes:
    """Send a hand-made HTTP/1.1 request on a raw socket. close_after: hang up after that many seconds without
    reading (a client going away); else read the reply."""
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(head.encode() + body)
    if close_after is not None:
        time.sleep(close_after)
        s.close()
        return b""
    s.settimeout(30)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return data


def calibrate_head(server, body: bytes) -> str:
    return (f"POST /v1/calibrate HTTP/1.1\r\nHost: {server.url[7:]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")


# ---------------------------------------------------------------- endpoints


def test_health_models_openapi(server, client, engine):
    assert client.health() == {"status": "ok", "model": "tiny-llama", "queue_depth": 0, "busy": False, "in_flight": 0}
    (m,) = client.models()
    assert m["id"] == "tiny-llama" and m["family"] == "llama" and m["context"] == 512 and m["d"] == 32
    assert m["preset"]["N"] == 8 and m["preset"]["max_steps"] == 250
    spec = httpx.get(server.url + "/openapi.json").json()
    assert spec["info"]["version"] == sicl_fast.__version__  # read from the install, not from the package's __init__
    assert {"/health", "/v1/models", "/metrics", "/v1/proxy", "/v1/calibrate"} <= set(spec["paths"])
    ref = spec["paths"]["/v1/calibrate"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body_schema = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"request", "config", "generate", "return_embeddings", "timeout_s"} <= set(body_schema["properties"])
    assert "max_steps" in spec["components"]["schemas"]["CalibrationKnobs"]["properties"]
    assert httpx.get(server.url + "/docs").status_code == 200


def test_proxy_matches_the_engine(client, engine):
    r = client.proxy(REQ)
    prompt = engine.prepare(REQ)
    out = engine.proxy(prompt)
    assert r["id"] == "q1" and r["num_demos"] == 2
    assert (r["proxy"], r["C"], r["R"], r["G"]) == (float(out.f[0]), float(out.C[0]), float(out.R[0]), float(out.G[0]))
    assert r["c"] == [float(x) for x in out.c[0]]
    assert r["token_spans"] == [list(s) for s in prompt.token_spans]
    assert r["prompt"]["demo_start"] == prompt.demo_start and r["prompt"]["length"] == prompt.length
    # the weights of the proxy are knobs too
    r2 = client.proxy(REQ, alpha=1.0, beta=0.0, gamma=0.0)
    assert r2["proxy"] == pytest.approx(r2["C"], rel=1e-6)


def test_calibrate_answers_and_embeddings_bit_for_bit(client, engine):
    knobs = dict(max_steps=4, tau=0.0, seed=3, N=4)
    r = client.calibrate(REQ, generate=True, max_new_tokens=6, stop=[], return_embeddings=True,
                         embeddings_rows="all", **knobs)
    prompt = engine.prepare(REQ)
    cfg = engine.config(**knobs)
    ref = Calibrator(engine.backend, cfg).run(prompt)
    s = r["summary"]
    assert (s["steps"], s["best_step"], s["stop_reason"], s["gated"]) == (ref.steps, ref.best_step, "max_steps", False)
    assert s["best_proxy"] == ref.best_proxy and r["history"] == ref.history
    assert r["config"]["N"] == 4 and r["config"]["seed"] == 3
    emb = r["embeddings"]
    assert (emb.row_start, emb.row_end, emb.model, emb.id) == (0, prompt.length, "tiny-llama", "q1")
    assert emb.rows.dtype == torch.float32 and torch.equal(emb.rows, ref.embeddings)
    assert torch.equal(emb.input_ids, prompt.input_ids)
    base = engine.generate(prompt, max_new_tokens=6, stop_strings=())
    cal = engine.generate(prompt, ref.embeddings, max_new_tokens=6, stop_strings=())
    assert r["answers"] == {"base": base.answer, "calibrated": cal.answer}
    assert r["timing"]["engine_s"] > 0
    # the default rows [a, b), in bf16: the same values rounded once
    r16 = client.calibrate(REQ, return_embeddings=True, embeddings_dtype="bfloat16", **knobs)["embeddings"]
    a, b = prompt.demo_start, prompt.demo_end
    assert (r16.row_start, r16.row_end) == (a, b) and r16.rows.dtype == torch.bfloat16
    assert torch.equal(r16.rows, ref.embeddings[a:b].to(torch.bfloat16))


def test_calibrate_raw_request_and_default_id(server, engine):
    text = "Input: one\nOutput: 1\n\nInput: two\nOutput: 2\n\nInput: six\nOutput:"
    raw = {"prompt": text, "output_spans": [[19, 20], [40, 41]]}
    r = post(server, "/v1/calibrate", {"request": raw, "config": {"max_steps": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == r.headers["x-request-id"]  # no id given: the server's request id
    assert r.json()["prompt"]["token_spans"] == [list(s) for s in engine.prepare({**raw, "id": "x"}).token_spans]


def test_metrics(client):
    client.calibrate(REQ, max_steps=2, tau=0.0)
    text = client.metrics()
    for name in ("sicl_fast_requests_total", "sicl_fast_errors_total", "sicl_fast_request_seconds_bucket",
                 "sicl_fast_queue_depth", "sicl_fast_engine_busy", "sicl_fast_queue_wait_seconds_bucket",
                 "sicl_fast_batch_seconds_bucket", "sicl_fast_calibration_steps_total", "sicl_fast_steps_per_second"):
        assert name in text, name
    assert metric(client, "sicl_fast_requests_total", endpoint="/v1/calibrate", status="200") >= 1
    assert metric(client, "sicl_fast_calibration_steps_total") >= 2
    assert metric(client, "sicl_fast_steps_per_second") > 0


# ---------------------------------------------------------------- bad input: 4xx, one line, never a 500


def test_bad_json_and_bad_bodies(server, client):
    before = metric(client, "sicl_fast_errors_total", kind="bad_json")
    r = post(server, "/v1/calibrate", content=b'{"request": ')
    assert r.status_code == 400 and error_of(r)["kind"] == "bad_json"
    r = post(server, "/v1/proxy", content=b'{"request": {"id": "x"}, "config": {"mu": NaN}}')
    assert r.status_code == 400 and "NaN is not valid JSON" in error_of(r)["message"]
    assert metric(client, "sicl_fast_errors_total", kind="bad_json") == before + 2
    cases = [
        ([1, 2], "field 'body'"),
        ({"config": {}}, "field 'request': Field required"),
        ({"request": REQ, "bogus": 1}, "request 'q1': field 'bogus': Extra inputs are not permitted"),
        ({"request": REQ, "config": {"N": "8"}}, "request 'q1': field 'config.N': Input should be a valid integer"),
        ({"request": REQ, "config": {"nope": 1}}, "field 'config.nope': Extra inputs"),
        ({"request": REQ, "config": {"mu": -1.0}}, "request 'q1': field 'config': CalibrationConfig: mu must be > 0"),
        ({"request": REQ, "timeout_s": 0}, "field 'timeout_s'"),
        ({"request": REQ, "embeddings_dtype": "float16"}, "field 'embeddings_dtype'"),
        ({"request": {**REQ, "demos": []}}, "request 'q1': field 'demos': no demonstrations"),
    ]
    for body, msg in cases:
        r = post(server, "/v1/calibrate", body)
        assert r.status_code == 422, (body, r.text)
        assert msg in error_of(r)["message"], (msg, r.text)


@pytest.mark.parametrize("raw", [
    {"id": "s1", "prompt": "Input: a\nOutput: b", "output_spans": [[17, 30]]},              # outside the prompt
    {"id": "s2", "prompt": "Input: a\nOutput: b", "output_spans": [[5, 5]]},                # empty
    {"id": "s3", "prompt": "Input: a\nOutput: bc", "output_spans": [[17, 19], [18, 19]]},   # overlapping
    {"id": "s4", "prompt": "Input: a\nOutput: b", "output_spans": [[17, "x"]]},             # not integers
    {"id": "s5", "prompt": "Input: a\nOutput: b", "output_spans": [[17, 18]], "demos_start": -1},
])
def test_bad_spans_get_the_cli_message(server, raw):
    with pytest.raises(RequestError) as cli:
        parse_request(raw)
    for path in ("/v1/proxy", "/v1/calibrate"):
        r = post(server, path, {"request": raw})
        assert r.status_code == 422 and error_of(r) == {"kind": "invalid_request", "message": str(cli.value),
                                                        "status": 422}


def test_span_sharing_a_token_gets_the_tokenizer_message(server, engine):
    raw = {"id": "t1", "prompt": "Input: a\nOutput: seventeen", "output_spans": [[17, 20], [20, 26]]}
    with pytest.raises(SiclError) as cli:
        engine.prepare(raw)
    r = post(server, "/v1/calibrate", {"request": raw})
    assert r.status_code == 422 and error_of(r)["message"] == str(cli.value)


def test_not_found_and_wrong_method(server):
    r = httpx.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and error_of(r)["kind"] == "not_found"
    r = httpx.get(server.url + "/v1/calibrate")
    assert r.status_code == 405 and error_of(r)["kind"] == "method_not_allowed"


def nested(levels: int) -> bytes:
    """A body nested exactly `levels` deep (its 'stop' is a list in a list ...; the schema refuses it: 422)."""
    inner = levels - 1  # the outer object is one level
    return json.dumps({"request": REQ, "stop": "?"}).replace('"?"', "[" * inner + "]" * inner).encode()


def test_deep_nesting_is_a_400_before_parsing(server):
    r = post(server, "/v1/calibrate", content=b"[" * 200_000)  # a RecursionError inside json.loads before
    assert r.status_code == 400 and error_of(r) == {
        "kind": "bad_json", "status": 400, "message": "body: JSON nested too deeply (200000 levels; at most 64)"}
    assert post(server, "/v1/calibrate", content=nested(64)).status_code == 422  # parsed, then refused by the schema
    r = post(server, "/v1/calibrate", content=nested(65))
    assert r.status_code == 400 and "(65 levels; at most 64)" in error_of(r)["message"]
    # brackets inside strings are text, escaped quotes included
    r = post(server, "/v1/proxy", {"request": {**REQ, "id": '[[\\"[[', "query": "[" * 80 + '\\"' + "{" * 80}})
    assert r.status_code == 200, r.text


def test_only_json_bodies(server):
    """A web page can POST text/plain, form and typeless (Blob) bodies to a loopback server without a CORS preflight:
    all are refused before any work; JSON (which needs the preflight) is accepted."""
    body = json.dumps({"request": REQ}).encode()
    for ctype in (None, "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "application/json; charset=latin-1", "application/jsonl"):
        r = post(server, "/v1/proxy", content=body, headers={"Content-Type": ctype} if ctype else {})
        err = error_of(r)
        assert r.status_code == 415 and err["kind"] == "unsupported_media_type", (ctype, r.text)
        assert "send JSON with 'Content-Type: application/json'" in err["message"]
        assert (f"Content-Type {ctype!r} is not accepted" if ctype else "no Content-Type given") in err["message"]
    for ctype in ("application/json", "Application/JSON; charset=UTF-8"):
        assert post(server, "/v1/proxy", content=body, headers={"Content-Type": ctype}).status_code == 200, ctype


def test_one_connection_survives_every_error_reply(server, engine, monkeypatch):
    """After a 4xx and after a 500 (a bug outside a job, and inside one) the same keep-alive connection serves the
    next request: no exception reaches uvicorn, which would drop the connection."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    ends = set()

    def ask(method: str, path: str, body: bytes = b"", ctype: str | None = "application/json") -> tuple[int, dict]:
        conn.request(method, path, body=body, headers={"Content-Type": ctype} if ctype else {})
        r = conn.getresponse()
        data = json.loads(r.read())
        ends.add(conn.sock.getsockname())  # a second address: the client had to reconnect
        return r.status, data

    good = json.dumps({"request": REQ}).encode()

    def boom(*a, **k):
        raise RuntimeError("simulated bug")

    for method, path, body, ctype, status in [
        ("POST", "/v1/proxy", good, "text/plain", 415),
        ("POST", "/v1/proxy", b"{", "application/json", 400),
        ("POST", "/v1/proxy", b"[" * 200_000, "application/json", 400),
        ("POST", "/v1/proxy", b'{"request": {}}', "application/json", 422),
        ("GET", "/v2/nothing", b"", None, 404),
    ]:
        assert ask(method, path, body, ctype)[0] == status, (path, body[:20])
    for where in ("prepare", "proxy"):  # before the queue (tokenizing), and inside the job
        monkeypatch.setattr(engine, where, boom)
        status, data = ask("POST", "/v1/proxy", good)
        assert status == 500 and data["error"]["kind"] == "internal" and "simulated" not in data["error"]["message"]
        monkeypatch.undo()
    status, data = ask("POST", "/v1/proxy", good)
    assert status == 200 and data["id"] == "q1"
    assert len(ends) == 1  # one connection all along
    conn.close()


# ---------------------------------------------------------------- limits


def test_caps_on_steps_n_new_tokens(server, engine):
    for body, field, flag in [
        ({"request": REQ, "config": {"max_steps": 100_001}}, "config.max_steps", "--max-steps"),
        ({"request": REQ, "config": {"N": 17}}, "config.N", "--max-n"),
        ({"request": REQ, "generate": True, "max_new_tokens": 17}, "max_new_tokens", "--max-new-tokens"),
    ]:
        r = post(server, "/v1/calibrate", body)
        err = error_of(r)
        assert r.status_code == 422 and err["kind"] == "limit"
        assert f"request 'q1': field '{field}'" in err["message"] and flag in err["message"]
    # issue 48: generate without max_new_tokens was refused about its default (32 > --max-new-tokens 16), which the
    # client never sent; the default is capped now, as the chat endpoint caps max_tokens
    r = post(server, "/v1/calibrate", {"request": raw_of_length(engine, 285, "cap"), "generate": True})
    assert r.status_code == 422 and "285 tokens plus 16 tokens to generate" in error_of(r)["message"]
    r = post(server, "/v1/calibrate", {"request": REQ, "generate": True, "config": {"max_steps": 1}})
    assert r.status_code == 200 and set(r.json()["answers"]) == {"base", "calibrated"}


def test_a_port_in_use_is_one_line_before_the_model_loads(server, capsys, monkeypatch):
    """Issue 48: `serve` on a port in use printed its URL, loaded the model, then exited 3 (uvicorn's code, not in
    the exit-code table)."""
    monkeypatch.setattr("sicl_fast.engine.load", lambda *a, **k: pytest.fail("the model loaded"))
    port = server.url.rsplit(":", 1)[1]
    assert main(["serve", "--port", port]) == 2
    assert capsys.readouterr().err == (f"sicl-fast serve: error: cannot listen on 127.0.0.1:{port}: in use (another "
                                       "server?); choose another --port or --host\n")


def raw_of_length(engine, n: int, rid: str) -> dict:
    """A raw request of exactly n tokens (one demonstration, then filler words)."""
    def length(text):
        return len(engine.lm.tokenizer(text, add_special_tokens=False)["input_ids"])

    head = "Input: a\nOutput: b"
    raw = {"id": rid, "prompt": head + " a" * (n - length(head)), "output_spans": [[17, 18]]}
    assert length(raw["prompt"]) == n
    return raw


def test_prompt_token_limits(server, engine):
    r = post(server, "/v1/proxy", {"request": raw_of_length(engine, 301, "big")})  # > --max-tokens 300
    err = error_of(r)
    assert r.status_code == 422 and err["kind"] == "limit"
    assert "request 'big': field 'prompt': 301 tokens" in err["message"] and "--max-tokens" in err["message"]
    assert post(server, "/v1/proxy", {"request": raw_of_length(engine, 300, "fits")}).status_code == 200
    r = post(server, "/v1/proxy", {"request": raw_of_length(engine, 513, "huge")})  # > the model's 512 context
    err = error_of(r)
    assert r.status_code == 422 and err["kind"] == "context_length" and "context of 512" in err["message"]
    # the tokens to generate count too
    body = {"request": raw_of_length(engine, 290, "gen"), "generate": True, "max_new_tokens": 11,
            "config": {"max_steps": 1}}
    r = post(server, "/v1/calibrate", body)
    assert r.status_code == 422 and "290 tokens plus 11 tokens to generate" in error_of(r)["message"]
    assert post(server, "/v1/calibrate", {**body, "max_new_tokens": 10}).status_code == 200


def test_oversized_body(server, client):
    before = metric(client, "sicl_fast_errors_total", kind="body_too_large")
    big = json.dumps({"request": {**REQ, "query": "x" * 270_000}}).encode()
    r = post(server, "/v1/calibrate", content=big)  # declared by Content-Length
    assert r.status_code == 413 and "--max-body-bytes" in error_of(r)["message"]
    # streamed without a Content-Length (chunked): cut off while reading
    r = httpx.post(server.url + "/v1/calibrate", content=iter([big[i:i + 8192] for i in range(0, len(big), 8192)]),
                   headers=JSON, timeout=30)
    assert r.status_code == 413
    # a huge declared length is refused before anything is read
    reply = raw_http(
        server, calibrate_head(server, b"x" * 10).replace("Content-Length: 10", "Content-Length: 999999999")
    )
    assert reply.startswith(b"HTTP/1.1 413")
    assert metric(client, "sicl_fast_errors_total", kind="body_too_large") == before + 3


# ---------------------------------------------------------------- concurrency


def test_queue_full_gives_429_with_retry_after(server, client):
    results = {}

    def run(name):
        try:
            results[name] = client.calibrate(REQ, timeout_s=1.5, **LONG)["summary"]["stop_reason"]
        except ServerError as exc:
            results[name] = exc

    t1 = threading.Thread(target=run, args=("running",))
    t1.start()
    wait_for(lambda: server.app.state.serve.scheduler.busy, 10)
    t2 = threading.Thread(target=run, args=("waiting",))
    t2.start()
    wait_for(lambda: server.app.state.serve.scheduler.depth == 1, 10)
    assert client.health()["queue_depth"] == 1 and metric(client, "sicl_fast_queue_depth") == 1
    t0 = time.monotonic()
    with pytest.raises(QueueFullError) as exc:
        client.calibrate(REQ, max_steps=1)
    assert time.monotonic() - t0 < 1.0  # immediate, not after the queue drains
    assert exc.value.status == 429 and exc.value.retry_after >= 1 and "--max-queue 1" in exc.value.message
    r = post(server, "/v1/proxy", {"request": REQ})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    t1.join(30), t2.join(30)
    assert results == {"running": "deadline", "waiting": "deadline"}
    # a streaming chat completion is refused before its stream begins: here two arrive while a calibration runs;
    # the second is refused by the check before its body is read when the first already waits, else (both passed
    # it) by the scheduler, which admits neither (one calibration at a time) and keeps the first waiting
    t1 = threading.Thread(target=run, args=("running",))
    t1.start()
    wait_for(lambda: server.app.state.serve.scheduler.busy, 10)
    chat = {"model": "tiny-llama", "stream": True, "max_tokens": 2, "sicl": {"max_steps": 1},
            "messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"},
                         {"role": "user", "content": "two"}]}
    with engine_lock(server.app.state.serve.engine):  # both are in before the calibration's next step
        streams = [in_thread(post, server, "/v1/chat/completions", chat) for _ in range(2)]
        wait_for(lambda: server.app.state.serve.scheduler.depth + sum("r" in out for _, out in streams) == 2, 10)
    for t, _ in streams:
        t.join(30)
    t1.join(30)
    replies = sorted((out["r"] for _, out in streams), key=lambda r: r.status_code)
    assert [r.status_code for r in replies] == [200, 429] and int(replies[1].headers["retry-after"]) >= 1
    assert replies[1].headers["content-type"] == "application/json" and "--max-queue 1" in error_of(replies[1])[
        "message"]
    assert replies[0].text.endswith("data: [DONE]\n\n")


def test_deadline_returns_the_best_so_far(client, engine):
    t0 = time.monotonic()
    r = client.calibrate(REQ, timeout_s=0.4, return_embeddings=True, embeddings_rows="all", seed=5, **LONG)
    elapsed = time.monotonic() - t0
    s = r["summary"]
    assert s["stop_reason"] == "deadline" and 1 <= s["steps"] < 100_000 and elapsed < 10
    assert s["best_proxy"] == max(r["history"])
    # the X returned is the best of the steps run: the same run with max_steps = steps gives it bit for bit
    ref = Calibrator(engine.backend, engine.config(seed=5, **{**LONG, "max_steps": s["steps"]})).run(
        engine.prepare(REQ)
    )
    assert ref.history == r["history"] and torch.equal(r["embeddings"].rows, ref.embeddings)


def test_time_budget_and_min_delta(server, client):
    """time_budget_s beside timeout_s (seconds of calibration, not from arrival): 0 runs one step; min_delta is a
    config knob like the others; both are checked with the CLI's ranges (a 422 naming the field)."""
    r = client.calibrate(REQ, time_budget_s=0, seed=5, **LONG)
    assert r["summary"]["stop_reason"] == "time_budget" and r["summary"]["steps"] == 1
    r = client.calibrate(REQ, max_steps=9, patience=2, tau=0.0, min_delta=1.0)
    assert r["summary"]["stop_reason"] == "patience" and r["summary"]["steps"] == 3 and r["config"]["min_delta"] == 1
    for body, msg in (({"time_budget_s": -1}, "field 'time_budget_s'"),
                      ({"config": {"min_delta": 2.0}}, "min_delta must be <= 1.0")):
        r = post(server, "/v1/calibrate", {"request": REQ, **body})
        assert r.status_code == 422 and msg in error_of(r)["message"], r.text


def test_should_stop_hook(engine):
    asked = []

    def stop():
        asked.append(1)
        return "deadline" if len(asked) == 3 else None

    res = Calibrator(engine.backend, engine.config(max_steps=50, patience=0, tau=0.0)).run(engine.prepare(REQ),
                                                                                         should_stop=stop)
    assert res.stop_reason == "deadline" and res.steps == 3 and len(res.history) == 3
    assert res.best_proxy == max(res.history)


def test_client_disconnect_cancels_running_job(server, client):
    before = metric(client, "sicl_fast_errors_total", kind="cancelled")
    body = json.dumps({"request": REQ, "timeout_s": 120, "config": LONG}).encode()
    raw_http(server, calibrate_head(server, body), body, close_after=0.5)  # starts the job, then hangs up
    wait_for(lambda: metric(client, "sicl_fast_errors_total", kind="cancelled") == before + 1, 10)
    wait_for(lambda: not server.app.state.serve.scheduler.busy, 10)
    steps = metric(client, "sicl_fast_calibration_steps_total")
    time.sleep(0.3)
    assert metric(client, "sicl_fast_calibration_steps_total") == steps  # the engine really stopped
    assert client.calibrate(REQ, max_steps=1)["summary"]["steps"] == 1


def test_client_disconnect_cancels_queued_job(server, client):
    done = metric(client, "sicl_fast_batch_seconds_count", job="calibrate")
    cancelled = metric(client, "sicl_fast_errors_total", kind="cancelled")
    t = threading.Thread(target=lambda: client.calibrate(REQ, timeout_s=1.5, **LONG))
    t.start()
    wait_for(lambda: server.app.state.serve.scheduler.busy, 10)
    body = json.dumps({"request": REQ, "timeout_s": 120, "config": LONG}).encode()
    raw_http(server, calibrate_head(server, body), body, close_after=0.4)  # queued behind it, then gone
    t.join(30)
    wait_for(lambda: metric(client, "sicl_fast_errors_total", kind="cancelled") == cancelled + 1, 10)
    wait_for(lambda: not server.app.state.serve.scheduler.busy and server.app.state.serve.scheduler.depth == 0, 10)
    # only the first job ever held the engine
    assert metric(client, "sicl_fast_batch_seconds_count", job="calibrate") == done + 1


def test_requests_beyond_max_connections_get_the_json_503(engine, monkeypatch):
    release = threading.Event()  # the engine is held until the over-limit requests have been answered
    proxy = engine.proxy
    monkeypatch.setattr(engine, "proxy", lambda *a, **k: (release.wait(30), proxy(*a, **k))[1])
    with ServerThread(engine, ServeSettings(port=0, max_connections=2)) as srv:
        waiting = [in_thread(post, srv, "/v1/proxy", {"request": REQ}) for _ in range(2)]  # one runs, one waits
        sched = srv.app.state.serve.scheduler
        wait_for(lambda: sched.depth + sched.in_flight == 2, 10)
        try:
            for r in (post(srv, "/v1/proxy", {"request": REQ}), httpx.get(srv.url + "/health")):
                err = error_of(r)
                assert r.status_code == 503 and err["kind"] == "overloaded" and "--max-connections 2" in err["message"]
                assert r.headers["retry-after"] == "1"
        finally:
            release.set()
        for t, out in waiting:
            t.join(30)
            assert out["r"].status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200


@pytest.mark.parametrize("how", ["grace period over", "second signal"])
def test_a_job_running_past_the_grace_period_gets_a_503(engine, monkeypatch, how):
    """A job that cannot stop (a proxy forward) is answered 503 when the grace period ends, or at once on a second
    signal; then the server exits."""
    monkeypatch.setattr(engine, "proxy", lambda *a, **k: time.sleep(3))
    srv = ServerThread(engine, ServeSettings(port=0, grace_s=0.3 if how == "grace period over" else 60)).start()
    t, out = in_thread(post, srv, "/v1/proxy", {"request": REQ})
    wait_for(lambda: srv.app.state.serve.scheduler.busy, 10)
    if how == "second signal":
        srv.server.drain.request()
    srv.shutdown(timeout=30)  # (another) SIGTERM
    t.join(30)
    assert not srv.thread.is_alive()
    r = out["r"]
    err = error_of(r)
    assert r.status_code == 503 and err["kind"] == "shutting_down" and "before this request finished" in err["message"]
    assert r.headers["connection"] == "close"


def test_crash_inside_a_job_leaves_the_server_up(server, client, engine, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("simulated failure inside the engine")

    monkeypatch.setattr(engine, "proxy", boom)
    r = post(server, "/v1/proxy", {"request": REQ})
    err = error_of(r)
    assert r.status_code == 500 and err["kind"] == "internal" and r.headers["x-request-id"] in err["message"]
    assert "simulated" not in err["message"]  # details stay in the server log
    monkeypatch.undo()
    assert client.proxy(REQ)["id"] == "q1" and client.health()["status"] == "ok"


# ---------------------------------------------------------------- auth and bind rule


def test_api_key(engine):
    with ServerThread(engine, ServeSettings(port=0, api_key="s3cret")) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200  # liveness needs no key
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/proxy"),
                             ("POST", "/v1/calibrate")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
                r = httpx.request(method, srv.url + path, headers=headers, content=b"not even json")
                assert r.status_code == 401 and error_of(r)["kind"] == "unauthorized", (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
        with Client(srv.url, api_key="s3cret") as c:
            assert c.models()[0]["id"] == "tiny-llama"
            assert c.proxy(REQ)["num_demos"] == 2
            assert "sicl_fast_errors_total" in c.metrics()
        with Client(srv.url, api_key="nope") as c, pytest.raises(ServerError) as exc:
            c.proxy(REQ)
        assert exc.value.status == 401


def test_bind_rule():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.8.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.1.2.3") and not is_loopback("h")
    with pytest.raises(SiclError, match="refusing to listen on '0.0.0.0' without an API key"):
        check_bind(ServeSettings(host="0.0.0.0"))
    check_bind(ServeSettings(host="0.0.0.0", api_key="k"))
    check_bind(ServeSettings(host="0.0.0.0", insecure_public=True))
    for bad in (dict(max_queue=-1), dict(max_body_bytes=0), dict(max_n=0), dict(api_key=" "), dict(port=70000),
                dict(grace_s=-1.0), dict(grace_s=float("nan"))):
        with pytest.raises(SiclError):
            ServeSettings(**bad)


def test_cli_serve_refuses_public_bind_without_key(capsys, monkeypatch):
    monkeypatch.delenv("SICL_FAST_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refusing to listen" in err[0] and "--insecure-public" in err[0]


def test_without_the_extra_package_imports_and_serve_says_what_to_install():
    blocked = "fastapi uvicorn starlette pydantic httpx prometheus_client".split()
    code = ("import sys\n"
            f"for m in {blocked!r}: sys.modules[m] = None\n"
            "import sicl_fast, sicl_fast.commands.cli, sicl_fast.answering.export, sicl_fast.serve\n"
            "sys.exit(sicl_fast.commands.cli.main(['serve']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "sicl-fast[serve]"' in lines[0]


class CliServer:
    """`sicl-fast serve ARGS` in a process of its own on a free loopback port; its stderr collected line by line."""

    def __init__(self, *args: str, env: dict | None = None, script: str | None = None) -> None:
        """script: Python source run instead of the CLI, with argv [port, *args]."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        cmd = ([sys.executable, "-c", script, str(self.port), *args] if script else
               [sys.executable, "-m", "sicl_fast.cli", "serve", "--port", str(self.port), "--threads", "1", *args])
        self.proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                     stderr=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_ready(self, timeout: float = 120) -> CliServer:
        end = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                assert time.monotonic() < end, "server did not start"
                time.sleep(0.3)

    def wait(self) -> int:
        """The exit status (the log is complete afterwards)."""
        rc = self.proc.wait(60)
        self.reader.join(10)
        return rc

    def __enter__(self) -> CliServer:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def calibrate_on(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/calibrate", json=body, timeout=60)


def assert_clean(log: str) -> None:
    for bad in ("Traceback", "CancelledError", "Exception in ASGI", "timeout graceful shutdown"):
        assert bad not in log, log


def test_sigterm_drains_and_exits_0(tiny_dir):
    """SIGTERM with a running and a queued request: new requests get the JSON 503 with Retry-After, the queued job
    the JSON 503 without running, the running one finishes (here at its own deadline); the process exits 0. Each
    request has its log line."""
    with CliServer("--model", tiny_dir, "--max-steps", "100000", "--grace-s", "30", "--log-level",
                   "info") as srv:
        running, out_run = in_thread(calibrate_on, srv.url, {"request": {**REQ, "id": "run"}, "timeout_s": 6,
                                                             "config": LONG})
        wait_for(lambda: srv.health()["busy"], 30)
        queued, out_queued = in_thread(calibrate_on, srv.url, {"request": {**REQ, "id": "wait"},
                                                               "config": {"max_steps": 1}})
        wait_for(lambda: srv.health()["queue_depth"] == 1, 30)
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "shutting down" in srv.log, 10)
        late = [httpx.post(srv.url + "/v1/proxy", json={"request": REQ}, timeout=30), httpx.get(srv.url + "/health")]
        running.join(60), queued.join(60)
        rc = srv.wait()
    assert rc == 0, srv.log
    for r in late:
        err = error_of(r)
        assert r.status_code == 503 and err["kind"] == "shutting_down" and "takes no new work" in err["message"]
        assert int(r.headers["retry-after"]) >= 1 and r.headers["connection"] == "close"
    r = out_queued["r"]
    assert r.status_code == 503 and "still queued and did not run" in error_of(r)["message"]
    r = out_run["r"]
    assert r.status_code == 200, r.text
    s = r.json()["summary"]
    assert s["stop_reason"] == "deadline" and s["steps"] >= 1
    assert_clean(srv.log)
    assert "1 request(s) waiting to be admitted answered 503" in srv.log
    line = re.search(r"request \w+ 127\.0\.0\.1:\d+ POST /v1/calibrate 200 (\S+)s id='run' steps=(\d+) "
                     r"proxy=(\S+)->(\S+) stop='deadline'", srv.log)
    assert line, srv.log
    assert int(line[2]) == s["steps"] and float(line[3]) == pytest.approx(s["initial_proxy"], abs=1e-4)
    assert float(line[4]) == pytest.approx(s["best_proxy"], abs=1e-4) and float(line[1]) > 0
    assert re.search(r"POST /v1/calibrate 503 \S+s id='wait' error='shutting_down'", srv.log), srv.log
    assert len(re.findall(r"GET /health 503 \S+s error='shutting_down'", srv.log)) == 1, srv.log


def test_sigint_stops_the_running_calibration_in_the_grace_period(tiny_dir):
    """SIGINT does what SIGTERM does; a calibration that would run on is stopped at 0.8 x --grace-s and answers with
    its best X so far (stop_reason 'shutdown'); the process exits 0."""
    with CliServer("--model", tiny_dir, "--max-steps", "100000", "--grace-s", "2", "--log-level",
                   "warning") as srv:
        running, out = in_thread(calibrate_on, srv.url, {"request": REQ, "config": LONG})  # 100k steps, no deadline
        wait_for(lambda: srv.health()["busy"], 30)
        srv.proc.send_signal(signal.SIGINT)
        rc = srv.wait()
        running.join(60)
    assert rc == 0, srv.log
    r = out["r"]
    assert r.status_code == 200, r.text
    s = r.json()["summary"]
    assert s["stop_reason"] == "shutdown" and 1 <= s["steps"] < LONG["max_steps"]
    assert_clean(srv.log)


# `serve` on the tiny model whose proxy job first runs 4 s of small torch ops without a stop check: a job that the
# drain cannot stop at a step boundary (argv: port, model folder)
SLOW_JOB_SERVER = """
import sys, time, torch
from sicl_fast import Engine
from sicl_fast.serve.server import serve
from sicl_fast.serve.settings import ServeSettings
torch.set_num_threads(1)
engine = Engine(model=sys.argv[2])
proxy = engine.proxy
def slow_proxy(*a, **k):
    t, end = torch.full((32, 32), 0.01), time.monotonic() + 4.0
    while time.monotonic() < end:
        t = torch.tanh(t @ t)
    return proxy(*a, **k)
engine.proxy = slow_proxy
sys.exit(serve(engine, ServeSettings(port=int(sys.argv[1]), grace_s=1.0, log_level="info")))
"""


def test_a_job_past_the_grace_period_ends_with_the_process_cleanly(tiny_dir):
    """The job still inside torch when the grace period ends gets its 503 and the process exits 0 at once (before:
    the interpreter's finalization ended the worker thread inside torch's C++ frames, and the process aborted with
    'terminate called without an active exception', status -6)."""
    with CliServer(tiny_dir, script=SLOW_JOB_SERVER) as srv:
        running, out = in_thread(lambda: httpx.post(srv.url + "/v1/proxy", json={"request": REQ}, timeout=60))
        wait_for(lambda: srv.health()["busy"], 30)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.wait()
        running.join(60)
    assert rc == 0 and time.monotonic() - t0 < 3.5, srv.log  # the job alone would have run on for about 4 s
    assert "terminate called" not in srv.log and "past the grace period still inside the engine" in srv.log, srv.log
    r = out["r"]
    assert r.status_code == 503 and "shut down before this request finished" in error_of(r)["message"], r.text
    assert_clean(srv.log)


def test_the_idle_engine_worker_has_ended_when_the_server_stops(engine):
    """After a drain with no job running, the engine's worker thread has returned before the server does: a thread
    that ran torch code must not be left to wake up during the interpreter's finalization (it aborted the process
    at exit: Scheduler.ended)."""
    srv = ServerThread(engine, ServeSettings(port=0)).start()
    scheduler = srv.app.state.serve.scheduler
    Client(srv.url).proxy(REQ)  # the worker has run torch code
    srv.shutdown()
    assert not srv.thread.is_alive() and scheduler.ended


@pytest.mark.slow
def test_cli_serve_end_to_end():
    """`sicl-fast serve` itself: the embedded SmolLM2, the key from the environment, a clean exit on Ctrl-C."""
    with CliServer("--log-level", "warning", env={"SICL_FAST_API_KEY": "k3y"}) as srv:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        with Client(srv.url, api_key="k3y") as c:
            assert c.models()[0]["family"] == "llama"
            r = c.calibrate(REQ, max_steps=1, tau=0.0)
            assert r["summary"]["steps"] == 1 and r["model"] == c.models()[0]["id"]
        srv.proc.send_signal(signal.SIGINT)
        rc = srv.wait()
    assert rc == 0 and "Traceback" not in srv.log, srv.log
    assert f"http://127.0.0.1:{srv.port} (API key required" in srv.log


def test_text_that_is_not_unicode_is_a_400_and_out_of_range_knobs_a_422(server, client):
    """A lone surrogate (a JSON escape such as \\ud800 without its pair) in any field is a 400 naming the field,
    before any work (before: a 500 after the calibration); a knob beyond its range (sicl_fast.run.knobs) a 422."""
    steps = metric(client, "sicl_fast_calibration_steps_total")
    cases = [({"request": {**REQ, "id": "q\ud800"}}, "field 'request.id'"),
             ({"request": {**REQ, "demos": [{"input": "one", "output": "1\udc00"}]}},
              "field 'request.demos[0].output'"),
             ({"request": REQ, "generate": True, "stop": ["\ud800"]}, "field 'stop[0]'"),
             ({"request": REQ, "config": {"estimator": "\udfff"}}, "field 'config.estimator'")]
    for body, field in cases:
        r = post(server, "/v1/calibrate", content=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert err["kind"] == "bad_text" and field in err["message"] and "not valid Unicode" in err["message"], err
    r = post(server, "/v1/proxy", content=json.dumps({"request": {**REQ, "query": "\ud800"}}).encode(),
             headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "field 'request.query'" in error_of(r)["message"]
    for knobs, msg in (({"patience": 10**23}, "patience must be <= 1000000"), ({"seed": 2**32}, "seed must be <="),
                       ({"alpha": 0.0, "beta": 0.0, "gamma": 0.0}, "sum to 0")):
        r = post(server, "/v1/calibrate", {"request": REQ, "config": knobs})
        assert r.status_code == 422 and msg in error_of(r)["message"], r.text
    r = post(server, "/v1/calibrate", {"request": REQ, "generate": True, "stop": [""]})
    assert r.status_code == 422 and "an empty stop string" in error_of(r)["message"]
    assert metric(client, "sicl_fast_calibration_steps_total") == steps  # nothing ran


def test_the_packed_server_path_with_packing_forced(tiny_llama):
    """A server whose engine packs (pack 2, forced on the CPU): concurrent /v1/calibrate requests run as slots of one
    packed step, each with its own config, within the packed step's tolerance of its run alone (tests/test_packed.py),
    and an answer after each, as a row of the decode batch."""
    eng = Engine(tiny_llama, pack=2)
    reqs = [{**REQ, "id": f"p{i}", "demos": [{"input": "one" * (i + 1), "output": "1"},
                                             {"input": "seven", "output": "7" * (i + 1)}]} for i in range(2)]
    knobs = [{"max_steps": 3 + 2 * i, "N": 4, "tau": 0.0, "seed": i} for i in range(2)]
    alone = [eng.calibrate(eng.prepare(r, reserve=4), **k) for r, k in zip(reqs, knobs)]
    with ServerThread(eng, ServeSettings(port=0)) as srv:
        with engine_lock(eng):  # both are in before the first step
            calls = [in_thread(post, srv, "/v1/calibrate", {"request": r, "config": k, "generate": True,
                                                            "max_new_tokens": 4, "stop": []})
                     for r, k in zip(reqs, knobs)]
            wait_for(lambda: srv.app.state.serve.scheduler.depth + srv.app.state.serve.scheduler.in_flight == 2, 10)
        for t, _ in calls:
            t.join(60)
        assert srv.app.state.serve.scheduler.work.packed.full == 2
    for (_, out), ref, r in zip(calls, alone, reqs):
        body = out["r"].json()
        assert body["summary"]["steps"] == ref.steps and body["summary"]["stop_reason"] == ref.stop_reason
        assert body["history"] == pytest.approx(ref.history, rel=1e-5, abs=0)
        assert body["reuse"]["reuse"] == "off"
        gen = eng.generate(eng.prepare(r, reserve=4), ref.embeddings, max_new_tokens=4, stop_strings=())
        assert body["answers"]["calibrated"] == gen.answer


def test_the_client_reads_a_retry_after_date_from_a_proxy_in_front(tmp_path):
    """Issue 54 item 4: Retry-After may be an HTTP date (RFC 9110; a proxy in front of the server sends one); the client
    parsed it with float() outside its try, a ValueError in place of the QueueFullError."""
    import email.utils
    import http.server

    when = email.utils.formatdate(time.time() + 30, usegmt=True)

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"error": {"kind": "queue_full", "message": "busy"}}'
            self.send_response(429)
            self.send_header("Retry-After", when)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=httpd.handle_request, daemon=True).start()
    try:
        with Client(f"http://127.0.0.1:{httpd.server_address[1]}") as c, pytest.raises(QueueFullError) as exc:
            c.health()
    finally:
        httpd.server_close()
    assert exc.value.kind == "queue_full" and 20 < exc.value.retry_after <= 30
    from sicl_fast.serve.client import retry_after

    assert [retry_after(v) for v in ("3", None, "soon", "nan", "-5")] == [3.0, 1.0, 1.0, 1.0, 0.0]
