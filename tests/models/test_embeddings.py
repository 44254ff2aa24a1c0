"""headwise.embed on all-MiniLM-L6-v2 against transformers + sentence-transformers' pooling."""

import torch

import headwise
import transformers as tf  # the independent reference

from headwise.models.builtin import resolve

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Un café très fort, s'il vous plaît!",
    "Attention weights are hints, not explanations. " * 40,
]


def test_minilm_embeddings_match_transformers_mean_pooling():
    path = resolve("all-minilm-l6-v2")
    model = headwise.load(path)
    ours = headwise.embed(model, SENTENCES, batch_size=2)
    tok = tf.AutoTokenizer.from_pretrained(path)
    hf = tf.AutoModel.from_pretrained(path).eval()
    batch = tok(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state
    m = batch["attention_mask"][..., None].float()
    ref = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
    assert ours.shape == (len(SENTENCES), 384)
    cos = (ours * ref).sum(-1)
    assert cos.min() >= 0.99999
    sims = ours @ ours.T
    assert sims[0, 1] > sims[0, 2]  # eating ~ eating, not carrying a baby
