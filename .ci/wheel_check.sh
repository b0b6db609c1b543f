#!/usr/bin/env bash
# Build the wheel, install it with its declared dependencies into a fresh virtual environment (no system
# site: only what the wheel asks for), and import every module of it from a directory outside the repository,
# checking each really comes from the wheel. torch is the CPU wheel, as in the README's set-up line.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet build >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
"$work/venv/bin/python" -m build --wheel --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
"$work/venv/bin/pip" install --quiet "torch==2.13.0" "$work"/dist/shardline-*.whl >"$work/pip.log" 2>&1 \
  || { cat "$work/pip.log"; exit 1; }
cd "$work"
"$work/venv/bin/python" - "$work/venv" <<'PY'
import importlib, pkgutil, sys
venv = sys.argv[1]
import shardline
count = 0
for root in ("shardline.job", "shardline.plugins", "shardline.profiling", "shardline.recipes"):
    package = importlib.import_module(root)
    for info in [None, *pkgutil.walk_packages(package.__path__, root + ".")]:
        module = package if info is None else importlib.import_module(info.name)
        assert module.__file__.startswith(venv), f"{module.__name__} came from {module.__file__}, not the wheel"
        count += 1
print(f"wheel check: imported {count} modules from the installed wheel")
PY
"$work/venv/bin/shardline" --version
