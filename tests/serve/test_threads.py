"""/metrics shows the torch thread count each engine steps with (headwise_engine_threads): the
cores other processes leave, within this machine's (core/governor.py)."""

import os

import httpx

from .conftest import auth, metrics_values


def test_metrics_report_the_engine_threads(main):
    r = httpx.post(
        main.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        headers=auth(),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    threads = metrics_values(main.url, "headwise_engine_threads")
    assert set(threads) >= {(("model", "tiny"),), (("model", "smollm2"),)}
    for n in threads.values():
        assert n == int(n) and 1 <= n <= (os.cpu_count() or 1)
