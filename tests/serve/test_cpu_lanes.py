"""One model's slow chat template does not hold another model's requests (issue 43): a template with
nested loops rendered for its whole budget on every request and filled the pool shared by all models,
so the other model's requests timed out. Each model's CPU jobs now have lanes of their own
(serve/openai/common.py).

An in-process server over two copies of the tiny random Llama: `slow`, whose chat template spends
~1.4M steps of its 2M budget in empty loops before SmolLM2's template, and `fast`, as it is.
"""

import json
import shutil
import threading
import time

import httpx
import pytest

from headwise.models.chat_template import DEFAULT_LIMITS
from headwise.serve import create_app, parse_config
from headwise.serve.openai.common import SMALL_WORKERS

from .conftest import LiveServer

LOOPS = 1200  # 1,440,000 loop steps a render: within chat_template.Limits.steps, ~0.6 s here
SLOW = 4 * SMALL_WORKERS  # small jobs of the slow model: four rounds of its small lane (with three, the fast
# chat ended after the second round once in a quiet full run: GIL-shared with two renders, it took ~1 s)
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def srv(tiny_dir, tmp_path_factory):
    assert LOOPS * LOOPS < DEFAULT_LIMITS.steps  # each render finishes: slow, not refused
    slow_dir = tmp_path_factory.mktemp("slow-template") / "tiny"
    shutil.copytree(tiny_dir, slow_dir)
    cfg_path = slow_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        f"{{%- for i in range({LOOPS}) %}}{{% for j in range({LOOPS}) %}}{{% endfor %}}{{% endfor -%}}"
        + cfg["chat_template"]
    )
    cfg_path.write_text(json.dumps(cfg))
    models = {"fast": {"source": str(tiny_dir)}, "slow": {"source": str(slow_dir)}}
    server = LiveServer(create_app(parse_config({"server": {"api_key_env": ""}, "models": models}))).start()
    yield server
    server.stop()


def chat(srv, model: str) -> httpx.Response:
    body = {"model": model, "messages": MSG, "max_tokens": 1, "temperature": 0}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)


def test_a_slow_template_holds_only_its_own_model(srv):
    assert chat(srv, "slow").status_code == 200  # it renders, within its budget
    assert chat(srv, "fast").status_code == 200  # and the fast one has paid its first request's costs
    done: list[tuple[str, int]] = []  # (model, status) in the order they complete
    lock = threading.Lock()

    def ask(model):
        r = chat(srv, model)
        with lock:
            done.append((model, r.status_code))

    slow = [threading.Thread(target=ask, args=("slow",)) for _ in range(SLOW)]
    for t in slow:
        t.start()
    time.sleep(0.3)  # the slow model's jobs are in: rendering, or queued in its lane
    ask("fast")
    for t in slow:
        t.join()
    assert sorted(done) == sorted([("slow", 200)] * SLOW + [("fast", 200)])
    before = [m for m, _ in done].index("fast")
    # in one pool shared by both models the fast chat's job queued behind all of the slow ones and
    # ended after them (index SLOW); in a lane of its own it ends while the slow lane's last round
    # still runs (how many rounds came before it depends on the machine: a render takes 0.3-0.6 s)
    assert before < SLOW - SMALL_WORKERS, done
