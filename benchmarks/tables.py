"""The docs' benchmark tables, generated from the saved results.

    python benchmarks/tables.py            # rewrite the tables in docs/benchmarks/*.md and README.md
    python benchmarks/tables.py --check    # exit 1 if a page's tables differ from what the results give

Each page holds its tables between `<!-- tables:begin -->` and `<!-- tables:end -->` (README.md:
`<!-- headline:begin -->` / `<!-- headline:end -->`); the prose around them is written by hand. A
result file belongs to a CPU kind by its folder (`results/zen5/...`), by a suffix of its name
(`small_rows_intel.json`) or, for the first machine's top-level files, by the CPU its env names.
Only the stdlib: the check runs in the test suite without torch.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "benchmarks"
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
HEAD_BEGIN, HEAD_END = "<!-- headline:begin -->", "<!-- headline:end -->"


@dataclass(frozen=True)
class Cpu:
    key: str  # the page's name: docs/benchmarks/<key>.md
    title: str  # how the page and the headline table name the CPU
    folder: str | None  # results/<folder>/ holds its runs; None: the top-level files


# In the order the machines were first lent. The first machine's results sit at the top level.
CPUS = [
    Cpu("zen3", "AMD EPYC Zen 3, AVX2+FMA", None),
    Cpu("intel", "Intel Xeon, AVX-512+VNNI+AMX", "intel"),
    Cpu("zen4", "AMD EPYC Zen 4, AVX-512+VNNI", "zen4"),
    Cpu("zen5", "AMD EPYC Zen 5, AVX-512+VNNI", "zen5"),
    Cpu("intel-m167", "Intel Xeon model 167, AVX-512+AMX, 480 MiB L3", "intel-f6-m167-avx512-amx"),
]
BY_FOLDER = {c.folder: c for c in CPUS if c.folder}
BY_SUFFIX = {"_intel": "intel", "_zen4": "zen4", "_zen5": "zen5"}


def cpu_of(path: Path) -> str:
    rel = path.relative_to(RESULTS)
    if rel.parts[0] in BY_FOLDER:
        return BY_FOLDER[rel.parts[0]].key
    if len(rel.parts) > 2 or (len(rel.parts) == 2 and not rel.parts[0].endswith(tuple(BY_SUFFIX))):
        raise SystemExit(f"{rel.parent}/ is no CPU's folder: add it to CPUS in benchmarks/tables.py, with its page")
    for suffix, key in BY_SUFFIX.items():
        if path.stem.endswith(suffix) or (len(rel.parts) > 1 and rel.parts[0].endswith(suffix)):
            return key
    env = env_of(load(path))
    return "intel" if "Intel" in env.get("cpu_model", "") else "zen3"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def env_of(d: dict) -> dict:
    return d.get("env") or d.get("environment") or {}


def runs(name_glob: str, key: str) -> list[tuple[Path, dict]]:
    """Every result file matching name_glob that belongs to CPU `key`, oldest first."""
    found = [(p, load(p)) for p in RESULTS.rglob(name_glob) if "analysis" not in p.parts]
    found = [(p, d) for p, d in found if cpu_of(p) == key]
    return sorted(found, key=lambda pd: (env_of(pd[1]).get("date", ""), str(pd[0])))


def link(path: Path, page_dir: Path) -> str:
    """A relative markdown link to a result, the .txt beside a .json when there is one."""
    txt = path.with_suffix(".txt")
    target = txt if txt.exists() else path
    rel = Path(*[".."] * len(page_dir.relative_to(ROOT).parts)) / target.relative_to(ROOT)
    folder = {c.key: c.folder for c in CPUS}[cpu_of(path)]
    name = target.relative_to(RESULTS / folder if folder else RESULTS).as_posix()
    return f"[{name}]({rel.as_posix()})"


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of a/b in the same round: what the scripts print as `paired`."""
    return med([x / y for x, y in zip(a, b, strict=False) if y])


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def what_was_run(path: Path, cmd: str) -> str:
    """The model and build a quantized.py run measured, from its command and file name."""
    stem = path.stem
    if m := re.search(r"--gguf \S*?([^/\s]+)\.gguf", cmd):
        what = "Gemma 3 270M Q4_K_M" if m.group(1).startswith("gemma-3-270m") else "7B-shaped Q4_K_M"
    elif m := re.search(r"--requantize (\S+)", cmd):
        what = f"SmolLM2 {m.group(1)}"
    else:
        what = "SmolLM2 Q4_1"
    words = stem.replace("avx2_isa", "avx2-isa").split("_")
    notes = [
        "AVX2 both sides" if w == "avx2-isa" else w
        for w in words
        if w in ("avx2-isa", "noamx", "pf8192", "pf16k", "zmm1", "zmm")
    ]
    return what + (f" ({', '.join(notes)})" if notes else "")


def quantized_rows(key: str, page_dir: Path) -> list[list[str]]:
    rows = []
    for path, d in runs("quantized*.json", key):
        env, dec, pre = env_of(d), d["decode"], d.get("prefill", {})
        if "llama.cpp" not in dec:
            continue
        hw, ll = dec["hw_q"], dec["llama.cpp"]
        hf = dec.get("hf_fp32")
        prefill = "-"
        if pre.get("hw_q") and pre.get("llama.cpp"):
            prefill = f"{med(pre['hw_q']) / med(pre['llama.cpp']):.2f}x"
        rss = d.get("memory", {}).get("auto", {}).get("VmRSS")
        rows.append(
            [
                link(path, page_dir),
                env.get("date", "")[:10],
                what_was_run(path, env.get("command", "")),
                f"{med(hw):.1f}",
                f"{med(ll):.1f}",
                f"**{med(hw) / med(ll):.2f}x** ({paired(hw, ll):.2f}x)",
                f"{med(hw) / med(hf):.1f}x" if hf else "-",
                prefill,
                f"{rss / 2**20:.0f}" if rss else "-",
            ]
        )
    return rows


QUANTIZED_HEADER = [
    "run",
    "date",
    "model (build)",
    "headwise decode B=1 tok/s",
    "llama-bench",
    "ratio (paired)",
    "vs transformers fp32",
    "prefill ratio",
    "resident MiB",
]


def target(d: dict, start: str) -> str:
    for name, t in d.get("targets", {}).items():
        if name.startswith(start):
            return t["value"]
    return "-"


def serving_runs(key: str) -> list[tuple[Path, dict]]:
    """serving.py's results (serving.json, serving_llama_cpp.json), not serving_commits.py's."""
    return [(p, d) for p, d in runs("serving*.json", key) if "targets" in d]


def serving_rows(key: str, page_dir: Path) -> list[list[str]]:
    rows = []
    for path, d in serving_runs(key):
        args, env = d.get("args", {}), env_of(d)
        rows.append(
            [
                link(path, page_dir),
                env.get("date", "")[:10],
                args.get("concurrency", "-").strip("[]"),
                target(d, "headwise / llama-server at 1 client"),
                target(d, "headwise / llama-server -np 16"),
                target(d, "headwise serve / llama-server resident"),
                target(d, "headwise 1 client decode"),
                target(d, "headwise 16 clients / 1 client, output"),
            ]
        )
    return rows


SERVING_HEADER = [
    "run",
    "date",
    "clients",
    "1 client / llama-server",
    "16 clients / llama-server -np 16",
    "memory / llama-server",
    "1 client / generate()",
    "16 clients / 1 client",
]


def engine_rows(key: str, page_dir: Path) -> list[list[str]]:
    rows = []
    for path, d in runs("engine.json", key):
        s, args = d.get("summary", {}), d.get("args", {})
        one = s.get("hw_one", {}).get("median")
        e1, e16 = s.get("engine_1", {}).get("median"), s.get("engine_16", {}).get("median")
        if not one:
            continue
        rows.append(
            [
                link(path, page_dir),
                env_of(d).get("date", "")[:10],
                args.get("weights", "fp32"),
                f"{one:.1f}",
                f"{e1 / one:.2f}x" if e1 else "-",
                f"{e16:.1f}" if e16 else "-",
                f"**{e16 / one:.2f}x**" if e16 else "-",
            ]
        )
    return rows


ENGINE_HEADER = [
    "run",
    "date",
    "weights",
    "generate() tok/s",
    "1 request / generate()",
    "16 requests tok/s",
    "16 requests / one at a time",
]


def compare_rows(key: str, page_dir: Path) -> list[list[str]]:
    rows = []
    for path, d in runs("compare_commits.json", key):
        s, args = d["summary"], d.get("args", {})
        weights = d.get("workers", {}).get("new", {}).get("weights", "fp32")
        cells = [
            f"{s[k]['ratio']:.2f}x ({s[k]['paired']:.2f}x)" if k in s else "-"
            for k in ("decode_B1", "decode_B8", "prefill_512")
        ]
        rows.append(
            [
                link(path, page_dir),
                env_of(d).get("date", "")[:10],
                args.get("base", "-"),
                args.get("threads", "-"),
                weights,
                *cells,
            ]
        )
    return rows


COMPARE_HEADER = [
    "run",
    "date",
    "base",
    "threads",
    "weights",
    "decode B=1 (paired)",
    "decode B=8 (paired)",
    "prefill 512 (paired)",
]

SECTIONS = [
    ("SmolLM2 and other GGUF files against llama.cpp (`benchmarks/quantized.py`)", QUANTIZED_HEADER, quantized_rows),
    ("Serving against llama-server (`benchmarks/serving.py`)", SERVING_HEADER, serving_rows),
    ("The engine: 16 requests at once against one at a time (`benchmarks/engine.py`)", ENGINE_HEADER, engine_rows),
    ("New commit against an older one (`benchmarks/compare_commits.py`)", COMPARE_HEADER, compare_rows),
]


def cpu_tables(cpu: Cpu) -> str:
    page_dir = DOCS
    parts = [
        "*Generated by `python benchmarks/tables.py` from the result files; edit the prose outside the markers,"
        " not this. Ratios are headwise / the other side, medians over rounds; paired = the median of the"
        " per-round ratios.*"
    ]
    for title, header, rows_of in SECTIONS:
        rows = rows_of(cpu.key, page_dir)
        if rows:
            parts.append(f"### {title}\n\n{table(header, rows)}")
    return "\n\n".join(parts)


def is_plain_smollm2(path: Path, d: dict) -> bool:
    cmd = env_of(d).get("command", "")
    return what_was_run(path, cmd) in ("SmolLM2 Q4_1", "SmolLM2 Q4_1 (pf16k)", "SmolLM2 Q4_1 (zmm1)")


def headline() -> str:
    """README's table: per CPU, the latest SmolLM2 Q4_1 run against llama.cpp and the latest serving run."""
    rows = []
    for cpu in CPUS:
        q = [
            (p, d) for p, d in runs("quantized*.json", cpu.key) if "llama.cpp" in d["decode"] and is_plain_smollm2(p, d)
        ]
        both = ("headwise / llama-server at 1 client", "headwise / llama-server -np 16")
        s = [(p, d) for p, d in serving_runs(cpu.key) if all(target(d, t) != "-" for t in both)]
        if not q:
            continue
        path, d = q[-1]
        hw, ll = d["decode"]["hw_q"], d["decode"]["llama.cpp"]
        pre = d["prefill"]
        serve = "-"
        if s:
            sd = s[-1][1]
            serve = (
                f"{target(sd, 'headwise / llama-server at 1 client')} / {target(sd, 'headwise / llama-server -np 16')}"
            )
        rows.append(
            [
                f"[{cpu.title}](docs/benchmarks/{cpu.key}.md)",
                env_of(d).get("date", "")[:10],
                f"{med(hw):.0f} vs {med(ll):.0f} tok/s = **{med(hw) / med(ll):.2f}x** (paired {paired(hw, ll):.2f}x)",
                f"**{med(pre['hw_q']) / med(pre['llama.cpp']):.2f}x**",
                serve,
            ]
        )
    header = [
        "CPU (2 cores)",
        "date",
        "decode B=1 vs llama-bench",
        "prefill 512 vs llama-bench",
        "serving vs llama-server: 1 / 16 clients",
    ]
    return table(header, rows)


def replace_between(text: str, begin: str, end: str, body: str, where: str) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"{where}: no {begin} ... {end} markers to put the tables between")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def pages() -> dict[Path, str]:
    """Each page's text as the results give it."""
    out = {}
    for cpu in CPUS:
        page = DOCS / f"{cpu.key}.md"
        out[page] = replace_between(page.read_text(), BEGIN, END, cpu_tables(cpu), str(page))
    readme = ROOT / "README.md"
    out[readme] = replace_between(readme.read_text(), HEAD_BEGIN, HEAD_END, headline(), str(readme))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is out of date")
    args = ap.parse_args(argv)
    stale = []
    for page, text in pages().items():
        if page.read_text() != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(text)
    if args.check and stale:
        print("out of date (run `python benchmarks/tables.py`): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    for page in stale:
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
