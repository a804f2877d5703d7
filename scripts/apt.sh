# Sourced by the test scripts. apt_install PKG...: installs Debian packages
# where this runs as root with apt-get, waiting up to 2 minutes for a dpkg
# lock held by another apt, and running `apt-get update` first if the plain
# install fails. On failure it prints apt's last lines (session 13's first run
# skipped a step without a word, and the same install worked by hand minutes
# later) and returns non-zero; not root, or no apt-get: returns 1 quietly.
apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  local log rc=0
  log="$(mktemp)"
  _apt_get() { apt-get -o DPkg::Lock::Timeout=120 "$@" >>"$log" 2>&1; }
  _apt_get install -y -q "$@" || { _apt_get update -q && _apt_get install -y -q "$@"; } || rc=$?
  [ "$rc" = 0 ] || { echo "apt-get could not install $*:"; tail -n 5 "$log"; }
  rm -f "$log"
  return "$rc"
}
