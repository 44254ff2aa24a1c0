"""Bad command lines: one line on stderr naming the problem and the fix, exit 2, and no model loaded.

Each case is its own `python -m headwise.cli` process, as a user runs it; they start together (one a
core at a time). None of them imports torch (~1.5 s a process): the parser, the flags and the model
names are checked from torch-free modules (test_bad_input_is_answered_without_importing_torch)."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import ROOT, headwise

CASES = {
    "unknown model": (["generate", "nope", "--prompt", "hi"], ["unknown model 'nope'", "headwise models"]),
    "missing gguf": (["generate", "/tmp/does-not-exist.gguf", "--prompt", "hi"], ["no such file"]),
    "missing dir": (["embed", "./no/such/checkpoint", "--text", "a"], ["no such file"]),
    "not a gguf": (["chat", "README.md"], ["not a .gguf"]),
    "dir without config": (["generate", "tests", "--prompt", "hi"], ["without config.json"]),
    "negative max tokens": (
        ["generate", "--prompt", "hi", "--max-new-tokens", "-5"],
        ["--max-new-tokens", ">= 1", "-5"],
    ),
    "not an integer": (["generate", "--prompt", "hi", "--max-new-tokens", "many"], ["'many' is not an integer"]),
    "negative temperature": (["generate", "--prompt", "hi", "--temperature", "-1"], ["--temperature", ">= 0"]),
    "top-p above 1": (["chat", "--top-p", "1.5"], ["--top-p", "(0, 1]"]),
    "encoder for generate": (
        ["generate", "all-minilm-l6-v2", "--prompt", "hi"],
        ["embedding model", "smollm2-135m-instruct", "headwise embed"],
    ),
    "decoder for embed": (["embed", "smollm2-135m-instruct", "--text", "a"], ["chat model", "all-minilm-l6-v2"]),
    "unknown backend": (
        ["generate", "--backend", "nope", "--prompt", "hi"],
        ["unknown attention backend 'nope'", "sdpa", "math"],
    ),
    "backends zero tokens": (["backends", "-T", "0"], ["--tokens", ">= 1"]),
    "backends bad gqa": (["backends", "-H", "12", "--kv-heads", "5"], ["--heads 12", "--kv-heads 5", "divide"]),
    "demo zero rounds": (["demo", "--rounds", "0"], ["--rounds", ">= 1"]),
    "analyze unknown model": (["analyze", "nope"], ["unknown model 'nope'"]),
    "analyze prune 1": (["analyze", "all-minilm-l6-v2", "--prune", "1"], ["--prune must be in [0, 1)"]),
    "plan unknown preset": (["plan", "gpt5"], ["gpt5"]),
    "serve unknown model": (["serve", "nope"], ["unknown model 'nope'"]),
    "serve missing gguf": (["serve", "smollm2", "/tmp/does-not-exist.gguf"], ["no such file"]),
    "serve models and config": (["serve", "smollm2", "--config", "examples/gateway.toml"], ["not both"]),
    "serve bad port": (["serve", "--port", "70000"], ["--port", "1 to 65535"]),
}


@pytest.fixture(scope="module")
def ran():
    """case -> its CompletedProcess, every case run once, os.cpu_count() at a time."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {case: pool.submit(headwise, *args, timeout=120) for case, (args, _) in CASES.items()}
        return {case: f.result() for case, f in futures.items()}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, ran):
    (args, expected), r = CASES[case], ran[case]
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # no traceback, no usage block
    assert lines[0].startswith(f"headwise {args[0]}: "), lines[0]
    for part in expected:
        assert part in lines[0], (part, lines[0])
    assert "[loaded" not in r.stderr and r.stdout == ""  # checked before any model loads


def test_bad_input_is_answered_without_importing_torch():
    """`headwise --help`, every subcommand's --help and each bad command line above (but an unknown
    attention backend) end before torch is imported (0.13-0.2 s a process here, ~1.7 s with torch): one process runs them all through
    headwise.cli.main and then looks at sys.modules."""
    calls = [
        ["--help"],
        *(
            [c, "--help"]
            for c in ("plan", "backends", "generate", "chat", "embed", "models", "serve", "analyze", "demo")
        ),
    ]
    # but an unknown --backend: the backends' registry is filled as torch's modules import
    calls += [args for case, (args, _) in CASES.items() if case != "unknown backend"]
    code = (
        "import contextlib, io, json, sys\n"
        "from headwise.cli import main\n"
        "codes = []\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            codes.append(main(args))\n"
        "        except SystemExit as e:\n"
        "            codes.append(e.code)\n"
        "print(json.dumps([codes, 'torch' in sys.modules]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(calls)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0, r.stderr
    codes, torch_loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert codes == [0] * 10 + [2] * (len(CASES) - 1), codes
    assert not torch_loaded
