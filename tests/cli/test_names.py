"""Errors name the model as the user typed it, not by the GGUF's own metadata."""

import pytest

import headwise


def test_gguf_errors_name_the_model_as_typed():
    model = headwise.load("smollm2")  # an alias of the builtin; its GGUF says "SmolLM2 135M Instruct"
    assert model.config.name == "smollm2"
    with pytest.raises(ValueError, match=r"^smollm2 is a decoder"):
        headwise.embed(model, "a text")
