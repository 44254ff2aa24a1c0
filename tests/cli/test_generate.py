"""`headwise generate` with the real SmolLM2: the chat template by default, --raw for plain
continuation, and a line saying why the reply stopped."""

import re

from .conftest import headwise

REASON = re.compile(r"^\[finish_reason: (stop|length) ", re.M)


def test_chat_model_answers_through_its_template_and_says_why_it_stopped():
    # --weights fp32: the file dequantized, as transformers runs it. This prompt's first token is a
    # near-tie ("The" 25.33 vs "L" 25.24 in fp32) that the default's int8 activations flip.
    r = headwise(
        "generate", "--weights", "fp32", "--prompt", "What is the capital of France?", "--max-new-tokens", "40"
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout  # before: the first token was end-of-text, stdout empty
    assert REASON.search(r.stderr).group(1) == "stop", r.stderr


def test_a_bad_weights_value_names_the_valid_ones():
    r = headwise("generate", "--weights", "q3", "--prompt", "hi")
    assert r.returncode == 2
    assert "--weights" in r.stderr and "fp32" in r.stderr and "q4_1" in r.stderr


def test_raw_continuation_that_hits_the_limit_says_length():
    r = headwise("generate", "--raw", "--prompt", "The capital of France is", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), r.stderr
    assert REASON.search(r.stderr).group(1) == "length", r.stderr


def test_an_int8_kv_cache_from_the_command_line():
    r = headwise(
        "generate", "--kv-dtype", "int8", "--raw", "--prompt", "The capital of France is", "--max-new-tokens", "6"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and REASON.search(r.stderr).group(1) == "length", r.stderr
    r = headwise("generate", "--kv-dtype", "fp8", "--prompt", "hi")
    assert r.returncode == 2 and "--kv-dtype" in r.stderr and "int8" in r.stderr
