"""Concurrent streaming load against an OpenAI-compatible server, standard library only.

The load and fault test (tests/engine/test_server_load.py) and the serving benchmark
(benchmarks/serve_load_bench.py) send the same mixed traffic: streamed completions of
token-id prompts of mixed lengths, greedy and seeded sampled requests, some abandoned by
the client mid-stream and some carrying an option the plugin refuses (HTTP 400). Every
request is bounded by a timeout, so a server that hangs fails the run instead of
blocking it.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

KINDS = ("greedy", "seeded", "abort", "reject")


@dataclass(frozen=True)
class LoadRequest:
    index: int
    prompt: list[int]
    max_tokens: int
    kind: str  # one of KINDS
    abort_after: int = 0  # kind "abort": stream events read before hanging up

    def body(self, model: str) -> dict:
        body = {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        if self.kind == "seeded":
            body.update(temperature=0.8, top_p=0.95, seed=1000 + self.index)
        if self.kind == "reject":
            body["bad_words"] = ["ab"]  # refused by the plugin with a 400
        return body


@dataclass
class LoadResult:
    request: LoadRequest
    status: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""  # the 4xx body, or what went wrong on the wire
    sent_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # per token, after sent_s

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def mixed_load(
    count: int,
    vocab: int,
    seed: int,
    *,
    max_prompt: int = 60,
    lengths: tuple[int, ...] = (8, 24, 48, 96),
    fractions: dict[str, float] | None = None,
) -> list[LoadRequest]:
    """`count` requests, the same for the same arguments."""
    fractions = fractions or {"greedy": 0.5, "seeded": 0.3, "abort": 0.14, "reject": 0.06}
    rng = random.Random(seed)
    kinds = [k for k in KINDS for _ in range(round(fractions.get(k, 0) * count))]
    kinds = (kinds + ["greedy"] * count)[:count]
    rng.shuffle(kinds)
    requests = []
    for i, kind in enumerate(kinds):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        max_tokens = rng.choice(lengths)
        abort_after = rng.randint(2, 4) if kind == "abort" else 0
        if kind == "abort":
            max_tokens = max(lengths)  # far from done when the client hangs up
        requests.append(LoadRequest(i, prompt, max_tokens, kind, abort_after))
    return requests


def _stream(url: str, model: str, request: LoadRequest, timeout_s: float) -> LoadResult:
    result = LoadResult(request)
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        result.sent_s = time.monotonic()
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(request.body(model)),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        result.status = response.status
        if response.status != 200:
            result.error = response.read().decode(errors="replace")
            return result
        events = 0
        while True:
            line = response.readline().decode().strip()
            if not line:
                if response.isclosed():
                    break
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:  # the server failed the request mid-stream
                result.error = json.dumps(event["error"])
                break
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            now = time.monotonic() - result.sent_s
            new = choice.get("token_ids") or []
            result.tokens += new
            result.token_times_s += [now] * len(new)
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
            events += 1
            if request.kind == "abort" and events >= request.abort_after:
                break  # hang up mid-stream (the connection closes below)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    finally:
        conn.close()
    return result


def run_load(
    url: str, model: str, requests: list[LoadRequest], concurrency: int, timeout_s: float
) -> tuple[list[LoadResult], float]:
    """All requests, `concurrency` at a time (each with its own connection). Returns the
    results in request order and the wall seconds of the whole load."""
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda r: _stream(url, model, r, timeout_s), requests))
    return results, time.monotonic() - start


def percentiles(values: list[float], points=(50, 90, 99)) -> dict[str, float]:
    if len(values) < 2:
        return {f"p{p}": (values[0] if values else float("nan")) for p in points}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {f"p{p}": cuts[p - 1] for p in points}


def summary(results: list[LoadResult], wall_s: float) -> dict:
    """Latency percentiles (ms) over the requests that completed, and throughput."""
    done = [r for r in results if r.status == 200 and r.finish_reason == "length"]
    tokens = sum(len(r.tokens) for r in results if r.status == 200)
    return {
        "requests": len(results),
        "completed": len(done),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s,
        "ttft_ms": {k: 1e3 * v for k, v in percentiles([r.ttft_s for r in done]).items()},
        "tpot_ms": {
            k: 1e3 * v
            for k, v in percentiles([r.tpot_s for r in done if r.tpot_s is not None]).items()
        },
    }
