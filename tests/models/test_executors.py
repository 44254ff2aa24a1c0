"""The two executors (models/executors.py), chosen once per step: the fused one where nothing asks for
the modules, the reference where a hook does, and back when it is removed; what invalidates the fused
plan. Outputs are compared with the reference executor (blocks.ROUTE_ROWS = 0: the modules as written)."""

import copy

import pytest
import torch

import headwise
from headwise.analysis import hooks
from headwise.cache import ContiguousKVCache
from headwise.models import blocks, executors

from .conftest import hf_checkpoints
from .stepping import close
from .test_block_route import CONFIGS, _ids


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, CONFIGS, seed=7)


class _Steps:
    """One model decoded token by token over one cache, each step's executor recorded."""

    def __init__(self, model, ids, prefill=4):
        cfg = model.config
        self.model, self.ids, self.t = model, ids, prefill
        self.cache = ContiguousKVCache(cfg.num_layers, ids.shape[0], cfg.num_kv_heads, ids.shape[1], cfg.head_dim)
        self.ran = []
        model(ids[:, :prefill], self.cache.step(prefill))

    def __call__(self):
        real = executors.choose

        def spy(*args):
            got = real(*args)
            self.ran.append(got.name)
            return got

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(executors, "choose", spy)  # the decoder calls executors.choose at each step
            out = self.model(self.ids[:, self.t : self.t + 1], self.cache.step(1))
        self.t += 1
        return out


def _reference(model, ids, prefill=4):
    """The same decode through the modules as written: every step's logits (B, T - prefill, V)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks, "ROUTE_ROWS", 0)
        steps = _Steps(model, ids, prefill)
        return torch.cat([steps() for _ in range(prefill, ids.shape[1])], dim=1)


@torch.inference_mode()
def test_a_hook_registered_after_a_fused_step_sends_the_next_to_the_reference_and_back(saved):
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    ids = _ids(2, 10, seed=3)
    want = _reference(model, ids)
    steps, seen = _Steps(model, ids), []
    out = [steps(), steps()]
    handle = model.layers[1].mlp.down.register_forward_hook(lambda mod, args, y: seen.append(y.shape))
    out += [steps(), steps()]
    handle.remove()
    out += [steps() for _ in range(2)]
    assert steps.ran == ["fused", "fused", "reference", "reference", "fused", "fused"]
    assert seen == [(2, 1, model.config.d_model)] * 2  # the hook saw the two steps it was there for
    close(torch.cat(out, dim=1), want)


@torch.inference_mode()
def test_an_analysis_hook_point_is_seen_by_the_reference_executor(saved):
    """hooks.attached fills every attention's hook slot for one run: those steps take the reference
    executor and the capture sees them; after the run, the fused one again."""
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    ids = _ids(1, 9, seed=4)
    want = _reference(model, ids)
    steps = _Steps(model, ids)
    out = [steps()]
    with hooks.attached(model, capture=hooks.Capture(points=("z",))) as run:
        out.append(steps())
    assert sorted(run.capture.z) == list(range(model.config.num_layers))
    assert run.capture.z[0].shape[2] == 1  # the decode step's one token
    out += [steps() for _ in range(3)]
    assert steps.ran == ["fused", "reference", "fused", "fused", "fused"]
    close(torch.cat(out, dim=1), want)


@torch.no_grad()
def test_the_plan_is_made_once_and_again_only_after_a_change(saved):
    """Decode steps register nothing: the model's FusedPlan stays the same object from step to step.
    A module replaced (pruning does this), a buffer set (kv_map), an attention setting or a kernel
    switch changes it; invalidate() drops it (an in-place weight edit needs it: no counter sees one)."""
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    ids = _ids(1, 16, seed=5)
    steps = _Steps(model, ids)
    steps()
    plan = executors._PLANS[model]
    steps(), steps()
    assert executors._PLANS[model] is plan

    def remade(change) -> bool:
        nonlocal plan
        change()
        steps()
        new = executors._PLANS[model]
        remade, plan = new is not plan, new
        return remade

    last = model.layers[-1]
    assert remade(lambda: setattr(last.mlp, "down", copy.deepcopy(last.mlp.down)))
    assert remade(lambda: setattr(last.attn, "kv_map", None))  # a buffer set, even to what it was
    assert remade(lambda: setattr(last.attn, "backend", "auto"))  # an attention setting, even to what it was
    assert remade(lambda: executors.invalidate(model))  # what an in-place weight edit needs
    assert not remade(lambda: last.mlp.down.weight.mul_(1.0))  # in place: no counter sees it
    assert not remade(lambda: None)


@torch.inference_mode()
def test_a_copied_model_makes_its_own_plan(saved):
    """The plan lives beside the model, not in it: a deep copy, whose weights are new tensors, is
    planned over its own weights; editing the copy leaves the original's logits as they were."""
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    ids = _ids(1, 8, seed=6)
    steps = _Steps(model, ids)
    before = steps()
    twin = copy.deepcopy(model)
    twin.layers[-1].mlp.down.weight.mul_(-1.0)
    again = _Steps(model, ids)
    assert torch.equal(again(), before)
    flipped = _Steps(twin, ids)
    assert not torch.allclose(flipped(), before)
    assert flipped.ran == ["fused"] and executors._PLANS[twin] is not executors._PLANS[model]


def test_the_facts_that_choose_the_reference(saved):
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    x = torch.zeros(1, 1, model.config.d_model)
    with torch.inference_mode():
        assert executors.choose(model, x, None).name == "fused"
        model.train()
        assert executors.choose(model, x, None) is executors.REFERENCE  # training mode
        model.eval()
    assert executors.choose(model, x, None) is executors.REFERENCE  # gradients wanted
    with torch.no_grad():
        assert executors.choose(model, x, None).name == "fused"
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        try:
            assert executors.choose(model, x, None) is executors.REFERENCE  # a global hook
        finally:
            handle.remove()
        assert executors.choose(model, x, None).name == "fused"
