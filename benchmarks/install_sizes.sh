#!/usr/bin/env bash
# Issue 43's install figures in one go (~10 min on 2 cores): fresh venvs from a clone of this checkout's
# HEAD, sized with du -sh: `make run`'s, `make test`'s on top of it, and `pip install torch` (pinned like
# requirements.txt) then `pip install ".[serve]"`; then SmolLM2's GGUF loaded twice into an empty
# HEADWISE_CACHE: the cache's size, load time and resident memory.
#   bash benchmarks/install_sizes.sh [WORKDIR]      (default: a new temp dir, removed at the end)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d /tmp/headwise-install.XXXX)}
TORCH=$(grep -E '^torch==' "$ROOT/requirements.txt")
git clone -q "$ROOT" "$WORK/clone"
cd "$WORK/clone"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load: $(cut -d' ' -f1-3 /proc/loadavg)"
t=$(date +%s); make -s .venv/.installed-run >/dev/null 2>&1
echo "make run's venv:  $(du -sh .venv | cut -f1)  ($(( $(date +%s) - t )) s)"
t=$(date +%s); make -s .venv/.installed >/dev/null 2>&1
echo "make test's venv: $(du -sh .venv | cut -f1)  (+$(( $(date +%s) - t )) s on top)"
python3 -m venv "$WORK/pip"
t=$(date +%s); "$WORK/pip/bin/pip" install -q "$TORCH" >/dev/null 2>&1
"$WORK/pip/bin/pip" install -q ".[serve]" >/dev/null 2>&1
echo "pip install $TORCH, then \".[serve]\": $(du -sh "$WORK/pip" | cut -f1)  ($(( $(date +%s) - t )) s)"
export HEADWISE_CACHE="$WORK/cache"
for run in first again; do
  .venv/bin/python - "$run" <<'PY'
import resource, sys, time
import headwise
t0 = time.perf_counter()
headwise.load("smollm2-135m-instruct")
rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"SmolLM2 load ({sys.argv[1]}): {time.perf_counter() - t0:.1f} s, resident {rss:.0f} MB, peak {peak:.0f} MB")
PY
  echo "  cache: $(du -sh "$HEADWISE_CACHE" | cut -f1)"
done
[ -n "${1:-}" ] || rm -rf "$WORK"
