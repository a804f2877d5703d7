#!/usr/bin/env bash
# The wheel's library loads under an older glibc than this machine's: Debian 11's
# (2.31, the oldest on Debian's mirror; the wheel claims 2.28, torch's floor),
# through that glibc's own loader, every symbol bound at once (RTLD_NOW). A
# library linked against this machine's glibc (2.36) fails here, naming the
# symbol version it lacks. The probe that loads it is built by zig for glibc
# 2.28 (build_wheel's tools). Where Debian 11's packages cannot be had, it says
# so and exits 0: skipped, not failed.
#
#   scripts/check-glibc-floor.sh WHEEL
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/torch-env.sh
wheel="${1:?usage: scripts/check-glibc-floor.sh WHEEL}"
[ "$(uname -m)" = x86_64 ] || { echo "SKIPPED: Debian 11's amd64 glibc runs on x86_64 only"; exit 0; }
_build_tools
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python3 scripts/debian.py debs bullseye amd64 "$work" libc6 libgcc-s1 ||
  { echo "SKIPPED: Debian 11's libc6 and libgcc-s1 could not be downloaded"; exit 0; }
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
lib="$work/root/lib/x86_64-linux-gnu"

cat > "$work/probe.c" <<'EOF'
#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) { printf("dlopen failed: %s\n", dlerror()); return 1; }
    const char *(*cap)(void) = (const char *(*)(void))dlsym(h, "keel_cpu_capability");
    if (!cap || !cap()) { printf("keel_cpu_capability missing or failed\n"); return 1; }
    printf("loaded under glibc 2.31: keel_cpu_capability() = %s\n", cap());
    return 0;
}
EOF
"$BUILD_VENV/bin/python" -m ziglang cc -target x86_64-linux-gnu.2.28 -o "$work/probe" "$work/probe.c"
python3 -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("keel/_C.so"))' \
  "$wheel" "$work/_C.so"
# Without torch in the process the library's registration says so on stderr and
# registers nothing; the load itself is what this checks.
"$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$work/probe" "$work/_C.so" 2>/dev/null
