"""`mamba-draft serve` on loopback with the real `openai` client and httpx: outputs equal `generate`'s, streaming,
concurrent requests decoded together with the same tokens as alone, a client that leaves, bad input answered with
OpenAI error objects while the server keeps serving."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mamba_draft.benchmarks.serve_bench import LoopbackServer
from mamba_draft.targets.cache import TargetCache
from tests.helpers.tree_models import aligned_drafter, tiny_llama, word_tokenizer
from tree_search.batcher import Batcher, Request
from tree_search.generator import SpeculativeGenerator

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from tree_search.serve import create_app  # noqa: E402  (needs fastapi, as uvicorn does)

WORDS = ("the cat dog sat on mat red blue green a is and user assistant system hello world why how what when big "
         "small tree bird sky sun moon run jump fast slow yes no").split()
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")
MODEL = "tiny"
GUARD = 120  # seconds: a failure guard only, never what a test decides by
QUESTIONS = ["the cat sat on", "why is the sky blue", "a big red tree", "how fast is the bird", "what is the moon",
             "hello world and sun", "the dog run jump", "is the mat green"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    tokenizer = word_tokenizer(WORDS, TEMPLATE)
    target = tiny_llama(vocab=64)
    aligned_drafter(root / "drafter", target)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return root


@pytest.fixture(scope="module")
def generator(saved):
    return SpeculativeGenerator(saved / "target", saved / "drafter", device="cpu", dtype="float32", tree="2,1")


@pytest.fixture(scope="module")
def server(generator):
    server = LoopbackServer(create_app(generator, MODEL, max_batch=8, max_queue=16), MODEL)
    yield server
    server.close()


def chat(server, question: str, **options):
    return server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                 **{"max_tokens": 16, "temperature": 0, **options})


def test_models_health_and_a_chat_completion_equal_to_generate(server, generator):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    messages = [{"role": "user", "content": "the cat sat on"}]
    want = generator.generate(messages, max_new_tokens=16, temperature=0.0)
    got = chat(server, "the cat sat on")
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens == len(want.token_ids) and got.usage.prompt_tokens == len(
        generator.encode(messages))
    assert got.choices[0].finish_reason in ("length", "stop") and got.model == MODEL
    extra = got.model_extra["speculative"]
    assert extra["rounds"] >= 1 and extra["tau"] >= 1 and extra["batch"] == 1


def scrape(server) -> dict[tuple, float]:
    """GET /metrics, parsed: (sample name, labels other than model) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model"))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples
            if sample.labels.get("model", MODEL) == MODEL}


def test_metrics_count_what_the_server_did(server):
    """Prometheus metrics move as requests are served: requests by outcome, tokens in and out, the first-token and
    per-token histograms, tokens drafted and accepted, rounds and τ, the tree shape pulled; the queue is empty."""
    before = scrape(server)
    replies = [chat(server, q, max_tokens=12) for q in QUESTIONS[:3]]
    after = scrape(server)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    outcomes = sum(moved("mamba_draft_requests_total", (("outcome", o),)) for o in ("stop", "length"))
    assert outcomes == 3
    assert moved("mamba_draft_generation_tokens_total") == sum(r.usage.completion_tokens for r in replies)
    assert moved("mamba_draft_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    assert moved("mamba_draft_time_to_first_token_seconds_count") == 3
    assert moved("mamba_draft_time_per_output_token_seconds_count") == 3
    rounds, drafted = moved("mamba_draft_verify_rounds_total"), moved("mamba_draft_draft_tokens_total")
    assert rounds == sum(r.model_extra["speculative"]["rounds"] for r in replies)
    assert drafted == 4 * rounds  # tree 2,1: two children, one grandchild each
    assert 0 < moved("mamba_draft_draft_accepted_tokens_total") <= drafted
    assert moved("mamba_draft_arm_pulls_total", (("arm", "(2,1)"),)) == rounds
    assert after[("mamba_draft_mean_accepted_tokens", ())] > 1
    assert after[("mamba_draft_queue_length", ())] == 0 and after[("mamba_draft_running_rows", ())] == 0


def test_logprobs_are_the_targets_own_streamed_or_not(server, generator):
    """logprobs / top_logprobs: each emitted token's log-probability under the target's plain forward (within 1e-4),
    its top alternative the emitted token under greedy; the stream carries the same numbers; the legacy completions
    endpoint its parallel lists."""
    import torch

    messages = [{"role": "user", "content": "why is the sky blue"}]
    ids = generator.encode(messages)
    got = chat(server, "why is the sky blue", logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    want = generator.generate(messages, max_new_tokens=16, temperature=0.0)
    assert len(content) == len(want.token_ids) == got.usage.completion_tokens
    with torch.no_grad():
        logits = generator.target(torch.tensor([ids + want.token_ids])).logits[0, len(ids) - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(want.token_ids)[:, None])[:, 0]
    assert max(abs(c.logprob - e) for c, e in zip(content, expected.tolist())) < 1e-4
    for c, token in zip(content, want.token_ids):
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token == generator.tokenizer.decode([token])
        assert c.top_logprobs[0].logprob == c.logprob >= c.top_logprobs[1].logprob
    streamed = [e for chunk in server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    assert chat(server, "why is the sky blue").choices[0].logprobs is None
    legacy = server.client.completions.create(model=MODEL, prompt="why is the sky", max_tokens=8, temperature=0,
                                              logprobs=2).choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 8
    assert all(max(top.values()) == lp for top, lp in zip(legacy.top_logprobs, legacy.token_logprobs))


def test_penalties_and_logit_bias_equal_generate_with_them(server, generator):
    """OpenAI's frequency / presence penalties and logit bias reach the engine's logits processors: the reply is
    what `generate` gives with the same settings, and they change it."""
    messages = [{"role": "user", "content": "the cat sat on"}]
    options = {"frequency_penalty": 1.2, "presence_penalty": 0.4, "logit_bias": {"3": 5.0}}
    want = generator.generate(messages, max_new_tokens=16, temperature=0.0, **options)
    got = chat(server, "the cat sat on", **options)
    assert got.choices[0].message.content == want.text
    assert want.token_ids != generator.generate(messages, max_new_tokens=16, temperature=0.0).token_ids


def test_a_stream_carries_the_whole_text_then_usage(server):
    whole = chat(server, "why is the sky blue", max_tokens=20).choices[0].message.content
    chunks = list(chat(server, "why is the sky blue", max_tokens=20, stream=True,
                       stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}])
def test_eight_concurrent_requests_decode_together_with_the_tokens_each_gets_alone(server, monkeypatch, sampling,
                                                                                  saved):
    """Greedy, or sampled with a seed: 8 requests decoded together get the replies each gets alone, and a seeded
    reply is also the one a server that does not speculate (`--tree none`) gives."""
    alone = {q: chat(server, q, max_tokens=24, **sampling).choices[0].message.content for q in QUESTIONS}
    if sampling:
        plain = SpeculativeGenerator(saved / "target", saved / "drafter", device="cpu", dtype="float32", tree="none")
        unspeculated = LoopbackServer(create_app(plain, MODEL), MODEL)
        try:
            assert {q: chat(unspeculated, q, max_tokens=24, **sampling).choices[0].message.content
                    for q in QUESTIONS} == alone
        finally:
            unspeculated.close()
    batcher = server.app.state.batcher
    before = batcher.batches
    submitted = recorded_submits(batcher, monkeypatch)
    forward = TargetCache.tree_forward

    def held(self, *args, **kwargs):  # no round runs before all eight requests reached the engine: the first
        wait_for(lambda: len(submitted) == len(QUESTIONS), "the other requests never arrived")  # batch waits for them
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TargetCache, "tree_forward", held)
    gate = threading.Barrier(len(QUESTIONS))

    def ask(question):
        gate.wait()
        return chat(server, question, max_tokens=24, **sampling)

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        results = list(pool.map(ask, QUESTIONS))
    assert [r.choices[0].message.content for r in results] == [alone[q] for q in QUESTIONS]
    sizes = list(server.app.state.batcher.batch_sizes)[-(server.app.state.batcher.batches - before):]
    assert sum(sizes) == len(QUESTIONS) and max(sizes) > 1  # some decoded in one batch
    assert max(r.model_extra["speculative"]["batch"] for r in results) == max(sizes)


def test_completions_endpoint_and_stop_strings(server, generator):
    want = generator.generate("the cat sat on", max_new_tokens=12, temperature=0.0, chat_template=False).text
    got = server.client.completions.create(model=MODEL, prompt="the cat sat on", max_tokens=12, temperature=0)
    assert got.choices[0].text == want and got.object == "text_completion"
    words = want.split()
    stop = " ".join(words[2:4])
    cut = server.client.completions.create(model=MODEL, prompt="the cat sat on", max_tokens=12, temperature=0,
                                           stop=[stop])
    assert cut.choices[0].text == want[: want.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model=MODEL, prompt="the cat sat on", max_tokens=12, temperature=0,
                                                stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_sampled_requests_with_a_seed_repeat(server):
    first, again = (chat(server, "a big red tree", temperature=1.0, seed=7, max_tokens=12) for _ in range(2))
    assert first.choices[0].message.content == again.choices[0].message.content


def test_a_client_that_leaves_frees_its_row_at_the_next_round(server, monkeypatch):
    """Event by event, not by the clock: the engine makes no progress until the server has seen the client leave,
    then the row leaves the batch at its next round with `cancelled`."""
    batcher = server.app.state.batcher
    submitted = recorded_submits(batcher, monkeypatch)
    left = threading.Event()
    forward = TargetCache.tree_forward

    def held(self, *args, **kwargs):  # the request cannot finish before its client has gone
        assert left.wait(GUARD), "the server never saw the client leave"
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TargetCache, "tree_forward", held)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=GUARD, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 200,
            "temperature": 0, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk: the request is in the engine
    request = submitted[0]
    wait_for(lambda: request.cancelled, "the server did not mark the request cancelled")
    left.set()
    assert request.done.wait(GUARD), "the row was not freed"
    assert request.finish_reason == "cancelled" and len(request.tokens) < 200
    wait_for(lambda: batcher.finished and batcher.finished[-1] == ("cancelled", len(request.tokens)),
             "the batcher did not count the cancelled request")
    assert chat(server, "the cat sat on").choices[0].message.content  # and the server goes on


def recorded_submits(batcher, monkeypatch) -> list[Request]:
    """The requests the server hands the batcher from now on, in order, each listed once it is queued."""
    submitted, submit = [], batcher.submit

    def record(request: Request) -> Request:
        submit(request)
        submitted.append(request)
        return request

    monkeypatch.setattr(batcher, "submit", record)
    return submitted


def wait_for(condition, failure: str) -> None:
    """Wait until `condition()` holds; the deadline only guards against a hang (GUARD seconds)."""
    deadline = time.monotonic() + GUARD
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.005)


BAD = [  # (body or raw bytes, status, the error's param or code)
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": "hello"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     400, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, 400, "messages[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 6}, 400,
     "context_length_exceeded"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "the " * 5000}]}, 400, "context_length_exceeded"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 7}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, 400, "logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, 400,
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 3.0}, 400,
     "presence_penalty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     400, "response_format"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": "abc"}, 400, "seed"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, 400, "frobnicate"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (1 << 21) + b'"}]}', 413,
     "request_too_large"),
]


def test_bad_input_gets_an_openai_error_object_and_the_server_goes_on(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body, status, where in BAD:
            raw = body if isinstance(body, bytes) else None
            response = http.post("/v1/chat/completions", content=raw, json=None if raw else body,
                                 headers={"content-type": "application/json"})
            error = response.json()["error"]
            assert response.status_code == status, (body if raw is None else raw[:40], response.text)
            assert where in (error["param"], error["code"]) and error["message"] and error["type"]
        for path, method, status in (("/v1/nothing", "GET", 404), ("/v1/chat/completions", "GET", 405)):
            response = http.request(method, path)
            assert response.status_code == status and response.json()["error"]["message"]
        for prompt in (42, [1, 999], [], ""):
            bad_prompt = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
            assert bad_prompt.status_code == 400 and bad_prompt.json()["error"]["param"] == "prompt"
    assert len(BAD) + 6 >= 20
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(server, "the cat", max_tokens=0)
    assert chat(server, "the cat sat on").choices[0].message.content  # still serving
    wait_for(lambda: httpx.get(server.url + "/health").json()["running"] == 0, "a row stuck in the engine")


def test_a_full_queue_answers_503(generator):
    from fastapi.testclient import TestClient

    app = create_app(generator, MODEL, max_queue=0)
    with TestClient(app) as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "the cat"}]})
        assert response.status_code == 503 and response.json()["error"]["code"] == "server_overloaded"


def test_the_idle_engine_waits_for_requests_sent_together_and_no_longer(generator):
    """Requests that arrive within `batch_wait` of the first decode in its batch (it stops waiting once max_batch
    are there); a request alone starts after the wait; `batch_wait` 0 takes the first request at once."""
    def submit(batcher, words):
        return batcher.submit(Request(generator.encode([{"role": "user", "content": words}]), max_tokens=4,
                                      temperature=0.0))

    batcher = Batcher(generator, max_batch=3, batch_wait=10)
    try:
        requests = []
        for words in QUESTIONS[:3]:
            requests.append(submit(batcher, words))
            time.sleep(0.05)
        assert all(r.done.wait(GUARD) for r in requests)
        assert list(batcher.batch_sizes) == [3]
    finally:
        batcher.close()
    for wait in (0.3, 0.0):
        batcher = Batcher(generator, max_batch=8, batch_wait=wait)
        try:
            lone = submit(batcher, QUESTIONS[0])
            wait_for(lambda: not batcher.queue, "the engine never took the request")
            late = submit(batcher, QUESTIONS[1])
            assert lone.done.wait(GUARD) and late.done.wait(GUARD)
            assert lone.first_token_at - lone.arrived >= wait and list(batcher.batch_sizes) == [1, 1]
        finally:
            batcher.close()
    with pytest.raises(ValueError, match="batch_wait in"):
        Batcher(generator, batch_wait=-1)


def test_stop_strings_are_held_back_until_they_cannot_start():
    class Words:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(["ab", "cd", "ef"][i] for i in ids)

    sent = []
    request = Request([1], max_tokens=10, stop=("de",), on_text=sent.append)
    assert request.take([0], Words(), eos=set()) and sent == ["ab"]
    assert request.take([1], Words(), eos=set()) and sent == ["ab", "c"]  # "d" may start "de": held back
    assert not request.take([2], Words(), eos=set())  # "abcdef" holds "de": stop
    assert request.text == "abc" and request.finish_reason == "stop"
    request.finish()
    assert "".join(sent) == "abc"


def test_serve_refuses_bad_flags_in_one_line_before_loading(tmp_path, capsys, monkeypatch):
    from mamba_draft.commands.cli import DEBUG_ENV, main

    monkeypatch.delenv(DEBUG_ENV, raising=False)  # errors as users see them, not tracebacks
    with pytest.raises(SystemExit, match="^mamba-draft serve: error: --target .*nowhere does not exist"):
        main(["serve", "--target", str(tmp_path / "nowhere")])
    assert main(["serve", "--target", "smollm2", "--max-batch", "0"]) == 1
    assert capsys.readouterr().err.strip() == ("mamba-draft serve: error: --max-batch must be >= 1, --max-queue >= 0, "
                                               "--port in [0, 65535] and --batch-wait-ms in [0, 10000]")


def test_serve_bench_times_each_policy_and_the_first_token(saved, capsys, monkeypatch):
    import mamba_draft.devices
    from mamba_draft.commands.cli import main

    monkeypatch.setattr(mamba_draft.devices, "native_bf16", lambda device="cpu": False)  # fp32 on every CPU kind
    assert main(["serve-bench", "--target", str(saved / "target"), "--drafter", str(saved / "drafter"),
                 "--clients", "3", "--max-tokens", "6", "--repeats", "1", "--trees", "2,1", "none"]) == 0
    out = capsys.readouterr().out
    assert "time to the first streamed token of a 200-token prompt (2,1)" in out
    rows = [line for line in out.splitlines() if line.startswith("| 2,1 |") or line.startswith("| none |")]
    assert len(rows) == 2 and all(line.endswith("| 3/3 |") for line in rows)  # outputs equal to alone
