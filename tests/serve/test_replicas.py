"""Replicas behind the gateway: three `headwise serve` processes of one tiny model behind an
in-process gateway ([replicas.pool]). Load spreads, shared prefixes stick to one replica, and a
replica SIGKILLed mid-stream costs no client a token: every stream ends as an uninterrupted run
would (greedy), the dead replica is skipped, and it gets traffic again once it is back."""

from __future__ import annotations

import asyncio
import collections
import random
import signal
import subprocess
import time

import httpx
import openai
import pytest

from headwise.serve import parse_config
from headwise.serve.config import ConfigError
from headwise.serve.replicas import ReplicaPool, affinity_key

from .conftest import LiveServer, ServeProcess, metrics_values, wait_healthy

KEY = "sk-replica-test-key"
KEY_ENV = "HEADWISE_TEST_REPLICA_KEY"
SYSTEM = "You are a careful assistant for a shipping company. " * 5  # 260 chars: over affinity_chars
AFFINITY_CHARS = 200


# ---------------------------------------------------------------- config and routing, no servers
def _config(**pool) -> dict:
    return {"replicas": {"pool": {"urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"], "models": ["m"], **pool}}}


@pytest.mark.parametrize(
    "pool, message",
    [
        ({"urls": []}, "lists no urls"),
        ({"urls": ["127.0.0.1:8000"]}, "is not an http(s) URL"),
        ({"urls": ["http://127.0.0.1:8000/v1"]}, "give the server's root URL"),
        ({"urls": ["http://a:1", "http://a:1/"]}, "lists a url twice"),
        ({"models": []}, "lists no models"),
        ({"affinity_slack": -1}, "affinity_slack must be an integer >= 0"),
        ({"health_interval": 0}, "health_interval > 0"),
        ({"urls": "http://a:1"}, "urls must be a list"),
        ({"retry": 2}, "unknown key(s) retry"),
        ({"idle_timeout": 0}, "idle_timeout must be > 0 seconds"),
        ({"total_timeout": -1}, "total_timeout must be > 0 seconds"),
        ({"max_response_bytes": 10}, "max_response_bytes must be an integer >= 1024"),
    ],
)
def test_config_errors_name_the_key(pool, message):
    with pytest.raises(ConfigError, match=r"\[replicas\.pool\]") as e:
        parse_config(_config(**pool))
    assert message in str(e.value)


def test_replica_limits_default_to_the_sets_timeout():
    spec = parse_config(_config(timeout=7.5)).replicas["pool"]
    assert (spec.idle_timeout, spec.total_timeout, spec.max_response_bytes) == (7.5, 3600.0, 256 << 20)
    with pytest.raises(ConfigError, match=r"\[server\] stall_timeout must be > 0 seconds"):
        parse_config({**_config(), "server": {"stall_timeout": 0}})


def test_config_names_and_routes():
    cfg = parse_config({**_config(), "routes": {"chat": {"targets": ["pool/m"]}}})
    assert "pool/m" in cfg.model_names() and cfg.replicas["pool"].urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    clash = {**_config(), "providers": {"pool": {"base_url": "http://x/v1", "models": ["m"]}}}
    with pytest.raises(ConfigError, match="name both a provider and a replica set"):
        parse_config(clash)


def _pool(n=3, slack=2, seed=0) -> ReplicaPool:
    spec = parse_config(_config(urls=[f"http://10.0.0.{i}:8000" for i in range(n)], affinity_slack=slack))
    return ReplicaPool(spec.replicas["pool"], client=None, rng=random.Random(seed))


def test_pick_affinity_yields_to_load_and_health():
    pool = _pool()
    keys = [f"system prompt {i} " * 20 for i in range(60)]
    home = {k: pool.pick("m", k)[0] for k in keys}
    assert all(pool.pick("m", k) == (home[k], "affinity") for k in keys)  # the same key, the same replica
    assert len(set(home.values())) == 3  # and keys spread over all of them
    k = keys[0]
    others = [r for r in pool.replicas if r is not home[k]]
    home[k].in_flight = 3  # 3 beyond the least busy (0) > slack 2: least loaded of two instead
    picked = {pool.pick("m", k)[0] for _ in range(40)}
    assert home[k] not in picked and picked <= set(others)
    home[k].in_flight = 2  # within the slack: back home
    assert pool.pick("m", k) == (home[k], "affinity")
    home[k].in_flight = 0
    # a replica that goes down takes only its own keys elsewhere (rendezvous hashing)
    dead = home[keys[0]]
    pool.down(dead, "test")
    moved = {kk for kk in keys if pool.pick("m", kk)[0] is not home[kk]}
    assert moved == {kk for kk in keys if home[kk] is dead}
    assert all(pool.pick("m", kk)[0] is not dead for kk in keys)


def test_pick_balanced_prefers_the_less_busy_of_two():
    pool = _pool(n=3, seed=1)
    a, b, c = pool.replicas
    a.in_flight, b.in_flight, c.in_flight = 5, 1, 0
    counts = collections.Counter(pool.pick("m", None)[0].url for _ in range(300))
    assert a.url not in counts  # always paired with a less busy one
    assert counts[c.url] > counts[b.url] > 0  # c wins both its pairs, b only the one with a
    assert pool.pick("m", None, exclude={b, c})[0] is a
    assert pool.pick("other-model", None)[0] is not None  # /health not polled yet: every model
    for r in pool.replicas:
        r.states = {"m": "ready", "other-model": "failed"}
    assert pool.pick("other-model", None) == (None, "") and pool.pick("m", None)[0] is not None
    assert "model 'other-model' is failed there" in pool.reasons("other-model")


def test_affinity_key():
    long = [{"role": "system", "content": "x" * 300}, {"role": "user", "content": "hi"}]
    assert affinity_key("chat", {"messages": long}, 256) == affinity_key(
        "chat", {"messages": long[:1] + [{"role": "user", "content": "bye"}]}, 256
    )
    assert affinity_key("chat", {"messages": [{"role": "user", "content": "short"}]}, 256) is None
    assert affinity_key("completions", {"prompt": "y" * 300}, 256) == "y" * 256
    assert affinity_key("completions", {"prompt": "y" * 300}, 0) is None
    assert affinity_key("embeddings", {"input": "y" * 300}, 10) is None


# ---------------------------------------------------------------- live: 3 replicas, one gateway
@pytest.fixture(scope="module")
def replicas(tiny_dir, servers_dir):
    config = {"server": {"api_keys": [KEY], "api_key_env": ""}, "models": {"tiny": {"source": str(tiny_dir)}}}
    procs = [ServeProcess(config, servers_dir, f"replica{i}") for i in range(3)]  # start together
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:  # drain all at once, then wait for each
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def gateway(replicas):
    from headwise.serve import create_app

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, KEY)
        pool = {
            "urls": [r.url for r in replicas],
            "models": ["tiny"],
            "api_key_env": KEY_ENV,
            "health_interval": 0.2,
            "affinity_chars": AFFINITY_CHARS,
            "affinity_slack": 8,
            "timeout": 30,
        }
        live = LiveServer(create_app(parse_config({"server": {"api_key_env": ""}, "replicas": {"pool": pool}})))
        live.start()
        yield live
        live.stop()


@pytest.fixture
def aclient(gateway):
    return lambda: openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=120)


def served(replica) -> float:
    """Chat and completion requests a replica answered (its own counter)."""
    return sum(
        v
        for labels, v in metrics_values(replica.url, "headwise_requests_total").items()
        if dict(labels).get("model") == "tiny" and dict(labels).get("status") == "200"
    )


def counts(replicas) -> list[float]:
    return [served(r) for r in replicas]


async def _stream(client, kind: str, prompt: str, max_tokens: int, progress=None, **kw) -> tuple:
    """One streamed request through the openai client -> (text, chunk ids, finish reason, usage)."""
    common = dict(model="pool/tiny", max_tokens=max_tokens, temperature=0, stream=True, **kw)
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        stream = await client.chat.completions.create(messages=messages, **common)
    else:
        stream = await client.completions.create(prompt=prompt, **common)
    text, ids, finish, usage = "", set(), None, None
    async for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += (c.delta.content if kind == "chat" else c.text) or ""
            finish = c.finish_reason or finish
        if progress is not None:
            progress[prompt] += 1
    return text, ids, finish, usage


def test_load_spreads_over_the_replicas(gateway, replicas, aclient):
    before = counts(replicas)

    async def run():
        async with aclient() as c:
            return await asyncio.gather(
                *(_stream(c, "completions", f"Question {i}:", 24, extra_body={"ignore_eos": True}) for i in range(12))
            )

    results = asyncio.run(run())
    assert all(finish == "length" and len(ids) == 1 for _, ids, finish, _ in results)
    got = [a - b for a, b in zip(counts(replicas), before)]
    assert sum(got) == 12 and min(got) >= 1, got  # least outstanding of two: none left idle


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(gateway, replicas):
    before = counts(replicas)
    hits = [metrics_values(r.url, "headwise_engine_prefix_cache_hits").get((("model", "tiny"),), 0) for r in replicas]
    for q in ("Where is my parcel?", "Can I change the address?", "What does express cost?", "Do you ship abroad?"):
        body = {
            "model": "pool/tiny",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            "max_tokens": 4,
            "temperature": 0,
        }
        r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    got = [a - b for a, b in zip(counts(replicas), before)]
    assert sorted(got) == [0, 0, 4], got
    home = replicas[got.index(4)]
    after = metrics_values(home.url, "headwise_engine_prefix_cache_hits")[(("model", "tiny"),)]
    assert after > hits[got.index(4)]  # the point of it: the prompt's prefix was found cached


def test_resume_on_one_replica_continues_the_text(replicas):
    """What failover asks of a replica, asked directly: the ids and characters of a cut stream
    in, the rest of the text out, equal to the uninterrupted run's (greedy and seeded)."""
    url = replicas[0].url + "/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11, "top_k": 50}):
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, **sampling}
        pieces = _sse(url, {**body, "stream": True, "headwise": {"token_ids": True}}, headers)
        ids = [t for p in pieces for t in p["headwise"]["token_ids"]]
        texts = [p["choices"][0]["text"] for p in pieces]
        assert len(ids) == 40
        cut = 17
        sent = "".join(texts[:cut])
        resume = {"token_ids": ids[:cut], "text_chars": len(sent)}
        rest = _sse(url, {**body, "stream": True, "headwise": {"resume": resume}}, headers)
        assert all("headwise" not in p for p in rest)  # not asked for: plain OpenAI chunks
        assert sent + "".join(p["choices"][0]["text"] for p in rest) == "".join(texts)
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
    r = httpx.post(url, json={**body, "headwise": {"resume": {"token_ids": ids, "text_chars": 0}}}, headers=headers)
    assert r.status_code == 400 and "nothing is left to generate" in r.json()["error"]["message"]
    r = httpx.post(url, json={**body, "n": 2, "headwise": {"resume": resume}}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "headwise.resume"


def test_resume_releases_text_held_back_at_the_seam(replicas, smol):
    """Cut where the replica holds text back (it could start a stop string): the resumed replica
    sends that text first, so the client's text is whole."""
    url = replicas[1].url + "/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "The harbour at dawn", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    ids = [
        t
        for p in _sse(url, {**body, "stream": True, "headwise": {"token_ids": True}}, headers)
        for t in p["headwise"]["token_ids"]
    ]
    decode = smol.tokenizer.decode
    k = next(i for i in range(12, 29) if decode(ids[: i + 1])[len(decode(ids[:i])) :].strip("\ufffd"))
    tail = decode(ids[: k + 1])[len(decode(ids[:k])) :]  # the text token k adds
    stop = {"stop": [tail + "\x07"]}  # never completes, but holds `tail` back when the text ends with it
    pieces = _sse(url, {**body, **stop, "stream": True, "headwise": {"token_ids": True}}, headers)
    texts = [p["choices"][0]["text"] for p in pieces]
    assert [t for p in pieces for t in p["headwise"]["token_ids"]] == ids
    sent = "".join(texts[: k + 1])
    assert len(sent) < len(decode(ids[: k + 1]))  # held back at the cut
    resume = {"token_ids": ids[: k + 1], "text_chars": len(sent)}
    rest = _sse(url, {**body, **stop, "stream": True, "headwise": {"resume": resume}}, headers)
    assert sent + "".join(p["choices"][0]["text"] for p in rest) == "".join(texts) == decode(ids)


def _sse(url, body, headers) -> list[dict]:
    import json

    out = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


TALE = "A long tale of ships and harbours, told slowly by the fire. " * 4  # over affinity_chars


def _prompts(pool) -> list[tuple[str, str]]:
    """Three chat and three completion prompts whose long shared prefixes all have the same home
    replica (the gateway's own pick chooses the completions' opening), so one SIGKILL cuts all six."""
    chat = [("chat", f"{TALE}Tell me story number {i}.") for i in range(3)]
    key = affinity_key("chat", {"messages": [{"role": "user", "content": chat[0][1]}]}, AFFINITY_CHARS)
    home = pool.pick("tiny", key)[0]
    opening = next(
        o
        for o in (f"Chapter {j}. {TALE}" for j in range(100))
        if pool.pick("tiny", affinity_key("completions", {"prompt": o}, AFFINITY_CHARS))[0] is home
    )
    return chat + [("completions", f"{opening}Part {i}.") for i in range(3)]


def test_sigkill_mid_stream_loses_no_token(gateway, replicas, aclient):
    pool = gateway.app.state.serve.gateway.pools["pool"]
    prompts = _prompts(pool)
    kw = dict(extra_body={"ignore_eos": True}, stream_options={"include_usage": True})

    async def run(kill: bool):
        progress = collections.Counter()
        async with aclient() as c:
            tasks = [asyncio.create_task(_stream(c, k, p, 120, progress, **kw)) for k, p in prompts]
            victim = None
            if kill:
                while min(progress[p] for _, p in prompts) < 3:
                    await asyncio.sleep(0.002)
                busiest = max(pool.replicas, key=lambda r: r.in_flight)
                assert busiest.in_flight == len(prompts)  # all six at home (affinity_slack = 8)
                victim = next(s for s in replicas if s.url == busiest.url)
                victim.proc.send_signal(signal.SIGKILL)
            return await asyncio.gather(*tasks), victim

    reference, _ = asyncio.run(run(kill=False))
    failovers = _failovers(gateway)
    killed, victim = asyncio.run(run(kill=True))
    for (kind, prompt), ref, got in zip(prompts, reference, killed):
        assert got[1] == {next(iter(got[1]))}  # one stream id from the first chunk to the last
        assert got[2] == ref[2] == "length"
        assert got[0] == ref[0], (kind, prompt)  # greedy: not a character lost or repeated
        assert got[3] == ref[3] and ref[3].completion_tokens == 120  # usage counts both replicas' tokens
    assert _failovers(gateway) - failovers == len(prompts)  # every stream really moved, once
    victim.proc.wait(timeout=10)

    # the dead replica is skipped: everything still answers, nothing is sent its way
    dead = next(r for r in pool.replicas if r.url == victim.url)
    health = httpx.get(gateway.url + "/health").json()
    assert not dead.up and health["replicas"]["pool"][victim.url].startswith("down: ")
    sent_before = _sent_to(gateway, victim.url)
    for i in range(6):
        r = httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "pool/tiny", "prompt": f"Item {i}", "max_tokens": 3, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    assert _sent_to(gateway, victim.url) == sent_before

    # back: restarted on its port, its /health turns 200, the gateway polls it back in
    victim.proc = subprocess.Popen(victim.proc.args, stdout=victim.log_path.open("a"), stderr=subprocess.STDOUT)
    assert wait_healthy(victim.url, 120, lambda: victim.proc.poll() is None or pytest.fail(victim.log()))
    deadline = time.time() + 10
    while not dead.up and time.time() < deadline:
        time.sleep(0.05)
    assert dead.up

    async def burst():
        async with aclient() as c:
            await asyncio.gather(*(_stream(c, "completions", f"Again {i}", 16, **kw) for i in range(9)))

    asyncio.run(burst())
    assert served(victim) >= 1  # a fresh process: every request it counts came after the restart


def _sent_to(gateway, url: str) -> float:
    values = metrics_values(gateway.url, "headwise_gateway_replica_requests_total")
    return sum(v for labels, v in values.items() if dict(labels)["replica"] == url)


def _failovers(gateway) -> float:
    values = metrics_values(gateway.url, "headwise_gateway_failovers_total")
    return values.get((("outcome", "resumed"), ("target", "pool/tiny")), 0.0)
