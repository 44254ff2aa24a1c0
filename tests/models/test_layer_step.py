"""The decode step's one kernel call per layer (models/layer_step.py, kernels/decoder_step.c):
taken where it applies, equal to Hugging Face transformers (fp32) and to the block's route made
of the same kernels one by one (quantized), and left alone where it does not apply."""

import copy

import pytest
import torch

import headwise
from headwise.cache import ContiguousKVCache, PagedKVCache
from headwise.cache.packed import PackedStep
from headwise.kernels import layer as kernel_layer
from headwise.models import executors
from headwise.runtime.threads import fit_threads, pin_threads

from .conftest import hf_checkpoints
from .stepping import assert_scattered, close, scattered
from .test_block_route import CONFIGS, TOL, V, _decode, _ids, tf


@pytest.fixture(autouse=True)
def two_threads():
    """Some tests here check work cut over 2 threads: pinned, so that the thread governor does not
    take one away on a loaded machine (it would, and rightly, for a user)."""
    pin_threads(2)
    fit_threads()  # set in this thread now, not at the next step
    yield
    pin_threads(None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, checkpoint dir): test_block_route's tiny models."""
    return hf_checkpoints(tmp_path_factory, CONFIGS, seed=7)


@pytest.fixture
def one_calls(monkeypatch):
    """The rows of each layer's one-call step, whether a layer ran alone (a stack of one) or in a
    stack of consecutive layers (kernel_layer.run_stack, one entry per layer)."""
    calls = []
    real_stack = kernel_layer.run_stack

    def spy_stack(steps, x):
        calls.extend([x.shape[0]] * len(steps))
        return real_stack(steps, x)

    monkeypatch.setattr(kernel_layer, "run_stack", spy_stack)
    return calls


def _without_one_call(fn, *args):
    """The same steps with the fused executor's C stack off: blocks.fused_layer, the kernels one by one."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executors, "STACK", False)
        return fn(*args)


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-bias", "llama-mqa-tied", "llama3-rope", "qwen2"])
@pytest.mark.parametrize("B", [1, 3])
@torch.inference_mode()
def test_decode_steps_take_one_call_and_match_hf(saved, one_calls, name, B):
    hf, path = saved(name)
    model = headwise.load(path)
    ids = _ids(B, 20, seed=B)
    got = _decode(model, ids, prefill=8)  # a prefill, then 12 one-token steps
    assert one_calls == [B] * (2 * 12)  # 2 layers x 12 decode steps; the prefill is not one
    assert (got - hf(ids).logits[:, 8:]).abs().max() <= TOL


@pytest.mark.parametrize("weights", ["q8_0", "q4_1", "q4_0"])
@torch.inference_mode()
def test_quantized_one_call_equals_the_same_kernels_called_one_by_one(saved, one_calls, weights):
    _, path = saved("llama-gqa")
    model = headwise.load(path, weights=weights)
    ids = _ids(2, 16, seed=11)
    got = _decode(model, ids, prefill=6)
    assert len(one_calls) == 2 * 10
    want = _without_one_call(_decode, model, ids, 6)
    assert torch.equal(got, want)  # the same kernels in the same order: the same bits


@torch.inference_mode()
def test_ragged_rows_write_and_read_their_own_slots(saved, one_calls):
    """Rows at different lengths after a right-padded prefill: each row writes its own slot and
    attends over its own keys; every row equals HF on that row alone."""
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    lengths, new = [3, 7, 5], 5
    ids = _ids(3, 7 + new, seed=5)
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, 3, cfg.num_kv_heads, 16, cfg.head_dim)
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
    model(ids[:, :7], cache=cache, attention_mask=mask)
    rows = [ids[b, :n].tolist() for b, n in enumerate(lengths)]
    outs = []
    for t in range(new):
        step_ids = ids[:, 7 + t : 8 + t]
        outs.append(model(step_ids, cache=cache)[:, -1])
        for b in range(3):
            rows[b].append(int(step_ids[b]))
    assert len(one_calls) == 2 * new
    for b in range(3):
        want = hf(torch.tensor([rows[b]])).logits[0, -new:]  # the logits at the fed tokens
        got = torch.stack([o[b] for o in outs])
        assert (got - want).abs().max() <= TOL, b


@torch.inference_mode()
def test_cases_it_leaves_to_the_route(saved, one_calls):
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    ids = _ids(2, 10, seed=3)
    cfg = model.config
    static = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 16, cfg.head_dim, static=True)
    model(ids[:, :6], cache=static)
    model(ids[:, 6:7], cache=static)  # a static cache (torch.compile's): its steps book outside the model
    assert one_calls == []
    for layer in model.layers:
        layer.attn.backend = "math"  # a backend asked for by name: the user's choice is kept
    plain = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 16, cfg.head_dim)
    model(ids[:, :6], cache=plain)
    model(ids[:, 6:7], cache=plain)
    assert one_calls == []


@pytest.mark.parametrize("block_size", [4, 3])  # whole tiles of 8 keys per block or not: the kernel's two lookups
@torch.inference_mode()
def test_packed_decodes_over_scattered_blocks_take_one_call_and_match_hf(saved, one_calls, block_size):
    """The engine's decode steps over a fragmented pool (blocks of a sequence not consecutive, as
    after other requests finished): one call per layer reading and writing through the block
    tables, every row equal to HF on its own sequence."""
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    cache = scattered(model, num_blocks=64, block_size=block_size)
    seqs = {s: _ids(1, 21, seed=20 + i)[0].tolist() for i, s in enumerate("abc")}
    prompt = {"a": 9, "b": 4, "c": 13}
    for s, ids in seqs.items():
        cache.add_sequence(s, ids[: prompt[s]])
        model(torch.tensor([ids[: prompt[s]]]), cache.packed([s], [prompt[s]], [ids[: prompt[s]]]))
    assert one_calls == []
    refs = {s: hf(torch.tensor([ids])).logits[0] for s, ids in seqs.items()}
    pos = dict(prompt)
    for _ in range(8):
        order = list(seqs)
        toks = [[seqs[s][pos[s]]] for s in order]
        out = model(torch.tensor([[t[0] for t in toks]]), cache.packed(order, [1] * 3, toks))[0]
        for b, s in enumerate(order):
            close(out[b], refs[s][pos[s]])
            pos[s] += 1
    assert one_calls == [3] * (2 * 8)  # 2 layers x 8 decode steps, all three rows in one call
    assert_scattered(cache, list(seqs))


@pytest.fixture
def stacks(monkeypatch):
    """The layer count of each run_stack call (one call per decode step where every layer applies)."""
    calls = []
    real = kernel_layer.run_stack

    def spy(steps, x):
        calls.append(len(steps))
        return real(steps, x)

    monkeypatch.setattr(kernel_layer, "run_stack", spy)
    return calls


@pytest.mark.parametrize("weights", [None, "q4_1", "q8_0"])
@torch.inference_mode()
def test_a_decode_step_runs_its_layers_in_one_stack_call_with_the_same_bits(saved, stacks, weights):
    """The stack is the layers' kernels chained in C: every decode step one call over all the
    layers, the logits bit for bit those of the same kernels called one by one from Python
    (blocks.fused_layer), and (fp32) equal to Hugging Face transformers."""
    hf, path = saved("llama-gqa")
    model = headwise.load(path, **({} if weights is None else {"weights": weights}))
    ids = _ids(2, 16, seed=13)
    got = _decode(model, ids, prefill=6)
    assert stacks == [model.config.num_layers] * 10  # 10 decode steps; the prefill is not one
    stacks.clear()
    want = _without_one_call(_decode, model, ids, 6)
    assert stacks == []
    assert torch.equal(got, want)
    if weights is None:
        assert (got - hf(ids).logits[:, 6:]).abs().max() <= TOL


@torch.inference_mode()
def test_a_hooked_layer_sends_the_step_to_the_reference_and_its_hook_runs(saved, stacks, one_calls):
    """A forward hook on a block (head analysis captures this way): every step runs the modules as
    written (executors.REFERENCE), so the hook sees every step, and the logits equal HF's."""
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    seen = []
    handle = model.layers[1].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    ids = _ids(1, 12, seed=4)
    try:
        got = _decode(model, ids, prefill=5)
    finally:
        handle.remove()
    assert stacks == [] and one_calls == []
    assert len(seen) == 1 + 7  # the prefill and every decode step
    assert (got - hf(ids).logits[:, 5:]).abs().max() <= TOL
    _decode(model, ids, prefill=5)  # the hook removed: the C stack again
    assert stacks == [model.config.num_layers] * 7


_LONG = {  # 2 KV heads x 4 query rows x 64 channels: past 1,024 keys a row's attention splits its heads over threads
    "llama-long": lambda: (
        tf.LlamaConfig(
            hidden_size=512,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=V,
            max_position_embeddings=1100,
            initializer_range=0.05,
        ),
        tf.LlamaForCausalLM,
    )
}


@torch.inference_mode()
def test_one_row_past_the_attention_threads_threshold_matches_hf(tmp_path_factory, one_calls):
    """A batch-1 decode whose attention crosses decode_attention.c's PARALLEL_MIN_WORK (2^19 key x
    row x channel products) inside the stack: its KV heads then go to the threads from the stack's
    own call (a nested team inside an inactive region made such a step 20x slower, 6 -> 125 ms at
    1,000 keys on SmolLM2); every step still equals HF."""
    hf, path = hf_checkpoints(tmp_path_factory, _LONG, seed=3)("llama-long")
    model = headwise.load(path)
    ids = _ids(1, 1036, seed=5)
    got = _decode(model, ids, prefill=1016)  # steps at 1,017 .. 1,036 keys: both sides of 1,024
    assert one_calls == [1] * (2 * 20)
    assert (got - hf(ids).logits[:, 1016:]).abs().max() <= TOL


@torch.inference_mode()
def test_a_batch_1_step_cuts_its_keys_over_the_threads_and_matches_hf(saved, stacks):
    """One KV head on 2 threads at 150-170 keys: the step's keys in two chunks, one a thread,
    merged by their log-sum-exp (decode_attention.c's hw_decode_attention_seq); every step equals HF."""
    hf, path = saved("llama-mqa-tied")
    model = headwise.load(path)
    assert torch.get_num_threads() == 2 and model.config.num_kv_heads == 1
    ids = _ids(1, 170, seed=21)
    got = _decode(model, ids, prefill=150)
    assert stacks == [model.config.num_layers] * 20
    assert (got - hf(ids).logits[:, 150:]).abs().max() <= TOL


def test_weights_edited_in_place_or_replaced_reach_the_one_call(saved, one_calls):
    """The fused plan is made again after a weight edited in place (the caller's invalidate) and
    after one replaced by another tensor (torch's registration counter), as HF with the same edits does."""
    _, path = saved("llama-gqa")
    hf = tf.LlamaForCausalLM.from_pretrained(path).eval()  # its own weights: this test edits them
    model = headwise.load(path)
    ids = _ids(1, 12, seed=13)
    with torch.no_grad():
        _decode(model, ids, prefill=1)  # plans made and cached (every step one row: one memo)
        for m in (model.layers[1].mlp.down, hf.model.layers[1].mlp.down_proj):
            m.weight.mul_(-0.5)  # in place: same tensor, which no counter sees...
        executors.invalidate(model)  # ...so the caller says so
        new_norm = torch.nn.Parameter(torch.rand(model.config.d_model) + 0.5)
        model.layers[0].attn_norm.weight = new_norm  # a new tensor
        hf.model.layers[0].input_layernorm.weight = torch.nn.Parameter(new_norm.detach().clone())
        got = _decode(model, ids, prefill=1)
        want = hf(ids).logits[:, 1:]
    assert one_calls == [1] * (2 * 2 * 12)  # the 1-token prefill too
    assert (got - want).abs().max() <= TOL


@torch.inference_mode()
def test_hooks_and_settings_changed_between_steps_reach_the_next_step(saved, stacks):
    """The fused plan (executors.FusedPlan) is checked each step against what may change: a hook
    added to a projection after the plan was made sends the next step to the reference executor
    (the hook sees it), removing it brings the C stack back; an attention backend set by hand takes
    its layer out of the stack (blocks.fused_layer honours it); every step equals HF."""
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    L, ids = model.config.num_layers, _ids(1, 12, seed=21)
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, ids.shape[1], cfg.head_dim)
    model(ids[:, :4], cache.step(4))
    steps = iter(range(4, ids.shape[1]))
    logits, seen = [], []

    def step():
        t = next(steps)
        logits.append(model(ids[:, t : t + 1], cache.step(1)))

    step(), step()  # the first makes the fused plan, the second runs from it
    assert stacks == [L, L]
    handle = model.layers[1].attn.qkv_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    step()
    assert stacks[2:] == [] and len(seen) == 1  # the reference executor: the modules ran the hook
    handle.remove()
    step()
    assert stacks == [L, L, L] and len(seen) == 1  # fused again
    model.layers[0].attn.backend = "math"
    step()
    assert stacks == [L, L, L, 1]  # layer 0 through the math backend (fused_layer), layer 1 stacked alone
    model.layers[0].attn.backend = "auto"
    step(), step()
    assert stacks == [L, L, L, 1, L, L]
    got = torch.cat(logits, dim=1)
    assert (got - hf(ids[:, :11]).logits[:, 4:]).abs().max() <= TOL


def test_a_module_replaced_or_edited_between_decode_steps_takes_part_in_the_next(saved, stacks):
    """A projection replaced by another module (pruning does this) between two decode steps, after
    the stack was remembered, and later its weight edited in place: the next steps run the new
    weights in the stack, as HF with the same changes. (The last layer's MLP: no key or value
    depends on it, so HF's full forward with the new weights is the reference after each change.)"""
    _, path = saved("llama-gqa")
    hf = tf.LlamaForCausalLM.from_pretrained(path).eval()  # its own weights: this test edits them
    model = headwise.load(path)
    cfg, ids = model.config, _ids(1, 10, seed=22)
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, ids.shape[1], cfg.head_dim)
    last = cfg.num_layers - 1
    with torch.no_grad():
        model(ids[:, :4], cache.step(4))
        for t in (4, 5):  # the stack remembered, then run from the memo
            model(ids[:, t : t + 1], cache.step(1))
        new = copy.deepcopy(model.layers[last].mlp.down)
        new.weight.mul_(-0.5)
        model.layers[last].mlp.down = new
        hf.model.layers[last].mlp.down_proj.weight.mul_(-0.5)
        swapped = torch.cat([model(ids[:, t : t + 1], cache.step(1)) for t in (6, 7)], dim=1)
        want_swapped = hf(ids).logits[:, 6:8]
        for w in (new.weight, hf.model.layers[last].mlp.down_proj.weight):
            w.mul_(3.0)  # in place: the same tensor, which no counter sees
        executors.invalidate(model)
        edited = torch.cat([model(ids[:, t : t + 1], cache.step(1)) for t in (8, 9)], dim=1)
        want_edited = hf(ids).logits[:, 8:]
    assert stacks == [cfg.num_layers] * 6
    assert (swapped - want_swapped).abs().max() <= TOL
    assert (edited - want_edited).abs().max() <= TOL


@pytest.mark.parametrize("weights", ["q4_1", "q8_0"])
@torch.inference_mode()
def test_quantized_blocks_and_norms_edited_in_place_reach_the_stack(saved, stacks, weights):
    """A quantized linear's blocks and the norms' weights are read through their own pointers, so
    edited in place after the fused plan was made (no invalidate), the next steps run the new numbers. The last layer's MLP (its norm and down
    projection) feeds no key or value, so a model loaded afresh, edited the same way, and run
    over the whole sequence at once is the reference; the edit moves the logits far more."""
    _, path = saved("llama-gqa")
    ids = _ids(2, 10, seed=23)

    def edit(model):
        last = model.layers[-1]
        last.mlp.down.blocks.copy_(last.mlp.down.blocks.flip(0))  # whole blocks of other rows
        last.mlp_norm.weight.mul_(-2.0)

    model = headwise.load(path, weights=weights)
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, ids.shape[1], cfg.head_dim)
    model(ids[:, :4], cache.step(4))
    for t in (4, 5):  # the stack remembered, then run from the memo
        model(ids[:, t : t + 1], cache.step(1))
    unedited = model(ids)[:, 6:]
    edit(model)
    got = torch.cat([model(ids[:, t : t + 1], cache.step(1)) for t in range(6, 10)], dim=1)
    fresh = headwise.load(path, weights=weights)
    edit(fresh)
    want = fresh(ids)[:, 6:]
    assert stacks == [cfg.num_layers] * 6
    err, moved = (got - want).abs().max(), (unedited - want).abs().max()
    assert err <= 1e-4 and moved >= 1000 * err, (err, moved)


@pytest.mark.parametrize("weights", [None, "q4_1"])
@torch.inference_mode()
def test_a_contiguous_cache_books_the_whole_stack_at_once(saved, monkeypatch, weights):
    """At every decode step a contiguous cache books every layer's key at once
    (claim_decode_stack) and the stack's descriptors are reused (kernel_layer.BoundStack): the
    logits are bit for bit those of each layer claiming its own key, and after the steps each
    layer's lengths are its own again: appending to one layer leaves the others where they were
    (the layers shared one lengths tensor, which must never be written in place)."""
    _, path = saved("llama-gqa")
    model = headwise.load(path, **({} if weights is None else {"weights": weights}))
    kinds, real = [], kernel_layer.run_stack
    monkeypatch.setattr(kernel_layer, "run_stack", lambda steps, x: kinds.append(type(steps)) or real(steps, x))
    ids = _ids(2, 14, seed=31)
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 20, cfg.head_dim)
    model(ids[:, :5], cache.step(5))
    got = torch.cat([model(ids[:, t : t + 1], cache.step(1)) for t in range(5, 14)], dim=1)
    assert kinds == [kernel_layer.BoundStack] * 9  # the fused plan was made at the prefill
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_layer.StackCall, "at", lambda *a: pytest.fail("the stack claim was not switched off"))
        mp.setattr(ContiguousKVCache, "claim_decode_stack", lambda *a: None)
        want = _decode(model, ids, prefill=5)
    assert torch.equal(got, want)
    assert [layer.lengths.tolist() for layer in cache.layers] == [[14, 14]] * cfg.num_layers
    k = torch.randn(2, cfg.num_kv_heads, 1, cfg.head_dim)
    cache.layer(0).update(k, k)  # the uniform path: one more token in layer 0 only
    assert cache.layer(0).lengths.tolist() == [15, 15] and cache.layer(1).lengths.tolist() == [14, 14]
    cache.layer(1).trim([3, 14])
    assert cache.layer(0).lengths.tolist() == [15, 15] and cache.layer(1).lengths.tolist() == [3, 14]
    assert cache.claim_decode_stack(2, cfg.num_layers) is None  # unequal lengths: nothing booked
    assert cache.layer(0).lengths.tolist() == [15, 15] and cache.layer(1).lengths.tolist() == [3, 14]
    full = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 7, cfg.head_dim)
    model(ids[:, :5], full.step(5))
    for t in (5, 6):  # the second through the stack claim
        model(ids[:, t : t + 1], full.step(1))
    with pytest.raises(ValueError, match="exceeds max_seq_len=7"):
        model(ids[:, 7:8], full.step(1))
    assert [layer.lengths.tolist() for layer in full.layers] == [[7, 7]] * cfg.num_layers


@pytest.mark.parametrize("fragmented", [False, True])
@torch.inference_mode()
def test_a_packed_step_books_the_whole_stack_at_once(saved, monkeypatch, fragmented):
    """The engine's packed decode steps, over sequences whose blocks are one run each or
    scattered through the pool (block tables): at every step the step books every
    layer at once (PackedStep.claim_stack) and the stack's descriptors are reused; the logits are
    bit for bit those of each layer claiming on its own, and the same rows as HF's."""
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    kinds, real = [], kernel_layer.run_stack
    monkeypatch.setattr(kernel_layer, "run_stack", lambda steps, x: kinds.append(type(steps)) or real(steps, x))
    seqs = {s: _ids(1, 18, seed=40 + i)[0].tolist() for i, s in enumerate("ab")}

    def run():
        cfg = model.config
        cache = (
            scattered(model, num_blocks=48, block_size=4)
            if fragmented
            else PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 48, 4)
        )
        for s, ids in seqs.items():
            cache.add_sequence(s, ids[:6])
            model(torch.tensor([ids[:6]]), cache.packed([s], [6], [ids[:6]]))
        out = []
        for t in range(6, 18):
            toks = [[seqs[s][t]] for s in seqs]
            out.append(model(torch.tensor([[x[0] for x in toks]]), cache.packed(list(seqs), [1, 1], toks))[0])
        if fragmented:
            assert_scattered(cache, list(seqs))
        return torch.stack(out)  # (12, 2, V)

    got = run()
    assert kinds == [kernel_layer.BoundStack] * 12
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PackedStep, "claim_stack", lambda *a: None)
        want = run()
    assert torch.equal(got, want)
    for b, ids in enumerate(seqs.values()):
        close(got[:, b], hf(torch.tensor([ids])).logits[0, 6:18])


@pytest.mark.parametrize("weights", [None, "q4_1"])
def test_two_threads_decode_one_model_over_their_own_caches(saved, weights):
    """The stack's descriptors are built per cache: two threads stepping the same model, each
    over its own cache, get what each gets alone (the threads interleave their steps; the GIL
    switches between them every few steps)."""
    import sys
    import threading

    _, path = saved("llama-gqa")
    model = headwise.load(path, **({} if weights is None else {"weights": weights}))
    prompts = [_ids(2, 40, seed=50), _ids(2, 40, seed=51)]
    with torch.inference_mode():
        alone = [_decode(model, ids, prefill=4) for ids in prompts]
    got, errors = [None, None], []

    def run(i):
        try:
            with torch.inference_mode():
                got[i] = _decode(model, prompts[i], prefill=4)
        except Exception as e:  # reported below, with the thread's index
            errors.append((i, e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch as often as the interpreter can: the steps interleave
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert all(torch.equal(g, a) for g, a in zip(got, alone))


def _by_the_route(model, fn, backend=None):
    """The same steps through blocks.fused_layer (no C stack): its kernels one by one writing the
    int8 cache through cache/quantized.py; with backend="math", PyTorch's math attention over the
    cache as quantized.py dequantizes it (a backend chosen by name also leaves the stack)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executors, "STACK", False)
        for layer in model.layers if backend else ():
            mp.setattr(layer.attn, "backend", backend)
        return fn()


# (model, rows, tokens, weights): llama-mqa-tied's one KV head on 2 threads at 150+ keys cuts a
# batch-1 step's keys into chunks over the threads (decode_attention.c's hw_decode_attention_seq).
# Not with quantized weights there: the chunks' merge moves the attention output by ~1e-7, which
# can flip the int8 rounding of the next linear's activations, a step of ~1e-2 in the logits.
@pytest.mark.parametrize(
    "name,B,T,weights",
    [(n, B, 24, w) for n, B in (("llama-gqa", 1), ("llama-gqa", 3)) for w in (None, "q4_1")]
    + [("llama-mqa-tied", 1, 170, None)],
)
@torch.inference_mode()
def test_an_int8_cache_decodes_in_the_stack_reading_int8(saved, stacks, weights, name, B, T):
    """kv_dtype="int8": the stack quantizes each new key and value as quantize_int8 does (the
    cache then holds the same int8 values and scales, bit for bit, as the route writes) and its
    kernel reads the int8 rows; logits within 2e-5 (fp32 weights: 1e-5 relative) of the route's
    (its kernels, attention over the dequantized rows) and (fp32 weights) of torch's math
    attention over the dequantized cache."""
    _, path = saved(name)
    model = headwise.load(path, **({} if weights is None else {"weights": weights}))
    ids = _ids(B, T, seed=17 + B)
    cfg = model.config
    assert torch.get_num_threads() == 2 and (T < 150 or cfg.num_kv_heads == 1)

    def run():
        cache = ContiguousKVCache(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, kv_dtype="int8")
        model(ids[:, : T - 17], cache.step(T - 17))
        logits = torch.cat([model(ids[:, t : t + 1], cache.step(1)) for t in range(T - 17, T)], dim=1)
        return logits, cache

    got, cache = run()
    assert stacks == [cfg.num_layers] * 17
    want, ref = _by_the_route(model, run)
    close(got, want, tol=2e-5)  # the chunks' merge sums in another order than one pass
    if weights is None:  # (quantized linears differ from the math route's by their own rounding)
        close(got, _by_the_route(model, run, backend="math")[0], tol=2e-5)
    pairs = [
        p
        for mine, theirs in zip(cache.layers, ref.layers)
        for p in zip(mine.store.k + mine.store.v, theirs.store.k + theirs.store.v)
    ]
    if T < 150:  # int8 values and fp32 scales, bit for bit
        assert all(torch.equal(a, b) for a, b in pairs)
    else:  # after a step whose keys were cut into chunks, the next layers' k, v differ by their rounding
        _assert_same_int8(pairs)


def _assert_same_int8(pairs):
    """The same int8 K/V and scales where k, v come to the cache rounded differently (within ~1e-6):
    a value at a rounding tie may differ by 1."""
    for a, b in pairs:
        if a.dtype is torch.int8:
            assert (a.int() - b.int()).abs().max() <= 1
            assert (a != b).float().mean() < 1e-3
        else:
            close(a, b, rel=1e-5)


@pytest.mark.parametrize("block_size", [4, 3])
@torch.inference_mode()
def test_an_int8_paged_pool_decodes_in_the_stack_over_scattered_blocks(saved, stacks, block_size):
    """The engine's int8 pool (kv_dtype="int8"), fragmented: the stack writes through the block
    tables and reads int8 blocks wherever they lie; each row equals torch's math attention over
    the same pool stepped by the route, and the pools hold the route's int8 values and scales."""
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    seqs = {s: _ids(1, 21, seed=40 + i)[0].tolist() for i, s in enumerate("abc")}
    prompt = {"a": 9, "b": 4, "c": 13}

    def run():
        cache = scattered(model, num_blocks=64, block_size=block_size, kv_dtype="int8")
        for s, ids in seqs.items():
            cache.add_sequence(s, ids[: prompt[s]])
            model(torch.tensor([ids[: prompt[s]]]), cache.packed([s], [prompt[s]], [ids[: prompt[s]]]))
        pos, outs = dict(prompt), []
        for _ in range(8):
            order = list(seqs)
            toks = [[seqs[s][pos[s]]] for s in order]
            outs.append(model(torch.tensor([[t[0] for t in toks]]), cache.packed(order, [1] * 3, toks))[0])
            for s in order:
                pos[s] += 1
        return torch.stack(outs), cache

    got, cache = run()
    assert stacks == [model.config.num_layers] * 8
    assert_scattered(cache, list(seqs))
    close(got, _by_the_route(model, run, backend="math")[0], tol=2e-5)
    ref = _by_the_route(model, run)[1]  # (packed rows' projections round differently)
    _assert_same_int8(zip(cache._k + cache._v, ref._k + ref._v))


@pytest.mark.parametrize("block_size", [4, 3])  # whole tiles of 8 keys per block or not: the chunks' two units
@torch.inference_mode()
def test_an_int8_paged_sequence_alone_splits_its_keys_over_the_threads(saved, stacks, block_size):
    """A batch-1 step over an int8 pool's scattered blocks at 170 keys, one KV head on 2 threads:
    the keys cut into chunks at block boundaries, each read through its part of the block table;
    equal to torch's math attention over the same pool stepped by the route."""
    _, path = saved("llama-mqa-tied")
    model = headwise.load(path)
    ids = _ids(1, 178, seed=9)[0].tolist()
    assert torch.get_num_threads() == 2 and model.config.num_kv_heads == 1

    def run():
        cache = scattered(model, num_blocks=2 * (178 // block_size + 2), block_size=block_size, kv_dtype="int8")
        cache.add_sequence("a", ids[:170])
        model(torch.tensor([ids[:170]]), cache.packed(["a"], [170], [ids[:170]]))
        outs = [model(torch.tensor([[t]]), cache.packed(["a"], [1], [[t]]))[0, -1] for t in ids[170:]]
        return torch.stack(outs), cache

    got, cache = run()
    assert stacks == [model.config.num_layers] * 8
    assert_scattered(cache, ["a"])
    close(got, _by_the_route(model, run, backend="math")[0], tol=2e-5)
    ref = _by_the_route(model, run)[1]
    _assert_same_int8(zip(cache._k + cache._v, ref._k + ref._v))
