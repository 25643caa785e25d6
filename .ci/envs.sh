#!/usr/bin/env bash
# CI's environments besides the main one (.ci/run builds that one): each is built from scratch into a
# fresh virtual environment and runs the tests its versions matter for.
#
#   .ci/envs.sh floor    the oldest versions dsfix supports (.ci/floor.txt): Python 3.9, torch 2.1, numpy 2
#                        (which torch before 2.3 cannot use), transformers 4.51, safetensors 0.4.3,
#                        DeepSpeed 0.15.4: the inserted save's tests, a patched step-1 save and reload on
#                        ZeRO-0, smoke (after apply, through the command line too) and verify
#   .ci/envs.sh newest   the current torch with the newest transformers 5.x, as a `[smoke]` install gets
#                        it (no DeepSpeed): the torch side's tests (template, smoke, verify, convert); the
#                        tests that run upstream DeepSpeed-Chat's own code need transformers 4 and stay in
#                        the main environment
#
# A second argument does one half: `install` builds the environment (.venv-ENV), `test` runs the tests in the
# one built before; .ci/run builds all environments at once, then tests each in turn. Neither: both.
#
# Python 3.9 for the floor: `python3.9` if it runs, else pyenv's newest 3.9; neither is an error.
# Exit status: pytest's (an empty selection is an error too), or 1 when an install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
which_env=${1:?usage: .ci/envs.sh floor|newest [install|test]}
phase=${2:-both}
TORCH_VERSION=2.13.0  # the main environment's torch (.ci/run)

log=$(mktemp)
install() {
  if ! "$@" >>"$log" 2>&1; then
    cat "$log" >&2
    echo "ci: installing the $which_env environment failed: $*" >&2
    exit 1
  fi
}

python39() {
  if command -v python3.9 >/dev/null && python3.9 -c "import sys; assert sys.version_info[:2] == (3, 9)" 2>/dev/null; then
    command -v python3.9
    return
  fi
  local found
  found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.9.*/bin/python 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$found" ] && "$found" -c "import sys; assert sys.version_info[:2] == (3, 9)" 2>/dev/null; then
    echo "$found"
    return
  fi
  echo "ci: the floor environment needs Python 3.9: no working python3.9 on PATH and none under pyenv's versions" >&2
  return 1
}

case "$which_env" in
  floor)
    python=$(python39)
    venv=.venv-floor
    install_env() {
      # torch first, alone: 2.1.2 from PyPI is the CUDA build; it runs on a CPU, but only with its nvidia
      # libraries installed, which it loads at import
      install python -m pip install -q -c .ci/floor.txt torch numpy
      install env DS_BUILD_OPS=0 python -m pip install -q -c .ci/floor.txt -e . torch numpy transformers safetensors accelerate \
        deepspeed 'pytest>=7' 'hypothesis>=6' 'pytest-timeout>=2' 'pytest-xdist>=3'
    }
    # No ZeRO-3 on CPU ranks here: torch 2.1's gloo has no all_gather_into_tensor ("no support for
    # _allgather_base in Gloo process group") and no bf16 collectives ("Invalid scalar type"), which
    # DeepSpeed's ZeRO-3 needs; on GPUs it runs on NCCL. The patched save and reload on ZeRO-0: smoke's exit
    # codes (apply, then smoke, through the command line). The demo is that same cycle on the full Qwen3-0.6B
    # config (a minute here): it runs in the newest environment, which is what the README's first command
    # installs, and in the main one's extended tier. The program's own exit, on this Python (3.9's exit
    # handlers raise again what one raised; 3.10 on only print it).
    tests=(tests/test_versions.py tests/test_save_module.py
           tests/test_save_module_ranks.py::test_zero0_save_and_fallback
           tests/test_smoke.py tests/test_verify.py tests/test_cli_model.py::test_smoke_exit_codes
           tests/test_cli_protocol.py::test_the_program_ends_as_the_ordinary_exit_where_the_exit_goes_wrong
           tests/test_cli_protocol.py::test_the_program_process_its_huge_pages_and_its_exit
           --deselect tests/test_smoke.py::test_passes_under_zero3_with_two_ranks
           --deselect tests/test_smoke.py::test_fails_on_the_article_save_under_zero3
           --deselect tests/test_verify.py::test_fails_on_zero3_placeholders)
    ;;
  newest)
    python=python3
    venv=.venv-newest
    install_env() {
      install python -m pip install -q "torch==$TORCH_VERSION"
      install python -m pip install -q -e '.[smoke]' 'transformers>=5,<6' 'pytest>=7' 'hypothesis>=6' 'pytest-timeout>=2' 'pytest-xdist>=3'
    }
    # --both-tiers: the demo too (test_cli_model.py's, in the extended tier of the main environment)
    tests=(--both-tiers tests/test_versions.py tests/test_save_module.py tests/test_smoke.py tests/test_verify.py
           tests/test_convert.py tests/test_cli_model.py)
    ;;
  *)
    echo "usage: .ci/envs.sh floor|newest [install|test]" >&2
    exit 2
    ;;
esac

case "$phase" in
  both|install|test) ;;
  *)
    echo "usage: .ci/envs.sh floor|newest [install|test]" >&2
    exit 2
    ;;
esac

if [ "$phase" != test ]; then
  start=$SECONDS
  rm -rf "$venv"
  "$python" -m venv "$venv"
  . "$venv/bin/activate"
  install python -m pip install -q --upgrade pip
  install_env
  deactivate
  echo "env $which_env: installed in $((SECONDS - start))s, $(du -sh "$venv" | cut -f1)"
  [ "$phase" != install ] || exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "ci: no $venv to test in: run .ci/envs.sh $which_env install first" >&2
  exit 1
fi
start=$SECONDS
. "$venv/bin/activate"
python - "$which_env" torch numpy transformers safetensors deepspeed <<'EOF_PY'
import sys
from importlib.metadata import PackageNotFoundError, version


def have(name):
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return f"no {name}"


print(f"env {sys.argv[1]}: Python {sys.version.split()[0]} | " + " | ".join(have(p) for p in sys.argv[2:]))
EOF_PY

set +e
python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider --durations=5 "${tests[@]}"
rc=$?
set -e
echo "env $which_env: tests took $((SECONDS - start))s"
if [ "$rc" -eq 5 ]; then
  echo "ci: the $which_env environment collected no tests" >&2
  exit 1
fi
if [ "$rc" -eq 0 ]; then
  deactivate
  rm -rf "$venv"  # the floor's torch brings 3 GB of CUDA libraries; a failed run keeps its environment to look into
fi
exit "$rc"
