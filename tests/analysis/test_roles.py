"""Role detectors on planted heads (weights set by hand) and on a trained induction head."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headwise.analysis import capture, from_ids, head_roles
from headwise.analysis.roles import ROLES, THRESHOLDS, induction_batch, induction_scores
from headwise.attention import MultiHeadAttention

T = 24  # tokens per row; ids are positions, embedded one-hot
BETA = 60.0  # score of the planted key: the softmax puts ~all mass there


def _queries(rule, C):
    """W_Q (C, C) with q_i = BETA * sum of e_j for j in rule(i) (so q_i . k_j = BETA where
    planted), as a map on one-hot position inputs e_i."""
    w = torch.zeros(C, C)
    for i in range(C):
        for j in rule(i):
            if 0 <= j < C:
                w[j, i] = BETA
    return w


PLANTED_CAUSAL = {  # head -> (rule, expected labels)
    0: (lambda i: [i - 1], ["previous"]),
    1: (lambda i: [0], ["sink"]),
    2: (lambda i: [i - 3], ["offset -3"]),
    3: (lambda i: [i - 1, i - 2, i - 3], ["local"]),
    4: (lambda i: [1], ["long_range"]),  # always the earliest non-sink token
    5: (lambda i: [], ["broad"]),  # q = 0: uniform over what it sees
}
PLANTED_BIDIRECTIONAL = {
    0: (lambda i: [i + 1], ["next"]),
    1: (lambda i: [i + 2], ["offset +2"]),
    2: (lambda i: [0], ["sink"]),
}


class Planted(nn.Module):
    """Every layer reads the same one-hot position vectors; head h of a layer gets the
    query map of its rule, keys are the identity (D = C, no bias)."""

    def __init__(self, plan: dict, causal: bool, layers: int = 2):
        super().__init__()
        self.config = SimpleNamespace(causal=causal, vocab_size=T)
        self.causal = causal
        H = len(plan)
        self.layers = nn.ModuleList(MultiHeadAttention(T, H, head_dim=T) for _ in range(layers))
        scale = T**0.5  # undo 1/sqrt(D)
        with torch.no_grad():
            for attn in self.layers:
                wq = torch.cat([_queries(rule, T) * scale for rule, _ in plan.values()])
                wk = torch.eye(T).repeat(H, 1)
                wv = torch.randn(H * T, T)
                attn.load_projections(wq, wk, wv, torch.randn(T, H * T))

    def forward(self, ids, attention_mask=None):
        x = F.one_hot(ids, T).float()
        kpm = None if attention_mask is None else attention_mask == 0
        return [attn(x, is_causal=self.causal, key_padding_mask=kpm) for attn in self.layers]


@pytest.mark.parametrize(
    "causal,plan", [(True, PLANTED_CAUSAL), (False, PLANTED_BIDIRECTIONAL)], ids=["causal", "bidirectional"]
)
def test_planted_heads_get_their_label_and_no_other(causal, plan):
    model = Planted(plan, causal)
    batch = from_ids([list(range(T))] * 2 + [list(range(T - 5))])  # one padded row
    _, cap = capture(model, batch)
    assert cap.pattern[0][0, 0, 5, 4] > 0.99 if causal else cap.pattern[0][0, 0, 5, 6] > 0.99  # planted as meant
    roles = head_roles(model, [batch], induction=False)
    for layer in range(2):
        for h, (_, want) in plan.items():
            assert roles.labels(layer, h) == want, (h, {r: round(roles.score(r, layer, h), 3) for r in roles.scores})
            role = "offset" if want[0].startswith("offset") else want[0]
            assert roles.score(role, layer, h) >= max(0.6, THRESHOLDS[role])


def test_padding_is_not_counted():
    """A padded copy of a row adds no evidence: scores equal those of the unpadded row."""
    model = Planted(PLANTED_CAUSAL, True)
    alone = head_roles(model, [from_ids([list(range(T - 6))])], induction=False)
    padded = head_roles(model, [from_ids([list(range(T - 6)), list(range(T))])], induction=False)
    short = from_ids([list(range(T - 6)), list(range(T - 6))])
    twice = head_roles(model, [short], induction=False)
    for r in ROLES[:-1]:
        assert torch.allclose(alone.scores[r][0], twice.scores[r][0], atol=1e-6)
    assert padded.scores["previous"][0][0] > 0.95


# ------------------------------------------------------------------ induction, trained

V, CTX = 64, 32


class AttnOnly(nn.Module):
    """Two attention-only layers (pre-LayerNorm, learned positions), as in Olsson et al. 2022."""

    def __init__(self, C=64, H=4):
        super().__init__()
        self.config = SimpleNamespace(causal=True, vocab_size=V)
        self.embed, self.pos = nn.Embedding(V, C), nn.Embedding(2 * CTX, C)
        self.norms = nn.ModuleList(nn.LayerNorm(C) for _ in range(2))
        self.layers = nn.ModuleList(MultiHeadAttention(C, H) for _ in range(2))
        self.out = nn.Linear(C, V)

    def forward(self, ids, attention_mask=None):
        x = self.embed(ids) + self.pos.weight[: ids.shape[1]]
        for norm, attn in zip(self.norms, self.layers):
            x = x + attn(norm(x), is_causal=True)
        return self.out(x)


def _repeats(B, g):
    """Random tokens with a random segment (length 4-12, at a random place) repeated right after
    it; the loss is on the repeat, so only copying from the earlier occurrence helps (a fixed
    offset does not: the segment length varies)."""
    x = torch.randint(0, V, (B, CTX), generator=g)
    target = torch.zeros(B, CTX, dtype=torch.bool)
    for b in range(B):
        n = int(torch.randint(4, 13, (), generator=g))
        s = int(torch.randint(0, CTX - 2 * n + 1, (), generator=g))
        seg = torch.randperm(V, generator=g)[:n]
        x[b, s : s + n] = x[b, s + n : s + 2 * n] = seg
        target[b, s + n : s + 2 * n - 1] = True  # position p predicts token p + 1
    return x, target


def test_trained_two_layer_model_grows_an_induction_head_the_detector_finds():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = AttnOnly()
    before = head_roles(model, [], induction=True, n_induction=12, vocab=(0, V))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(1500):  # the phase change comes after ~300 steps
        x, t = _repeats(64, g)
        logits = model(x)[:, :-1]
        loss = F.cross_entropy(logits[t[:, :-1]], x[:, 1:][t[:, :-1]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.15:
            break
    assert loss.item() < 0.3, f"did not learn to copy (loss {loss.item():.3f} after {step + 1} steps)"
    model.eval()
    roles = head_roles(model, [], induction=True, n_induction=12, vocab=(0, V))
    ind = roles.scores["induction"]
    assert float(ind[1].max()) > 0.5  # a second-layer head looks back at "what came next"
    found = [(l, h) for l in range(2) for h in range(4) if "induction" in roles.labels(l, h)]
    assert found and all(l == 1 for l, _ in found)  # induction needs composition: layer 1 only
    assert not any("induction" in before.labels(l, h) for l in range(2) for h in range(4))
    # the score is the mass on the token after the earlier occurrence, read off the pattern
    b, start = induction_batch(model, n=12, rows=4, seed=1, vocab=(0, V))
    _, cap = capture(model, b)
    l, h = found[0]
    p = cap.pattern[l][:, h]
    assert torch.allclose(
        induction_scores(cap.pattern[l], start, 12)[h],
        torch.stack([p[:, start + 12 + t, start + t + 1] for t in range(11)]).mean(),
        atol=1e-6,
    )
