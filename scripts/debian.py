#!/usr/bin/env python3
"""Debian's packages and sources, fetched from deb.debian.org, for the test
scripts that need another system's files without installing them: glibc 2.31
(check-glibc-floor.sh), an arm64 CPython (test-aarch64-wheel.sh), CPython's
source (test-freethreaded.sh). Standard library only. `--mirror URL` (before
the command) reads another archive of Debian's layout instead: Ubuntu's,
whose python3.14 source is on its mirror where Debian's is not.

    debian.py debs SUITE ARCH OUT PKG... [--depends] [--unneeded PKG,...]
        Writes OUT/PKG.deb for each PKG; with --depends, for every package
        they need (Pre-Depends and Depends, first alternative, transitively)
        too, but those named by --unneeded.
    debian.py orig OUT PKG:SUITE[,SUITE...][@MIRROR]...
        Writes OUT, the newest .orig.tar.xz of the first PKG with one in the
        first SUITE of its own whose mirror still holds it, and prints
        "SUITE FILE MIRROR". A spec's @MIRROR reads that archive for it (else
        --mirror's); each suite's index is read once per archive, however
        many specs name it.

Exits 1, saying why on stderr, where the mirror cannot be reached or a
package or tarball is not there: the callers skip their step then.
"""
import argparse
import lzma
import re
import sys
import urllib.request

DEBIAN = "http://deb.debian.org/debian"
MIRROR = DEBIAN  # the archive read: --mirror


def fetch(path, mirror=None, timeout=120):
    """The bytes at PATH on `mirror` (an archive's URL; None: --mirror's)."""
    with urllib.request.urlopen(f"{mirror or MIRROR}/{path}", timeout=timeout) as r:
        return r.read()


def stanzas(text):
    """The paragraphs of a Packages or Sources index: (fields, lines) each,
    fields mapping a field's name to its first line's value."""
    for entry in text.split("\n\n"):
        lines = entry.splitlines()
        fields = dict(line.split(": ", 1) for line in lines if ": " in line and not line.startswith(" "))
        if fields:
            yield fields, lines


def index(suite, name, mirror=None):
    """A suite's index, e.g. name "binary-arm64/Packages", decompressed; read
    once per archive in a run (Sources indexes run to tens of MB)."""
    key = (mirror or MIRROR, suite, name)
    if key not in _INDEXES:
        _INDEXES[key] = lzma.decompress(fetch(f"dists/{suite}/main/{name}.xz", mirror)).decode("utf-8", "replace")
    return _INDEXES[key]


_INDEXES = {}


def depends(fields):
    """The packages a Packages stanza needs: Pre-Depends and Depends, the first
    alternative of each, without versions or architecture qualifiers."""
    names = []
    for field in ("Pre-Depends", "Depends"):
        for dep in fields.get(field, "").split(","):
            if dep.strip():
                names.append(re.split(r"[\s(:]", dep.split("|")[0].strip())[0])
    return names


def closure(packages, roots, unneeded=()):
    """ROOTS and, with PACKAGES (name to stanza fields) given, all they need,
    transitively, but UNNEEDED and names the index lacks (virtual packages)."""
    todo, seen = list(roots), set()
    while todo:
        name = todo.pop()
        if name in seen or name in unneeded or name not in packages:
            continue
        seen.add(name)
        todo.extend(depends(packages[name]))
    return seen


def orig_names(lines):
    """The .orig.tar.xz files a Sources stanza lists."""
    return {line.split()[-1] for line in lines if line.startswith(" ") and line.endswith(".orig.tar.xz")}


def version_key(name):
    """Orders file names by the numbers in them as numbers: 3.14.10 after 3.14.9."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def debs(args):
    packages = {f["Package"]: f for f, _ in stanzas(index(args.suite, f"binary-{args.arch}/Packages")) if "Package" in f}
    missing = [p for p in args.packages if p not in packages]
    if missing:
        sys.exit(f"debian.py: {args.suite}/{args.arch} has no {', '.join(missing)}")
    unneeded = set(args.unneeded.split(",")) - {""}
    wanted = closure(packages, args.packages, unneeded) if args.depends else set(args.packages)
    for name in sorted(wanted):
        with open(f"{args.out}/{name}.deb", "wb") as f:
            f.write(fetch(packages[name]["Filename"]))


def orig(args):
    for spec in args.specs:
        spec, _, mirror = spec.partition("@")
        mirror = mirror.rstrip("/") or MIRROR
        pkg, suites = spec.split(":", 1)
        for suite in suites.split(","):
            try:
                text = index(suite, "source/Sources", mirror)
            except OSError:
                continue
            # A suite can hold several versions of a package, a stanza each: newest first.
            found = [(name, fields["Directory"]) for fields, lines in stanzas(text)
                     if fields.get("Package") == pkg for name in orig_names(lines)]
            for name, directory in sorted(found, key=lambda f: version_key(f[0]), reverse=True):
                try:
                    data = fetch(f"{directory}/{name}", mirror)
                except OSError:
                    continue  # the index can name files the mirror no longer holds
                with open(args.out, "wb") as f:
                    f.write(data)
                print(f"{suite} {name} {mirror}")
                return
    sys.exit(f"debian.py: no orig tarball of {', '.join(args.specs)} could be downloaded")


def main():
    global MIRROR
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", default=DEBIAN)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("debs")
    p.add_argument("suite")
    p.add_argument("arch")
    p.add_argument("out")
    p.add_argument("packages", nargs="+")
    p.add_argument("--depends", action="store_true")
    p.add_argument("--unneeded", default="")
    p.set_defaults(run=debs)
    p = sub.add_parser("orig")
    p.add_argument("out")
    p.add_argument("specs", nargs="+", metavar="PKG:SUITE[,SUITE...][@MIRROR]")
    p.set_defaults(run=orig)
    args = parser.parse_args()
    MIRROR = args.mirror.rstrip("/")
    try:
        args.run(args)
    except (OSError, lzma.LZMAError) as e:  # urllib's errors among them
        sys.exit(f"debian.py: {e}")


if __name__ == "__main__":
    main()
