#!/usr/bin/env bash
# Install the Debian packages whose shared libraries the plugins of this checkout load at run time.
# A plugin lists them in a debian-packages.txt inside its Python package, one "soname package" per
# line (weft-mooncake: the RDMA and NUMA libraries Mooncake's client and binaries link against).
# A library the dynamic loader already finds is left alone. The missing packages are installed with
# apt-get as root or with passwordless sudo; otherwise this names them and still exits 0: the plugins
# that need them are optional, and their tests skip naming the missing library.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}

shopt -s nullglob
missing=()
needed_by=()
for list in "$root"/plugins/*/src/*/debian-packages.txt "$root"/plugins-*/src/*/debian-packages.txt; do
    package_dir=$(basename "$(dirname "$list")")
    while read -r soname package; do
        case "$soname" in ''|'#'*) continue ;; esac
        # The dynamic loader itself answers whether the library is there.
        "$python" -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "$soname" 2>/dev/null && continue
        missing+=("$package")
        needed_by+=("$soname ($package_dir)")
    done <"$list"
done
[ "${#missing[@]}" -eq 0 ] && exit 0

explain() {
    echo "scripts/install.sh: $1" >&2
    echo "  missing system libraries: ${needed_by[*]}" >&2
    echo "  install them with: apt-get install ${missing[*]}" >&2
    echo "  until then the plugins that load them cannot run, and their tests skip naming the library" >&2
}
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    explain "not root and no passwordless sudo, so the Debian packages ${missing[*]} are not installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    explain "no apt-get here, so the Debian packages ${missing[*]} are not installed (install their equivalents)"
    exit 0
fi
echo "scripts/install.sh: installing the Debian packages ${missing[*]} (for ${needed_by[*]})" >&2
# A failed index update (an offline mirror) still leaves the cached index to install from.
"${as_root[@]}" apt-get update -qq || echo "scripts/install.sh: apt-get update failed; installing from the cached package index" >&2
if ! "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; then
    explain "apt-get could not install ${missing[*]} (see its output above)"
fi
