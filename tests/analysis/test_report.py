"""`headwise analyze` end to end on small models: files, figures, JSON, and the HTML page
driven in Debian's chromium by playwright (no network request, no console error)."""

import json
from pathlib import Path

import numpy as np
import pytest

import headwise
from headwise.analysis import Settings, analyze
from headwise.analysis.corpus import load_corpus
from headwise.analysis.report import write
from headwise.cli import main

CHROMIUM = Path("/usr/bin/chromium")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bert_report(tiny_bert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    rc = main(
        [
            "analyze",
            str(tiny_bert_dir),
            "--out",
            str(out),
            "--fit",
            "24",
            "--heldout",
            "24",
            "--seeds",
            "2",
            "--fractions",
            "0.25,0.5",
            "--quiet",
        ]
    )
    assert rc == 0
    return out


def _check_pngs(out: Path):
    import matplotlib.image as mpimg

    names = ["patterns.png", "roles.png", "ablation.png", "weights_vs_norms.png", "importance.png"]
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        img = mpimg.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert img[..., :3].std() > 0.01  # not a blank canvas


def test_encoder_report_files(bert_report):
    _check_pngs(bert_report)
    res = json.loads((bert_report / "analysis.json").read_text())
    assert res["view"]["tokens"][0] == "[CLS]" and "bank" in res["view"]["tokens"]
    T = len(res["view"]["tokens"])
    p = np.array(res["view"]["pattern"])
    assert p.shape == (2, 4, T, T) and np.allclose(p.sum(-1), 1, atol=1e-3)
    ab = res["ablation"]
    assert set(ab["curves"]) == {"importance", "importance_per_layer", "importance_mean_ablation", "random0", "random1"}
    assert set(ab["removable"]) == {"drop", "drop_retrieval"}
    pr = res["pruning"]
    assert pr["params_after"] < pr["params_before"] and pr["reload_max_abs_diff"] == 0.0
    assert pr["quality_after"]["cosine"] == pytest.approx(pr["quality_masked"]["cosine"], abs=1e-5)
    assert (bert_report / "pruned" / "model.safetensors").is_file()
    assert "<script src" not in (bert_report / "report.html").read_text()  # everything inline


def test_decoder_report(tiny_llama_tok_dir, tmp_path):
    model = headwise.load(tiny_llama_tok_dir)
    s = Settings(fit=2, heldout=2, seq_len=48, seeds=1, fractions=(0.2, 0.5), latency_rounds=2)
    res = analyze(model, load_corpus(), out=tmp_path, settings=s, show_progress=False)
    files = write(res, tmp_path)
    _check_pngs(tmp_path)
    assert files["html"].is_file()
    assert res["view"]["causal"] and res["ablation"]["metric"] == "perplexity"
    p = np.array(res["view"]["pattern"])  # causal: nothing above the diagonal
    assert np.abs(np.triu(p, k=1)).max() == 0
    assert res["corpus"]["fit_tokens"] == 2 * 48 and res["pruning"]["params_after"] < res["model"]["params"]


def test_html_page_in_chromium(bert_report):
    assert CHROMIUM.exists(), "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    from playwright.sync_api import sync_playwright

    data = json.loads((bert_report / "analysis.json").read_text())
    view = data["view"]
    requests, problems = [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM))
        try:
            page = browser.new_page()
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            url = (bert_report / "report.html").resolve().as_uri()
            page.goto(url)
            assert "pick a token" in page.text_content("#readout")

            page.select_option("#layer", "1")
            page.select_option("#head", "2")
            page.click(".ltok[data-i='3']")
            row = view["pattern"][1][2][3]
            best = int(np.argmax(row))
            text = page.text_content("#readout")
            assert text.startswith("layer 1, head 2, weights:")
            assert f'"{view["tokens"][3]}" (3) -> "{view["tokens"][best]}" ({best}) {row[best]:.3f}' in text
            edges = page.locator("line.edge")
            shown = {
                int(edges.nth(k).get_attribute("data-j")): float(edges.nth(k).get_attribute("data-w"))
                for k in range(edges.count())
            }
            assert {int(edges.nth(k).get_attribute("data-i")) for k in range(edges.count())} == {3}
            assert shown == pytest.approx({j: w for j, w in enumerate(row) if w >= 0.01}, abs=1e-5)
            assert set(page.text_content("#labels").split(", ")) == set(
                data["roles"]["heads"][1][2]["labels"] or ["none"]
            )

            page.select_option("#mode", "norms")  # the view follows the norms
            nrow = view["norms"][1][2][3]
            nbest = int(np.argmax(nrow))
            assert (
                f'norms: "{view["tokens"][3]}" (3) -> "{view["tokens"][nbest]}" ({nbest}) {nrow[nbest]:.3f}'
                in page.text_content("#readout")
            )

            page.select_option("#head", "mean")  # average over heads
            page.select_option("#mode", "pattern")
            mean_row = np.mean([view["pattern"][1][h][3] for h in range(4)], axis=0)
            assert f"({int(np.argmax(mean_row))}) {mean_row.max():.3f}" in page.text_content("#readout")

            page.select_option("#mode", "rollout")  # through all layers
            rrow = view["rollout"][3]
            assert page.text_content("#readout").startswith(
                f'rollout: "{view["tokens"][3]}" (3) -> "{view["tokens"][int(np.argmax(rrow))]}"'
            )
            page.select_option("#mode", "pattern")

            page.click(".ltok[data-i='3']")  # unpick: every row's edges again
            assert "pick a token" in page.text_content("#readout")
            assert len(
                {
                    page.locator("line.edge").nth(k).get_attribute("data-i")
                    for k in range(page.locator("line.edge").count())
                }
            ) == len(view["tokens"])
            assert page.locator("#summary table").count() >= 1
            pairs = data["patching"]["pairs"]  # the patching table: one row per pair, its top head
            assert page.locator("#patching + table tr").count() == 1 + len(pairs) == 3
            top = pairs[0]["patching"]["top"][0]
            assert f"L{top['layer']}H{top['head']} {top['value']:.2f}" in page.text_content("#patching + table")
        finally:
            browser.close()
    assert requests == [url]  # the page itself, nothing else
    assert problems == []


def test_cli_errors_name_the_problem(capsys, tmp_path):
    assert main(["analyze", "no-such-model", "--out", str(tmp_path)]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["analyze", "all-minilm-l6-v2", "--prune", "1.5"]) == 2
    assert "--prune must be in [0, 1)" in capsys.readouterr().err
    (tmp_path / "one.txt").write_text("just one paragraph")
    assert main(["analyze", "all-minilm-l6-v2", "--corpus", str(tmp_path / "one.txt")]) == 2
    assert "at least 2 paragraphs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["analyze", "all-minilm-l6-v2", "--fractions", "0.5,1.2"])
