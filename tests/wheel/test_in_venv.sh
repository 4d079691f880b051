#!/usr/bin/env bash
# One wheel file installed into a fresh venv holding torch==VERSION, then tested there outside the source tree:
# tests/wheel/smoke.py and the op tests on the CPU (opcheck and torch.compile included), against the installed wheel.
# torch is installed without its CUDA libraries: the build venv's nvidia/ folder is linked in instead (the same
# sonames; a second 3.4 GB copy per torch filled CI's disk), where its releases are no older than the ones that torch
# pins (tests/wheel/cuda_libraries.py); a newer torch's own (torch 2.15.0: about 4.5 GB) are installed otherwise.
# The venv is removed afterwards.
#
# usage: tests/wheel/test_in_venv.sh BUILD_PYTHON WHEEL TORCH_VERSION
# SMOKE_PYTHON (default python3) is the interpreter the venv is made from: the wheel is one file for every Python 3.
# WHEEL "source" builds this repository in the venv instead (pip install --no-build-isolation, its build folder in the
# venv, not the tree's), as a user whose torch the wheel does not fit would: `make source-smoke`.
set -euo pipefail
build_python=$1
if [[ $2 == source ]]; then wheel=source; else wheel=$(realpath "$2"); fi
version=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
platlib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])'; }

venv="$root/.venv-smoke-$version"
rm -rf "$venv" && "${SMOKE_PYTHON:-python3}" -m venv "$venv"
site=$(platlib "$venv/bin/python")
echo "== torch $version, $("$venv/bin/python" -V): $(basename "$wheel")"
"$venv/bin/pip" install -q --no-deps "torch==$version"
"$venv/bin/pip" install -q sympy networkx jinja2 fsspec filelock typing_extensions numpy "pytest>=8" "hypothesis>=6"
newer_cuda=$("$build_python" "$root/tests/wheel/cuda_libraries.py" "$site")
if [[ -z "$newer_cuda" ]]; then
  ln -s "$(platlib "$build_python")/nvidia" "$site/nvidia"
else
  echo "torch $version pins newer CUDA libraries than the build venv's: installing them ($(echo $newer_cuda | tr '\n' ' '))"
  mapfile -t requirements <<< "$newer_cuda"
  "$venv/bin/pip" install -q "${requirements[@]}"
fi
if [[ $wheel == source ]]; then
  "$venv/bin/pip" install -q "scikit-build-core>=0.10" "cmake>=3.26" ninja
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -C build-dir="$venv/build" "$root"
else
  "$venv/bin/pip" install -q --no-deps "$wheel"
fi

cd /tmp
"$venv/bin/python" "$root/tests/wheel/smoke.py"
# The op tests (conftest checks that grpo_ext comes from this venv, not the source tree).
GRPO_EXT_WHEEL_TEST=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$root" -c "$root/pyproject.toml" \
  "$root/tests/test_op_registration.py" "$root/tests/test_errors.py" "$root/tests/test_group_advantages.py" \
  "$root/tests/test_process_advantages.py" "$root/tests/test_grpo_loss.py" "$root/tests/test_grpo_loss_bounds.py" \
  "$root/tests/test_grpo_loss_overflow.py" \
  "$root/tests/test_selective_log_softmax.py" "$root/tests/test_grpo_loss_from_logits.py" \
  "$root/tests/test_grpo_loss_from_logits_edges.py" \
  "$root/tests/test_grpo_loss_from_hidden.py"
rm -rf "$venv"
