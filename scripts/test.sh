#!/usr/bin/env bash
# Install every distribution (scripts/install.sh --all) into $WEFT_VENV (default .venv) and run the test suite.
# Extra arguments go to pytest; the summary names every skipped test with its reason (-rfEs).
# pytest's "no tests collected" (exit 5) counts as success.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${WEFT_VENV:-$root/.venv}
# The test tools come from the lock file of this machine's platform, requirements/test/<platform>.txt
# (compiled from <platform>.in and common.in; WEFT_TEST_PLATFORM=cpu|cuda|rocm|xpu overrides the
# detection, which reads the same driver files as the platform probes).
platform=${WEFT_TEST_PLATFORM:-cpu}
if [ -z "${WEFT_TEST_PLATFORM:-}" ]; then
    if [ -e /proc/driver/nvidia/version ] || [ -e /dev/nvidiactl ]; then
        platform=cuda
    elif [ -e /dev/kfd ]; then
        platform=rocm
    else
        for device in /sys/class/drm/renderD*/device; do
            vendor=$(cat "$device/vendor" 2>/dev/null || true) class=$(cat "$device/class" 2>/dev/null || true)
            [ "$vendor" = 0x8086 ] && [[ $class == 0x03* ]] && platform=xpu
        done
    fi
fi
requirements=$root/requirements/test/$platform.txt
[ -f "$requirements" ] || { echo "scripts/test.sh: no $requirements (WEFT_TEST_PLATFORM=$platform?)" >&2; exit 2; }
echo "scripts/test.sh: platform $platform, test requirements ${requirements#"$root"/}"
WEFT_VENV=$venv bash "$root/scripts/install.sh" --all "$root/tests/example_plugin" "$root/tests/broken_llama_plugin" \
    "$root/tests/disk_connector" -r "$requirements"
# Without a GPU, weft-triton's kernels run under Triton's CPU interpreter.
if [ "$platform" = cpu ]; then
    export TRITON_INTERPRET=1
fi
cd "$root"
set +e
# Lint and format first (seconds); the tests run either way, and either failing fails the run.
echo "scripts/test.sh: ruff check and ruff format --check"
"$venv/bin/ruff" check --quiet . && "$venv/bin/ruff" format --check --quiet .
lint=$?
"$venv/bin/python" -m pytest -q -rfEs "$@"
status=$?
set -e
[ "$status" -eq 5 ] && { echo "pytest collected no tests"; status=0; }
[ "$lint" -ne 0 ] && { echo "scripts/test.sh: ruff found problems (above); fix them or run ruff format"; [ "$status" -eq 0 ] && status=1; }
exit "$status"
