#!/usr/bin/env bash
# Fetches, on a machine with network, the wheels the device check installs on a GPU machine that has none:
#   benchmarks/device_wheels.sh DIR [--upstream]
# DIR/main/: what every stage needs and a GPU machine's Python may lack (libcst, DeepSpeed and its pydantic and
# hjson...); DIR/upstream/ (with --upstream): what upstream DeepSpeed-Chat's step 1 needs besides (transformers
# before 5, datasets...). The pins are device_check.py's (--requirements main|upstream), for CPython 3.12 on
# manylinux x86-64. DeepSpeed ships only an sdist: its wheel is built here, without ops (DS_BUILD_OPS=0), from this
# Python's torch. Then: python benchmarks/device_check.py OUT --device cuda --wheels DIR [--upstream CHAT_DIR]
set -euo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: benchmarks/device_wheels.sh DIR [--upstream]" >&2
  exit 2
fi
dir=$1 upstream=${2:-}
if [ -n "$upstream" ] && [ "$upstream" != "--upstream" ]; then
  echo "device_wheels.sh: error: unknown option $upstream (only --upstream)" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
fetch() {  # fetch SUBFOLDER REQUIREMENT...: binary wheels for CPython 3.12, manylinux x86-64
  local sub=$1
  shift
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir/$sub" "$@"
}
mkdir -p "$dir/main"
mapfile -t main < <("$py" "$here/device_check.py" --requirements main)
deepspeed=$(printf '%s\n' "${main[@]}" | grep '^deepspeed==')
fetch main $(printf '%s\n' "${main[@]}" | grep -v '^deepspeed==')
if ! ls "$dir/main"/deepspeed-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir/main" "$deepspeed"
fi
if [ -n "$upstream" ]; then
  mkdir -p "$dir/upstream"
  mapfile -t up < <("$py" "$here/device_check.py" --requirements upstream)
  fetch upstream "${up[@]}"
fi
du -sh "$dir"/* >&2
