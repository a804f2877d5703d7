"""scripts/debian.py, which fetches Debian's packages and CPython's source for
the test scripts (glibc floor, aarch64 wheel, free-threaded CPython). Those
steps skip where a download fails, so a parsing mistake here would turn them
into skips: checked offline, on made-up indexes."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import debian  # noqa: E402

PACKAGES = """Package: python3.11-minimal
Version: 3.11.2-6
Pre-Depends: libc6 (>= 2.36)
Depends: libpython3.11-minimal (= 3.11.2-6), libexpat1 (>= 2.1~beta3), zlib1g (>= 1:1.2.0)
Description: a minimal Python
 with a continuation line: Depends: not-a-field
Filename: pool/main/p/python3.11/python3.11-minimal_3.11.2-6_arm64.deb

Package: libpython3.11-minimal
Depends: libssl3 (>= 3.0.0) | libssl1.1, debconf (>= 0.5) | debconf-2.0, awk:any
Filename: pool/main/p/python3.11/libpython3.11-minimal_3.11.2-6_arm64.deb

Package: libc6
Depends: libgcc-s1
Filename: pool/main/g/glibc/libc6_2.36-9_arm64.deb

Package: libgcc-s1
Depends: gcc-12-base (= 12.2.0-14), libc6 (>= 2.35)
Filename: pool/main/g/gcc-12/libgcc-s1_12.2.0-14_arm64.deb

Package: libexpat1
Filename: pool/main/e/expat/libexpat1_2.5.0-1_arm64.deb

Package: zlib1g
Filename: pool/main/z/zlib/zlib1g_1.2.13_arm64.deb

Package: libssl3
Filename: pool/main/o/openssl/libssl3_3.0.11_arm64.deb

Package: gcc-12-base
Filename: pool/main/g/gcc-12/gcc-12-base_12.2.0-14_arm64.deb

Package: debconf
Filename: pool/main/d/debconf/debconf_1.5.82_all.deb
"""

SOURCES = """Package: python3.13
Directory: pool/main/p/python3.13
Files:
 0123 27 python3.13_3.13.5-1.dsc
 4567 22000000 python3.13_3.13.5.orig.tar.xz
 89ab 22100000 python3.13_3.13.9.orig.tar.xz
 cdef 300000 python3.13_3.13.9-1.debian.tar.xz

Package: python3.13
Directory: pool/main/p/python3.13
Files:
 0123 22000000 python3.13_3.13.15.orig.tar.xz

Package: python3.12
Directory: pool/main/p/python3.12
Files:
 0123 21000000 python3.12_3.12.11.orig.tar.xz
"""


def packages():
    return {f["Package"]: f for f, _ in debian.stanzas(PACKAGES)}


def test_stanzas_take_first_lines_only_and_keep_the_continuation_lines():
    fields, lines = next(debian.stanzas(PACKAGES))
    assert fields["Package"] == "python3.11-minimal"
    assert fields["Description"] == "a minimal Python"
    assert " with a continuation line: Depends: not-a-field" in lines
    assert len(packages()) == 9


def test_depends_takes_pre_depends_and_the_first_alternative_without_versions_or_qualifiers():
    p = packages()
    assert debian.depends(p["python3.11-minimal"]) == ["libc6", "libpython3.11-minimal", "libexpat1", "zlib1g"]
    assert debian.depends(p["libpython3.11-minimal"]) == ["libssl3", "debconf", "awk"]
    assert debian.depends(p["zlib1g"]) == []


def test_closure_follows_depends_through_cycles_but_not_into_unneeded_or_virtual_packages():
    got = debian.closure(packages(), ["python3.11-minimal"], {"gcc-12-base", "debconf"})
    assert got == {"python3.11-minimal", "libpython3.11-minimal", "libc6", "libgcc-s1", "libexpat1", "zlib1g", "libssl3"}
    assert "gcc-12-base" in debian.closure(packages(), ["libc6"])


def test_orig_names_lists_only_orig_tarballs_and_version_key_orders_them_newest_first():
    _, lines = next(debian.stanzas(SOURCES))
    assert debian.orig_names(lines) == {"python3.13_3.13.9.orig.tar.xz", "python3.13_3.13.5.orig.tar.xz"}
    # By the numbers, not the characters: 3.14.10 after 3.14.9.
    names = ["python3.14_3.14.9.orig.tar.xz", "python3.14_3.14.10.orig.tar.xz", "python3.14_3.14.8.orig.tar.xz"]
    assert sorted(names, key=debian.version_key, reverse=True) == [names[1], names[0], names[2]]


@pytest.fixture
def mirror(monkeypatch):
    """A mirror of the two indexes above: fetch answers a pool path with the
    path's bytes and fails on any other, and on the versions in ``lost``, as
    the mirror does for a file it lost."""
    class Mirror:
        fetched = []
        mirrors = []
        lost = {"3.13.9"}

    def fetch(path, mirror=None, timeout=120):
        Mirror.mirrors.append(mirror)
        if not path.startswith("pool/") or any(path.endswith(f"_{v}.orig.tar.xz") for v in Mirror.lost):
            raise OSError(f"404 {path}")
        Mirror.fetched.append(path)
        return path.encode()

    monkeypatch.setattr(debian, "fetch", fetch)
    monkeypatch.setattr(debian, "index", lambda suite, name, mirror=None: SOURCES if name == "source/Sources" else PACKAGES)
    return Mirror


def run(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["debian.py", *argv])
    debian.main()


def test_debs_writes_the_named_packages_or_with_depends_their_closure(mirror, monkeypatch, tmp_path):
    run(monkeypatch, "debs", "bookworm", "arm64", str(tmp_path), "libc6", "zlib1g")
    assert sorted(os.listdir(tmp_path)) == ["libc6.deb", "zlib1g.deb"]
    assert (tmp_path / "libc6.deb").read_bytes() == b"pool/main/g/glibc/libc6_2.36-9_arm64.deb"
    (tmp_path / "all").mkdir()
    run(monkeypatch, "debs", "bookworm", "arm64", str(tmp_path / "all"), "libc6", "--depends", "--unneeded", "gcc-12-base")
    assert sorted(os.listdir(tmp_path / "all")) == ["libc6.deb", "libgcc-s1.deb"]


def test_debs_fails_naming_a_package_the_suite_lacks(mirror, monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="has no no-such-package"):
        run(monkeypatch, "debs", "bookworm", "arm64", str(tmp_path), "libc6", "no-such-package")
    assert os.listdir(tmp_path) == []


def test_orig_skips_a_tarball_the_mirror_lost_and_fails_when_none_downloads(mirror, monkeypatch, tmp_path, capsys):
    out = tmp_path / "src.tar.xz"
    # The newest across the package's stanzas first (3.13.15 has a stanza of its own);
    # with it lost too, past 3.13.9 (lost), the next: 3.13.5.
    run(monkeypatch, "orig", str(out), "python3.14:sid", "python3.13:sid,trixie")
    assert capsys.readouterr().out == "sid python3.13_3.13.15.orig.tar.xz http://deb.debian.org/debian\n"
    assert out.read_bytes() == b"pool/main/p/python3.13/python3.13_3.13.15.orig.tar.xz"
    mirror.lost.add("3.13.15")
    run(monkeypatch, "orig", str(out), "python3.13:sid")
    assert capsys.readouterr().out == "sid python3.13_3.13.5.orig.tar.xz http://deb.debian.org/debian\n"
    with pytest.raises(SystemExit, match="no orig tarball"):
        run(monkeypatch, "orig", str(out), "python3.14:sid,trixie")


def test_mirror_names_the_archive_every_download_reads_and_defaults_to_debians(monkeypatch, tmp_path):
    """Through the real fetch and index, on a stand-in for urlopen: every URL
    starts with --mirror's archive, else Debian's."""
    import io
    import lzma

    urls = []

    def urlopen(url, timeout):
        urls.append(url)
        return io.BytesIO(lzma.compress(PACKAGES.encode()) if url.endswith("Packages.xz") else b"deb")

    monkeypatch.setattr(debian.urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(debian, "MIRROR", debian.MIRROR)  # restored after the test
    run(monkeypatch, "--mirror", "http://archive.ubuntu.com/ubuntu/", "debs", "resolute", "amd64", str(tmp_path), "zlib1g")
    assert urls == ["http://archive.ubuntu.com/ubuntu/dists/resolute/main/binary-amd64/Packages.xz",
                    "http://archive.ubuntu.com/ubuntu/pool/main/z/zlib/zlib1g_1.2.13_arm64.deb"]
    urls.clear()
    run(monkeypatch, "debs", "bookworm", "arm64", str(tmp_path), "zlib1g")
    assert urls == ["http://deb.debian.org/debian/dists/bookworm/main/binary-arm64/Packages.xz",
                    "http://deb.debian.org/debian/pool/main/z/zlib/zlib1g_1.2.13_arm64.deb"]
    assert (tmp_path / "zlib1g.deb").read_bytes() == b"deb"


def test_orig_reads_each_spec_from_its_own_mirror_and_each_index_once(monkeypatch, tmp_path, capsys):
    """Through the real index, on a stand-in for urlopen: a spec's @MIRROR is the
    archive of its index and tarball; a suite's index is read once per archive."""
    import io
    import lzma

    urls = []

    def urlopen(url, timeout):
        urls.append(url)
        if url.endswith("Sources.xz"):
            return io.BytesIO(lzma.compress(SOURCES.encode()))
        if "python3.14" in url or "debian.org" in url and "3.13.15" in url:
            raise OSError(f"404 {url}")
        return io.BytesIO(url.encode())

    monkeypatch.setattr(debian.urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(debian, "_INDEXES", {})
    out = tmp_path / "src.tar.xz"
    ubuntu = "http://archive.ubuntu.com/ubuntu"
    run(monkeypatch, "orig", str(out), "python3.14:sid,trixie", f"python3.14:resolute@{ubuntu}/", "python3.13:sid,trixie")
    assert capsys.readouterr().out == "sid python3.13_3.13.9.orig.tar.xz http://deb.debian.org/debian\n"
    indexes = [u for u in urls if u.endswith("Sources.xz")]
    assert indexes == [
        "http://deb.debian.org/debian/dists/sid/main/source/Sources.xz",
        "http://deb.debian.org/debian/dists/trixie/main/source/Sources.xz",
        f"{ubuntu}/dists/resolute/main/source/Sources.xz",
    ]
    run(monkeypatch, "orig", str(out), f"python3.13:resolute@{ubuntu}")
    assert capsys.readouterr().out == f"resolute python3.13_3.13.15.orig.tar.xz {ubuntu}\n"
    assert out.read_bytes() == f"{ubuntu}/pool/main/p/python3.13/python3.13_3.13.15.orig.tar.xz".encode()
