#!/usr/bin/env bash
# Prepare what bench/gpu/validate.sh needs on a lent GPU machine whose image lacks it, here, where the package
# registry is reachable (the GPU machine reaches nothing). It fills bench/gpu/carry/ (git-ignored) with wheels
# for that image's Python 3.12 (x86-64 Linux):
#   - DeepSpeed as a pure-Python wheel (its C++/CUDA ops off: DS_BUILD_OPS=0; shardline's GPU path uses torch's
#     AdamW, so no op is ever JIT-built there) and the two dependencies of it the image lacks (hjson, pydantic
#     with pydantic-core, annotated-types, typing-inspection);
#   - msgspec and crc32c (compiled: cp312 manylinux wheels), jsonargparse with its signature extras
#     (docstring-parser, typeshed-client) for LightningCLI.
# Each at the version this checkout's own environment runs (pip list), else the newest the registry has.
# Then it checks the folder against the device tool's carry limit (64 MiB, with the working tree).
#
#   bash bench/gpu/prepare.sh            # uses the python on PATH (one with torch, for DeepSpeed's build)
#   PYTHON=/path/to/python bash bench/gpu/prepare.sh
#   bash bench/gpu/prepare.sh --check    # also: the wheels install and import under a Python 3.12 here
#
# Run it right before a device call: it also stamps carry/commit.json with this checkout's commit (the copy of
# the tree that travels has no .git), which validate.py records in its results.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
carry="$here/carry"
python="${PYTHON:-python3}"
rm -rf "$carry" && mkdir -p "$carry"

version() {  # the version of $1 installed beside $python, as an '==X' pin, else nothing
  "$python" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: /==/p'
}

# DeepSpeed: pure Python with its ops off; built against the torch beside $python (DeepSpeed's setup imports it)
DS_BUILD_OPS=0 "$python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$carry" "deepspeed$(version deepspeed)" \
  2> >(grep -v "^WARNING: Location" >&2)

pure=(hjson pydantic annotated-types typing-inspection jsonargparse docstring-parser typeshed-client)
compiled=(pydantic-core msgspec crc32c)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for name in "${pure[@]}" "${compiled[@]}"; do
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$carry" "$name$(version "$name")" 2> >(grep -v "^WARNING: Location" >&2)
done

git -C "$here/../.." rev-parse HEAD > /dev/null 2>&1 && printf '{"commit": "%s", "dirty": %s}\n' \
  "$(git -C "$here/../.." rev-parse HEAD)" \
  "$([ -n "$(git -C "$here/../.." status --porcelain --untracked-files=no)" ] && echo true || echo false)" \
  > "$carry/commit.json"

bytes=$(du -sb "$carry" | cut -f1)
limit=$((64 << 20))
echo "prepare: $(ls "$carry"/*.whl | wc -l) wheels, $((bytes / 1024)) KiB in $carry (the device tool carries 64 MiB in all)"
ls "$carry"
if [ "$bytes" -ge $((limit / 2)) ]; then
  echo "prepare: the wheels take more than half of the 64 MiB carry limit" >&2
  exit 1
fi

[ "${1:-}" = "--check" ] || exit 0
# The wheels under the GPU image's Python (3.12): installed as validate.sh installs them (--no-index --no-deps
# --target), each imported. DeepSpeed's import needs torch, and the registry has no CPU torch 2.11 for 3.12 (its
# torch 2.11 for 3.12 is the CUDA build, ~530 MB plus the nvidia-* wheels): DeepSpeed is checked as a
# py3-none-any wheel whose files import under this checkout's own torch, in the suite's environment.
py312=""
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2> /dev/null; then py312="$candidate"; break; fi
done
if [ -z "$py312" ]; then
  echo "prepare --check: no python3.12 on this machine: the cp312 wheels were not import-tested" >&2
  exit 1
fi
check="$(mktemp -d)"
trap 'rm -rf "$check"' EXIT
# what the image has and the wheels need (not carried): typing-extensions, PyYAML
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$check/image" typing-extensions pyyaml 2> >(grep -v "^WARNING: Location" >&2)
PIP_ROOT_USER_ACTION=ignore "$py312" -m pip install -q --no-index --no-deps --no-compile --target "$check/lib" \
  "$carry"/*.whl "$check"/image/*.whl
site="$check/lib"
PYTHONPATH="$site" "$py312" -c '
import importlib, sys
for name in ("msgspec", "crc32c", "pydantic", "pydantic_core", "hjson", "jsonargparse", "docstring_parser",
             "typeshed_client", "annotated_types", "typing_inspection"):
    module = importlib.import_module(name)
    version = getattr(module, "__version__", "")
    print(f"prepare --check: {name} {version} imports under Python {sys.version.split()[0]}")
import crc32c, msgspec
assert crc32c.crc32c(b"123456789") == 0xE3069283, "crc32c check value"
assert msgspec.json.decode(msgspec.json.encode({"a": [1, 2.5]})) == {"a": [1, 2.5]}
'
case "$(ls "$carry"/deepspeed-*.whl)" in
  *-py3-none-any.whl) echo "prepare --check: DeepSpeed is a pure-Python wheel (py3-none-any); its import needs torch: not tried under 3.12 (no CPU torch 2.11 for 3.12 in the registry)";;
  *) echo "prepare --check: the DeepSpeed wheel is not pure Python: $(ls "$carry"/deepspeed-*.whl)" >&2; exit 1;;
esac
