"""`cbuild`, the one verified C builder of the fused CPU backend and the decoding step: a library is built
into a private folder with its SHA-256 beside it, reused while it verifies, rebuilt when it does not (or when
it does not load), never loaded from a folder others can write to; flag sets are tried in order. (The
decoding step's own trust tests: tests/decoding/test_decode_trust.py.)"""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from piattn.ops.pi import cbuild, fused, native

CC = os.environ.get("CC") or "cc"
needs_cc = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler")


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("PIATTN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "answer.c"
    path.write_text("int answer(void) { return 42; }\n")
    return path


def _open(path):
    return ctypes.CDLL(str(path)).answer()


@needs_cc
def test_build_verify_reuse_and_rebuild(source):
    got, flags = cbuild.load(source, _open, compiler=CC, base_flags=("-O1", "-fPIC", "-shared"))
    assert (got, flags) == (42, ())
    (library,) = (cbuild.library_folder()).glob("answer-*.so")
    assert oct(os.stat(library.parent).st_mode & 0o777) == "0o700" and cbuild.verified(library)
    built = library.stat().st_mtime_ns
    assert cbuild.load(source, _open, compiler=CC, base_flags=("-O1", "-fPIC", "-shared"))[0] == 42
    assert library.stat().st_mtime_ns == built, "a verified library is reused"
    data = library.read_bytes()[:100]
    library.unlink()  # a new file, not the loaded one's pages written over
    library.write_bytes(data)  # cut short: fails its hash, rebuilt
    assert not cbuild.verified(library)
    assert cbuild.load(source, _open, compiler=CC, base_flags=("-O1", "-fPIC", "-shared"))[0] == 42
    assert cbuild.verified(library)


@needs_cc
def test_flag_sets_in_order_and_every_failure_said(source):
    got, flags = cbuild.load(source, _open, compiler=CC, base_flags=("-fPIC", "-shared"),
                             flag_sets=(("-fno-such-flag",), ("-O2",)))
    assert (got, flags) == (42, ("-O2",))
    with pytest.raises(cbuild.BuildError, match=r"could not build answer.c with .*-fno-such-flag: .*; no extra "
                                                r"flags: "):
        cbuild.load(source, _open, compiler=CC, base_flags=("-fPIC", "-shared", "-fno-other-flag"),
                    flag_sets=(("-fno-such-flag",), ()))


def test_a_folder_others_can_write_to_is_refused(source):
    folder = cbuild.library_folder()
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(folder, 0o777)
    with pytest.raises(cbuild.Unsafe, match="can be written by group or others"):
        cbuild.load(source, _open, compiler=CC, base_flags=())
    assert not list(folder.iterdir())


def test_both_libraries_use_it():
    """fused.py and native.py keep no builder of their own."""
    for module in (fused, native):
        with open(module.__file__) as f:
            text = f.read()
        assert "cbuild.load(" in text and "subprocess" not in text and "hashlib" not in text


@needs_cc
def test_a_folder_swapped_after_its_check_is_not_loaded_from(source, tmp_path, monkeypatch):
    """N1: whoever can rename entries beside the library folder swaps it for theirs, with a library and a
    matching hash under our library's name, right after the folder passed its check. What loads must be
    ours (42), never theirs (666): the folder is opened once and everything after the check goes through
    that descriptor. (Both libraries are built, not loaded, first: the loader would hand back a library
    already loaded under the same path name.)"""
    base = ("-O1", "-fPIC", "-shared")
    path = cbuild.library_path(source, CC, base)
    path.parent.mkdir(parents=True, mode=0o700)
    cbuild.build(source, path, CC, base)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    evil = tmp_path / "evil.c"
    evil.write_text("int answer(void) { return 666; }\n")
    cbuild.build(evil, theirs / path.name, CC, base)
    folder, check, swapped = path.parent, cbuild._check_private, []

    def check_then_swap(*args):  # the race: the swap lands right after the folder passed its check
        check(*args)
        os.rename(folder, folder.with_name("native.ours"))
        os.rename(theirs, folder)
        swapped.append(True)

    monkeypatch.setattr(cbuild, "_check_private", check_then_swap)
    got = cbuild.load(source, _open, compiler=CC, base_flags=base)[0]
    assert swapped == [True]
    assert got == 42


@needs_cc
def test_a_build_says_so_and_a_reuse_does_not(source, capsys):
    """The first call that needs a library waits for the compiler: it says so on stderr, once per build."""
    cbuild.load(source, _open, compiler=CC, base_flags=("-O1", "-fPIC", "-shared"))
    assert "piattn: compiling answer.c (-O1 -fPIC -shared) into" in capsys.readouterr().err
    cbuild.load(source, _open, compiler=CC, base_flags=("-O1", "-fPIC", "-shared"))
    assert "compiling" not in capsys.readouterr().err


@needs_cc
def test_a_change_to_an_included_file_is_a_new_build(tmp_path, monkeypatch):
    """A library is compiled from its source and the files that source includes by `#include "name"`
    (decode_step.c and decode_gate.h): the cache key counts all of them, so a changed header is never served
    the library of the old one. A system header (<...>) is not one of them."""
    monkeypatch.setenv("PIATTN_CACHE", str(tmp_path / "cache"))
    source, header, inner = tmp_path / "outer.c", tmp_path / "value.h", tmp_path / "inner.h"
    source.write_text('#include <stdint.h>\n#include "value.h"\nint answer(void) { return VALUE; }\n')
    header.write_text('#include "inner.h"\n#define VALUE INNER\n')
    inner.write_text("#define INNER 42\n")
    assert cbuild.sources(source) == [source, header, inner]
    base = ("-O1", "-fPIC", "-shared")
    first = cbuild.library_path(source, CC, base)
    assert cbuild.load(source, _open, compiler=CC, base_flags=base)[0] == 42
    inner.write_text("#define INNER 7\n")
    assert cbuild.library_path(source, CC, base) != first
    assert cbuild.load(source, _open, compiler=CC, base_flags=base)[0] == 7


def test_the_decoding_step_is_keyed_by_both_its_files():
    """decode_step.c is compiled with decode_gate.h (one translation unit): both are in its key."""
    assert [path.name for path in cbuild.sources(native.SOURCE)] == ["decode_step.c", "decode_gate.h"]
    assert [path.name for path in cbuild.sources(fused.SOURCE)] == ["fused_cpu.c"]


AARCH64_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""


def test_the_cache_key_tells_aarch64_cpus_apart(monkeypatch):
    """aarch64's /proc/cpuinfo has no "model name" or "flags" lines: a library built with -march=native on a
    core with SVE must not be found by another core (SIGILL) in a shared cache folder."""
    identities = []
    for text in (AARCH64_CPUINFO, AARCH64_CPUINFO.replace("asimddp", "asimddp sve"),
                 AARCH64_CPUINFO.replace("0xd0c", "0xd40")):
        monkeypatch.setattr(cbuild, "_cpuinfo_lines", lambda text=text: text.splitlines())
        identities.append(cbuild.cpu_identity())
    assert len(set(identities)) == 3 and all(b"Features" in i for i in identities)
    assert b"BogoMIPS" not in identities[0]  # a measured speed, not what the code is built for
