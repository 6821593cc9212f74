"""The real OpenAI-compatible HTTP server with DominoTree, on CPU.

One `vllm.entrypoints.openai.api_server` subprocess serves the toy target with the
Domino drafter (`"method": "dominotree"`); plain HTTP requests against it must give
the offline no-speculation engine's (`baseline`) greedy tokens, stream the same text,
report the baseline's logprobs, refuse unsupported options with a 400 that names
them, and survive a client that hangs up mid-stream.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from vllm_dominotree.evaluation.server import ApiServer, ServerError, log_tail, sse_events

from .conftest import MAX_MODEL_LEN, SERVED_NAME, greedy, server_args

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 120
MAX_TOKENS = 40
# Text prompts of different lengths from the toy alphabet (one token per character).
TEXT_PROMPTS = [
    "a",
    "abc",
    "Hello",
    "the quick brown fox",
    "jumps over the lazy dog",
    "0123456789",
    "ZZZZZZZZZZZZ",
    "Speculative decoding with trees on CPU",
    "x y z",
]


class Server(ApiServer):
    def post(self, path: str, body: dict, **kwargs) -> requests.Response:
        return requests.post(
            f"{self.url}{path}",
            json={"model": SERVED_NAME, **body},
            timeout=REQUEST_TIMEOUT_S,
            **kwargs,
        )

    def _completion(self, prompt, max_tokens: int, **body) -> requests.Response:
        """A greedy completion that never stops early (ignore_eos)."""
        request = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            **body,
        }
        return self.post("/v1/completions", request, stream=bool(body.get("stream")))

    def complete(self, prompt, max_tokens: int = MAX_TOKENS, **body) -> dict:
        response = self._completion(prompt, max_tokens, return_token_ids=True, **body)
        assert response.status_code == 200, response.text
        return response.json()

    def stream(self, prompt, max_tokens: int = MAX_TOKENS, **body) -> requests.Response:
        response = self._completion(prompt, max_tokens, stream=True, **body)
        assert response.status_code == 200, response.text
        return response


@pytest.fixture(scope="module", params=["conditional", "marginal", "chain"])
def server(pair_dirs, tmp_path_factory, request):
    """One server per scorer; every test below runs against each."""
    root = tmp_path_factory.mktemp("server")
    spec = {"method": "dominotree", "model": pair_dirs["drafter"], "scorer": request.param}
    args = server_args("--enable-log-requests", "--speculative-config", json.dumps(spec))
    server = Server.start(
        pair_dirs["target"], root / "server.log", args, env={"VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    try:
        # Build the offline baseline engine while the server starts (both take ~30-60 s).
        request.getfixturevalue("baseline")
        try:
            server.wait_healthy(STARTUP_TIMEOUT_S)
        except ServerError as err:
            pytest.fail(str(err))
        yield server
        assert server.alive(), f"API server died during the tests:\n{log_tail(server.log)}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(pair_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair_dirs["target"])


def _ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert len(ids) == len(text), (text, ids)  # one token per character
    return ids


def _assert_still_serves(server, baseline, tokenizer, text: str) -> None:
    """After a refused or abandoned request: the server answers the next one, greedily
    and exactly as the baseline engine does."""
    want = greedy(baseline, [_ids(tokenizer, text)], MAX_TOKENS)[0]
    choice = server.complete(text)["choices"][0]
    assert choice["token_ids"] == want
    assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True)


def test_completions_batch_matches_baseline(server, baseline, tokenizer):
    prompt_ids = [_ids(tokenizer, text) for text in TEXT_PROMPTS]
    expected = greedy(baseline, prompt_ids, MAX_TOKENS)

    body = server.complete(TEXT_PROMPTS)

    choices = sorted(body["choices"], key=lambda choice: choice["index"])
    assert len(choices) == len(TEXT_PROMPTS)
    for text, ids, want, choice in zip(TEXT_PROMPTS, prompt_ids, expected, choices, strict=True):
        assert choice["prompt_token_ids"] == ids, text
        assert choice["token_ids"] == want, text
        assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True), text
        assert choice["finish_reason"] == "length", text
        assert len(choice["token_ids"]) == MAX_TOKENS
    usage = body["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS * len(TEXT_PROMPTS)
    assert usage["prompt_tokens"] == sum(len(ids) for ids in prompt_ids)


def test_completions_token_id_prompt_matches_baseline(server, baseline, tokenizer):
    prompt = [5, 9, 12, 3, 40, 41, 7]
    want = greedy(baseline, [prompt], MAX_TOKENS)[0]

    choice = server.complete(prompt)["choices"][0]

    assert choice["prompt_token_ids"] == prompt
    assert choice["token_ids"] == want
    assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True)


def test_chat_completions_matches_baseline(server, baseline, tokenizer):
    messages = [
        {"role": "system", "content": "You are a toy"},
        {"role": "user", "content": "say something about trees"},
    ]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    prompt_ids = list(prompt_ids)
    assert tokenizer.unk_token_id not in prompt_ids  # the template stays in the alphabet
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    want = baseline.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs[0]

    response = server.post(
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["prompt_token_ids"] == prompt_ids
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["token_ids"] == list(want.token_ids)
    assert choice["message"]["content"] == want.text
    assert choice["finish_reason"] == "length"
    # Each token's logprob and its two best tokens' (by value) as the baseline's.
    content = choice["logprobs"]["content"]
    assert len(content) == MAX_TOKENS
    for token, entry, expected in zip(want.token_ids, content, want.logprobs, strict=True):
        assert entry["logprob"] == pytest.approx(expected[token].logprob, abs=1e-4)
        best = sorted(e.logprob for e in expected.values() if e.rank <= 2)
        assert sorted(t["logprob"] for t in entry["top_logprobs"]) == pytest.approx(best, abs=1e-4)


def test_streaming_completion_matches_non_streamed(server, baseline, tokenizer):
    text = "the quick brown fox"
    want = greedy(baseline, [_ids(tokenizer, text)], MAX_TOKENS)[0]
    full = server.complete(text)["choices"][0]
    assert full["token_ids"] == want

    response = server.stream(text, return_token_ids=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    pieces, token_ids, finish = [], [], []
    with response:
        for event in sse_events(response.iter_lines(decode_unicode=True)):
            for choice in event["choices"]:
                assert choice["index"] == 0
                pieces.append(choice["text"])
                token_ids += choice.get("token_ids") or []
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])

    assert len(pieces) > 1  # really streamed, not one final chunk
    assert "".join(pieces) == full["text"]
    assert token_ids == want
    assert finish == ["length"]


def test_completion_logprobs_match_baseline(server, baseline, tokenizer):
    """logprobs=2 over HTTP, streamed: every token's logprob and its two best tokens'
    are the offline engine's without speculation."""
    from vllm import SamplingParams

    text = "the quick brown fox"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    want = baseline.generate([{"prompt_token_ids": _ids(tokenizer, text)}], params)[0].outputs[0]
    token_ids, token_logprobs, top = [], [], []
    response = server.stream(text, logprobs=2, return_token_ids=True)
    for event in sse_events(response.iter_lines(decode_unicode=True)):
        for choice in event["choices"]:
            token_ids += choice.get("token_ids") or []
            logprobs = choice.get("logprobs") or {}
            token_logprobs += logprobs.get("token_logprobs") or []
            top += logprobs.get("top_logprobs") or []
    assert token_ids == list(want.token_ids)
    assert len(token_logprobs) == len(top) == MAX_TOKENS
    for token, got, best, expected in zip(
        token_ids, token_logprobs, top, want.logprobs, strict=True
    ):
        assert got == pytest.approx(expected[token].logprob, abs=1e-4)
        # The two best tokens, keyed by their text: compared by their logprobs.
        wanted = sorted(e.logprob for e in expected.values() if e.rank <= 2)
        assert sorted(best.values()) == pytest.approx(wanted, abs=1e-4)


def test_constrained_completion_matches_baseline(server, baseline, tokenizer):
    """logit_bias, a repetition penalty and min_tokens over HTTP (the first two refused by
    vLLM's own speculative methods): the offline engine's greedy tokens without
    speculation under the same."""
    from vllm import SamplingParams

    text, bias = "the quick brown fox", {7: 3.0, 40: -100.0}
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, logit_bias=bias, repetition_penalty=2.0, min_tokens=8
    )
    want = baseline.generate([{"prompt_token_ids": _ids(tokenizer, text)}], params)[0].outputs[0]
    body = {"logit_bias": {str(t): b for t, b in bias.items()}, "repetition_penalty": 2.0}
    choice = server.complete(text, ignore_eos=False, min_tokens=8, **body)["choices"][0]
    assert choice["token_ids"] == list(want.token_ids)


def test_unsupported_option_is_refused_with_400(server, baseline, tokenizer):
    response = server.post(
        "/v1/completions",
        {"prompt": "abc", "max_tokens": 8, "temperature": 0, "bad_words": ["ab"]},
    )

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "bad_words" in error["message"]
    assert "dominotree" in error["message"]
    assert error["code"] == 400

    _assert_still_serves(server, baseline, tokenizer, "abc")


def test_unsupported_option_in_a_stream_is_refused_before_it_starts(server, baseline, tokenizer):
    body = {"prompt": "abc", "max_tokens": 8, "stream": True, "bad_words": ["ab"]}
    response = server.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    assert "bad_words" in response.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "bad_words": ["x"]}
    response = server.post("/v1/chat/completions", chat)
    assert response.status_code == 400, response.text
    assert "bad_words" in response.json()["error"]["message"]

    _assert_still_serves(server, baseline, tokenizer, "abc")


def test_client_disconnect_mid_stream(server, baseline, tokenizer):
    text = "a"
    max_tokens = MAX_MODEL_LEN - len(text) - 1
    response = server.stream(text, max_tokens)
    events = sse_events(response.iter_lines(decode_unicode=True))
    first = [next(events) for _ in range(3)]
    request_id = first[0]["id"]
    assert all(not event["choices"][0].get("finish_reason") for event in first)
    response.close()  # hang up mid-stream

    # The server notices and aborts the request (logged with --enable-log-requests).
    deadline = time.monotonic() + 30
    while f"Aborted request(s) {request_id}" not in server.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log_tail(server.log)
        time.sleep(0.2)

    _assert_still_serves(server, baseline, tokenizer, "Hello")


def test_server_speculates(server, baseline, tokenizer):
    """The served engine really drafts and accepts tokens (vLLM's own counters), and
    the outputs are still the baseline's."""
    before = server.metrics()
    text = "jumps over the lazy dog"
    want = greedy(baseline, [_ids(tokenizer, text)], MAX_TOKENS)[0]
    assert server.complete(text)["choices"][0]["token_ids"] == want
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0, sorted(k for k in after if "spec" in k)
    assert accepted > 0
    # The plugin's own figures at /metrics (metrics.py) beside vLLM's: the same story.
    assert delta("dominotree_accepted_tokens_total") == accepted
    assert 0 < delta("dominotree_trees_total") <= drafts
    assert delta("dominotree_tree_nodes_total") <= delta("vllm:spec_decode_num_draft_tokens_total")
    assert delta("dominotree_draft_seconds_count") >= delta("dominotree_steps_total") > 0
    assert delta("dominotree_build_seconds_sum") > 0
    # With the toy drafter right most of the time, speculation saves target steps: the
    # MAX_TOKENS tokens (the first from prefill) come from fewer verification steps.
    assert drafts < MAX_TOKENS - 1
    assert accepted + drafts >= MAX_TOKENS - 1
