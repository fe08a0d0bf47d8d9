#!/usr/bin/env python3
"""lakecache's POSIX conformance cases, written from the POSIX
specification and the Linux man pages (open(2), unlink(2), rename(2),
mkdir(2), rmdir(2), truncate(2), chmod(2), chown(2), utimensat(2),
symlink(2), link(2), mknod(2)).

Each case checks one success path with its effect on `stat` fields, or
one errno of a man page's ERRORS section that a root-and-unprivileged
Linux setup can trigger. Run as root against a directory:

    python3 conformance.py --dir /mnt/data/posix --json out.json

Every case must pass on a local ext4 or tmpfs directory: that is how the
suite itself is checked. Unprivileged steps run in a forked child with
uid/gid 65534 (supplementary group 4242 where a case needs a second one).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import pickle
import shutil
import stat
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

USER = 65534
GROUP = 65534
SECOND_GROUP = 4242
OTHER_USER = 4343

Case = tuple[str, str, Callable[[str], None]]
CASES: list[Case] = []


def case(syscall: str, name: str) -> Callable[[Callable[[str], None]], Callable[[str], None]]:
    def register(fn: Callable[[str], None]) -> Callable[[str], None]:
        CASES.append((syscall, name, fn))
        return fn

    return register


# ---------------------------------------------------------------- helpers


def as_user(
    fn: Callable[[], Any], uid: int = USER, gid: int = GROUP, groups: tuple[int, ...] = (GROUP,)
) -> Any:
    """Runs `fn` in a child with the given ids; returns its result or
    raises the OSError it raised (same errno)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups(list(groups))
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            out: Any = ("ok", fn())
        except OSError as e:
            out = ("oserror", e.errno)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = ("error", repr(e))
        with os.fdopen(w, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "ok":
        return value
    if kind == "oserror":
        raise OSError(value, os.strerror(value))
    raise AssertionError(f"unprivileged step failed: {value}")


def expect_errno(want: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except OSError as e:
        if e.errno != want:
            raise AssertionError(
                f"expected {errno.errorcode[want]}, got {errno.errorcode.get(e.errno, e.errno)}"
            ) from e
        return
    raise AssertionError(f"expected {errno.errorcode[want]}, the call succeeded")


def expect_user_errno(want: int, fn: Callable[[], Any], **ids: Any) -> None:
    expect_errno(want, as_user, fn, **ids)


def write(path: str, data: bytes = b"", mode: int | None = None) -> None:
    """Writes a file; with `mode`, sets exactly that mode (no umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    if mode is not None:
        os.chmod(path, mode)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def perm(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def tick() -> None:
    """Lets the clock move past a timestamp's resolution."""
    time.sleep(0.02)


def user_dir(d: str, name: str = "u", mode: int = 0o755) -> str:
    """A directory owned by the unprivileged user."""
    path = os.path.join(d, name)
    os.mkdir(path)
    os.chown(path, USER, GROUP)
    os.chmod(path, mode)
    return path


def renameat2(old: str, new: str, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    rc = libc.renameat2(at_fdcwd, old.encode(), at_fdcwd, new.encode(), flags)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


RENAME_NOREPLACE = 1
LONG_NAME = "n" * 256


# ------------------------------------------------------------------- open


@case("open", "O_CREAT makes an empty file with the mode less the umask, owned by the caller")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o666))
    st = os.stat(p)
    check(stat.S_ISREG(st.st_mode), "regular file")
    check(stat.S_IMODE(st.st_mode) == 0o644, f"mode {oct(st.st_mode)}")
    check((st.st_uid, st.st_gid, st.st_size, st.st_nlink) == (0, 0, 0, 1), f"owner/size/nlink {st}")


@case("open", "O_CREAT by an unprivileged user: owner and group are the caller's")
def _(d: str) -> None:
    os.chmod(d, 0o777)
    p = os.path.join(d, "f")
    as_user(lambda: os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o640)))
    st = os.stat(p)
    check((st.st_uid, st.st_gid) == (USER, GROUP), f"owner {st.st_uid}:{st.st_gid}")
    check(stat.S_IMODE(st.st_mode) == 0o640, f"mode {oct(st.st_mode)}")


@case("open", "O_CREAT in a set-group-ID directory takes the directory's group")
def _(d: str) -> None:
    sub = os.path.join(d, "g")
    os.mkdir(sub)
    os.chown(sub, 0, SECOND_GROUP)
    os.chmod(sub, 0o2777)
    p = os.path.join(sub, "f")
    as_user(lambda: os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)))
    check(os.stat(p).st_gid == SECOND_GROUP, f"gid {os.stat(p).st_gid}")


@case("open", "O_CREAT|O_RDONLY creates a visible empty file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_RDONLY | os.O_CREAT, 0o644)
    check(os.read(fd, 10) == b"", "reads empty")
    os.close(fd)
    check(os.path.exists(p) and os.stat(p).st_size == 0, "exists and empty")
    check("f" in os.listdir(d), "listed")


@case("open", "written data is read back and sets the size")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"hello world")
    check(read(p) == b"hello world", "content")
    check(os.stat(p).st_size == 11, "size")


@case("open", "O_TRUNC empties an existing file and updates mtime")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"data")
    before = os.stat(p).st_mtime_ns
    tick()
    os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
    st = os.stat(p)
    check(st.st_size == 0, "size 0")
    check(st.st_mtime_ns > before, "mtime moved")


@case("open", "O_TRUNC keeps the file's mode and owner")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"data", 0o600)
    os.chown(p, USER, GROUP)
    os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
    st = os.stat(p)
    check((stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, USER, GROUP), f"{st}")


@case("open", "creat then unlink while open leaves nothing")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"temp")
    os.unlink(p)
    os.close(fd)
    check(not os.path.exists(p), "gone")
    check(os.listdir(d) == [], f"listing {os.listdir(d)}")


@case("open", "EEXIST: O_CREAT|O_EXCL on an existing file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    expect_errno(errno.EEXIST, os.open, p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


@case("open", "EEXIST: O_CREAT|O_EXCL on a dangling symlink")
def _(d: str) -> None:
    p = os.path.join(d, "l")
    os.symlink("missing", p)
    expect_errno(errno.EEXIST, os.open, p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


@case("open", "ENOENT: no such file without O_CREAT")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.open, os.path.join(d, "missing"), os.O_RDONLY)


@case("open", "ENOENT: O_CREAT in a missing directory")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.open, os.path.join(d, "no", "f"), os.O_WRONLY | os.O_CREAT, 0o644)


@case("open", "ENOENT: a dangling symlink without O_CREAT")
def _(d: str) -> None:
    p = os.path.join(d, "l")
    os.symlink("missing", p)
    expect_errno(errno.ENOENT, os.open, p, os.O_RDONLY)


@case("open", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    expect_errno(errno.ENOTDIR, os.open, os.path.join(p, "x"), os.O_RDONLY)


@case("open", "ENOTDIR: O_DIRECTORY on a file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    expect_errno(errno.ENOTDIR, os.open, p, os.O_RDONLY | os.O_DIRECTORY)


@case("open", "EISDIR: a directory opened for writing")
def _(d: str) -> None:
    expect_errno(errno.EISDIR, os.open, d, os.O_WRONLY)


@case("open", "ENAMETOOLONG: a 256-byte name")
def _(d: str) -> None:
    expect_errno(
        errno.ENAMETOOLONG, os.open, os.path.join(d, LONG_NAME), os.O_WRONLY | os.O_CREAT, 0o644
    )


@case("open", "ELOOP: O_NOFOLLOW on a symlink")
def _(d: str) -> None:
    write(os.path.join(d, "t"))
    p = os.path.join(d, "l")
    os.symlink("t", p)
    expect_errno(errno.ELOOP, os.open, p, os.O_RDONLY | os.O_NOFOLLOW)


@case("open", "ELOOP: a loop of symlinks")
def _(d: str) -> None:
    os.symlink("b", os.path.join(d, "a"))
    os.symlink("a", os.path.join(d, "b"))
    expect_errno(errno.ELOOP, os.open, os.path.join(d, "a"), os.O_RDONLY)


@case("open", "EACCES: reading a 0600 file of another user")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"secret", 0o600)
    expect_user_errno(errno.EACCES, lambda: os.open(p, os.O_RDONLY))


@case("open", "EACCES: writing a 0644 file of another user")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x", 0o644)
    expect_user_errno(errno.EACCES, lambda: os.open(p, os.O_WRONLY | os.O_TRUNC))


@case("open", "EACCES: search permission denied on a directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o700)
    write(os.path.join(sub, "f"))
    expect_user_errno(errno.EACCES, lambda: os.open(os.path.join(sub, "f"), os.O_RDONLY))


@case("open", "EACCES: O_CREAT in a directory without write permission")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o755)
    expect_user_errno(
        errno.EACCES, lambda: os.open(os.path.join(sub, "f"), os.O_WRONLY | os.O_CREAT, 0o644)
    )


@case("open", "a file readable by others can be read by them")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"shared", 0o644)
    check(as_user(lambda: read(p)) == b"shared", "content")


@case("open", "EPERM: O_NOATIME on a file the caller does not own")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x", 0o644)
    expect_user_errno(errno.EPERM, lambda: os.open(p, os.O_RDONLY | os.O_NOATIME))


@case("open", "the inode number is stable across opens and stats")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x")
    a = os.stat(p).st_ino
    read(p)
    check(os.stat(p).st_ino == a and os.lstat(p).st_ino == a, "same inode")


# ----------------------------------------------------------------- unlink


@case("unlink", "removes a file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x")
    os.unlink(p)
    expect_errno(errno.ENOENT, os.stat, p)
    check(os.listdir(d) == [], "not listed")


@case("unlink", "removes a symlink, not its target")
def _(d: str) -> None:
    t = os.path.join(d, "t")
    write(t, b"x")
    p = os.path.join(d, "l")
    os.symlink("t", p)
    os.unlink(p)
    check(not os.path.lexists(p), "link gone")
    check(read(t) == b"x", "target kept")


@case("unlink", "an open file stays readable after unlink")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"still here")
    with open(p, "rb") as f:
        os.unlink(p)
        check(f.read() == b"still here", "content through the open file")


@case("unlink", "ENOENT: no such file")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.unlink, os.path.join(d, "missing"))


@case("unlink", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    expect_errno(errno.ENOTDIR, os.unlink, os.path.join(p, "x"))


@case("unlink", "EISDIR: a directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub)
    expect_errno(errno.EISDIR, os.unlink, sub)


@case("unlink", "ENAMETOOLONG: a 256-byte name")
def _(d: str) -> None:
    expect_errno(errno.ENAMETOOLONG, os.unlink, os.path.join(d, LONG_NAME))


@case("unlink", "EACCES: no write permission on the directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o755)
    p = os.path.join(sub, "f")
    write(p)
    os.chown(p, USER, GROUP)
    expect_user_errno(errno.EACCES, lambda: os.unlink(p))


@case("unlink", "EPERM: another user's file in a sticky directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub)
    os.chmod(sub, 0o1777)
    p = os.path.join(sub, "f")
    write(p, b"x", 0o666)
    os.chown(p, OTHER_USER, GROUP)
    expect_user_errno(errno.EPERM, lambda: os.unlink(p))


@case("unlink", "the owner may remove its own file in a sticky directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub)
    os.chmod(sub, 0o1777)
    p = os.path.join(sub, "f")
    as_user(lambda: write(p, b"mine"))
    as_user(lambda: os.unlink(p))
    check(not os.path.exists(p), "gone")


# ------------------------------------------------------------------ mkdir


@case("mkdir", "makes a directory with the mode less the umask, owned by the caller")
def _(d: str) -> None:
    p = os.path.join(d, "s")
    os.mkdir(p, 0o777)
    st = os.stat(p)
    check(stat.S_ISDIR(st.st_mode), "directory")
    check(stat.S_IMODE(st.st_mode) == 0o755, f"mode {oct(st.st_mode)}")
    check((st.st_uid, st.st_gid) == (0, 0), "owner")
    check(os.listdir(p) == [], "empty")


@case("mkdir", "an unprivileged caller owns its directory")
def _(d: str) -> None:
    os.chmod(d, 0o777)
    p = os.path.join(d, "s")
    as_user(lambda: os.mkdir(p, 0o750))
    st = os.stat(p)
    check((st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (USER, GROUP, 0o750), f"{st}")


@case("mkdir", "a set-group-ID parent passes on its group and the bit")
def _(d: str) -> None:
    parent = os.path.join(d, "g")
    os.mkdir(parent)
    os.chown(parent, 0, SECOND_GROUP)
    os.chmod(parent, 0o2777)
    p = os.path.join(parent, "s")
    as_user(lambda: os.mkdir(p, 0o755))
    st = os.stat(p)
    check(st.st_gid == SECOND_GROUP, f"gid {st.st_gid}")
    check(st.st_mode & stat.S_ISGID != 0, "set-group-ID inherited")


@case("mkdir", "nested directories and files under them")
def _(d: str) -> None:
    os.makedirs(os.path.join(d, "a", "b", "c"))
    write(os.path.join(d, "a", "b", "c", "f"), b"deep")
    check(read(os.path.join(d, "a", "b", "c", "f")) == b"deep", "content")
    check(sorted(os.listdir(os.path.join(d, "a"))) == ["b"], "listing")


@case("mkdir", "EEXIST: a directory of that name exists")
def _(d: str) -> None:
    os.mkdir(os.path.join(d, "s"))
    expect_errno(errno.EEXIST, os.mkdir, os.path.join(d, "s"))


@case("mkdir", "EEXIST: a file of that name exists")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.EEXIST, os.mkdir, os.path.join(d, "f"))


@case("mkdir", "EEXIST: a symlink of that name exists")
def _(d: str) -> None:
    os.symlink("missing", os.path.join(d, "l"))
    expect_errno(errno.EEXIST, os.mkdir, os.path.join(d, "l"))


@case("mkdir", "ENOENT: the parent does not exist")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.mkdir, os.path.join(d, "no", "s"))


@case("mkdir", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.mkdir, os.path.join(d, "f", "s"))


@case("mkdir", "ENAMETOOLONG: a 256-byte name")
def _(d: str) -> None:
    expect_errno(errno.ENAMETOOLONG, os.mkdir, os.path.join(d, LONG_NAME))


@case("mkdir", "EACCES: no write permission on the parent")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o755)
    expect_user_errno(errno.EACCES, lambda: os.mkdir(os.path.join(sub, "x")))


# ------------------------------------------------------------------ rmdir


@case("rmdir", "removes an empty directory")
def _(d: str) -> None:
    p = os.path.join(d, "s")
    os.mkdir(p)
    os.rmdir(p)
    check(not os.path.exists(p), "gone")


@case("rmdir", "ENOTEMPTY: the directory has entries")
def _(d: str) -> None:
    p = os.path.join(d, "s")
    os.mkdir(p)
    write(os.path.join(p, "f"))
    expect_errno(errno.ENOTEMPTY, os.rmdir, p)


@case("rmdir", "ENOTDIR: a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.rmdir, os.path.join(d, "f"))


@case("rmdir", "ENOENT: no such directory")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.rmdir, os.path.join(d, "missing"))


@case("rmdir", "EINVAL: the last component is '.'")
def _(d: str) -> None:
    p = os.path.join(d, "s")
    os.mkdir(p)
    expect_errno(errno.EINVAL, os.rmdir, os.path.join(p, "."))


@case("rmdir", "ENAMETOOLONG: a 256-byte name")
def _(d: str) -> None:
    expect_errno(errno.ENAMETOOLONG, os.rmdir, os.path.join(d, LONG_NAME))


@case("rmdir", "EACCES: no write permission on the parent")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o755)
    os.mkdir(os.path.join(sub, "x"))
    expect_user_errno(errno.EACCES, lambda: os.rmdir(os.path.join(sub, "x")))


@case("rmdir", "EPERM: another user's directory in a sticky directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub)
    os.chmod(sub, 0o1777)
    x = os.path.join(sub, "x")
    os.mkdir(x)
    os.chown(x, OTHER_USER, GROUP)
    expect_user_errno(errno.EPERM, lambda: os.rmdir(x))


# ----------------------------------------------------------------- rename


@case("rename", "a file keeps its inode, content and attributes under the new name")
def _(d: str) -> None:
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    write(a, b"payload", 0o640)
    os.chown(a, USER, GROUP)
    before = os.stat(a)
    os.rename(a, b)
    st = os.stat(b)
    check(not os.path.exists(a), "old name gone")
    check(read(b) == b"payload", "content")
    check(st.st_ino == before.st_ino, "same inode")
    check((st.st_mode, st.st_uid, st.st_gid) == (before.st_mode, USER, GROUP), "attributes")


@case("rename", "a file replaces an existing file")
def _(d: str) -> None:
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    write(a, b"new")
    write(b, b"old")
    ino = os.stat(a).st_ino
    os.rename(a, b)
    check(read(b) == b"new", "content")
    check(os.stat(b).st_ino == ino, "source's inode")
    check(os.listdir(d) == ["b"], "one name")


@case("rename", "into another directory")
def _(d: str) -> None:
    os.mkdir(os.path.join(d, "s"))
    write(os.path.join(d, "a"), b"x")
    os.rename(os.path.join(d, "a"), os.path.join(d, "s", "a"))
    check(read(os.path.join(d, "s", "a")) == b"x", "moved")


@case("rename", "an empty directory to a new name")
def _(d: str) -> None:
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    os.mkdir(a, 0o750)
    ino = os.stat(a).st_ino
    os.rename(a, b)
    check(os.path.isdir(b) and not os.path.exists(a), "moved")
    check(os.stat(b).st_ino == ino and perm(b) == 0o750, "inode and mode kept")


@case("rename", "a directory with files in it")
def _(d: str) -> None:
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    os.makedirs(os.path.join(a, "sub"))
    write(os.path.join(a, "f"), b"1")
    write(os.path.join(a, "sub", "g"), b"2")
    os.rename(a, b)
    check(
        read(os.path.join(b, "f")) == b"1" and read(os.path.join(b, "sub", "g")) == b"2",
        "contents moved",
    )
    check(not os.path.exists(a), "old name gone")


@case("rename", "a directory replaces an empty directory")
def _(d: str) -> None:
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    os.mkdir(a)
    os.mkdir(b)
    os.rename(a, b)
    check(os.path.isdir(b) and not os.path.exists(a), "replaced")


@case("rename", "a symlink moves, not its target")
def _(d: str) -> None:
    write(os.path.join(d, "t"), b"x")
    os.symlink("t", os.path.join(d, "l"))
    os.rename(os.path.join(d, "l"), os.path.join(d, "m"))
    check(os.readlink(os.path.join(d, "m")) == "t", "link moved")
    check(os.path.isfile(os.path.join(d, "t")), "target kept")


@case("rename", "a file onto itself is a no-op")
def _(d: str) -> None:
    a = os.path.join(d, "a")
    write(a, b"x")
    os.rename(a, a)
    check(read(a) == b"x", "unchanged")


@case("rename", "ENOTEMPTY: a directory onto a non-empty directory")
def _(d: str) -> None:
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    os.mkdir(a)
    os.mkdir(b)
    write(os.path.join(b, "f"))
    expect_errno(errno.ENOTEMPTY, os.rename, a, b)


@case("rename", "EISDIR: a file onto a directory")
def _(d: str) -> None:
    write(os.path.join(d, "a"))
    os.mkdir(os.path.join(d, "b"))
    expect_errno(errno.EISDIR, os.rename, os.path.join(d, "a"), os.path.join(d, "b"))


@case("rename", "ENOTDIR: a directory onto a file")
def _(d: str) -> None:
    os.mkdir(os.path.join(d, "a"))
    write(os.path.join(d, "b"))
    expect_errno(errno.ENOTDIR, os.rename, os.path.join(d, "a"), os.path.join(d, "b"))


@case("rename", "ENOENT: the source does not exist")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.rename, os.path.join(d, "missing"), os.path.join(d, "b"))


@case("rename", "ENOENT: the target's directory does not exist")
def _(d: str) -> None:
    write(os.path.join(d, "a"))
    expect_errno(errno.ENOENT, os.rename, os.path.join(d, "a"), os.path.join(d, "no", "b"))


@case("rename", "EINVAL: a directory into its own subdirectory")
def _(d: str) -> None:
    os.makedirs(os.path.join(d, "a", "b"))
    expect_errno(errno.EINVAL, os.rename, os.path.join(d, "a"), os.path.join(d, "a", "b", "c"))


@case("rename", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.rename, os.path.join(d, "f", "x"), os.path.join(d, "y"))


@case("rename", "ENAMETOOLONG: a 256-byte target name")
def _(d: str) -> None:
    write(os.path.join(d, "a"))
    expect_errno(errno.ENAMETOOLONG, os.rename, os.path.join(d, "a"), os.path.join(d, LONG_NAME))


@case("rename", "EEXIST: RENAME_NOREPLACE onto an existing name")
def _(d: str) -> None:
    write(os.path.join(d, "a"))
    write(os.path.join(d, "b"))
    expect_errno(
        errno.EEXIST, renameat2, os.path.join(d, "a"), os.path.join(d, "b"), RENAME_NOREPLACE
    )


@case("rename", "RENAME_NOREPLACE to a free name")
def _(d: str) -> None:
    write(os.path.join(d, "a"), b"x")
    renameat2(os.path.join(d, "a"), os.path.join(d, "b"), RENAME_NOREPLACE)
    check(read(os.path.join(d, "b")) == b"x", "moved")


@case("rename", "EACCES: no write permission on the source directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o755)
    write(os.path.join(sub, "a"))
    os.chmod(d, 0o777)
    expect_user_errno(errno.EACCES, lambda: os.rename(os.path.join(sub, "a"), os.path.join(d, "b")))


@case("rename", "EPERM: another user's file out of a sticky directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub)
    os.chmod(sub, 0o1777)
    p = os.path.join(sub, "a")
    write(p, b"x", 0o666)
    os.chown(p, OTHER_USER, GROUP)
    expect_user_errno(errno.EPERM, lambda: os.rename(p, os.path.join(sub, "b")))


@case("rename", "a FIFO keeps its type")
def _(d: str) -> None:
    os.mkfifo(os.path.join(d, "p"), 0o640)
    os.rename(os.path.join(d, "p"), os.path.join(d, "q"))
    st = os.lstat(os.path.join(d, "q"))
    check(
        stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640, f"mode {oct(st.st_mode)}"
    )


# --------------------------------------------------------------- truncate


@case("truncate", "shrinks a file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"0123456789")
    os.truncate(p, 4)
    check(read(p) == b"0123", "content")
    check(os.stat(p).st_size == 4, "size")


@case("truncate", "grows a file with zeros")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"ab")
    os.truncate(p, 6)
    check(read(p) == b"ab\0\0\0\0", "content")


@case("truncate", "to zero")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"abc")
    os.truncate(p, 0)
    check(os.stat(p).st_size == 0 and read(p) == b"", "empty")


@case("truncate", "updates mtime and ctime")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"abc")
    before = os.stat(p)
    tick()
    os.truncate(p, 1)
    st = os.stat(p)
    check(
        st.st_mtime_ns > before.st_mtime_ns and st.st_ctime_ns > before.st_ctime_ns, "times moved"
    )


@case("truncate", "keeps mode and owner")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"abc", 0o600)
    os.chown(p, USER, GROUP)
    os.truncate(p, 1)
    st = os.stat(p)
    check((stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, USER), "attributes")


@case("truncate", "ftruncate on a file being written")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, 8)
    os.write(fd, b"ab")
    os.close(fd)
    check(read(p) == b"ab" + b"\0" * 6, "content")


@case("truncate", "ftruncate on an existing file opened for writing")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"0123456789")
    fd = os.open(p, os.O_WRONLY)
    os.ftruncate(fd, 3)
    os.close(fd)
    check(read(p) == b"012", "content")


@case("truncate", "EISDIR: a directory")
def _(d: str) -> None:
    expect_errno(errno.EISDIR, os.truncate, d, 0)


@case("truncate", "ENOENT: no such file")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.truncate, os.path.join(d, "missing"), 0)


@case("truncate", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.truncate, os.path.join(d, "f", "x"), 0)


@case("truncate", "EINVAL: a negative length")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x")
    expect_errno(errno.EINVAL, os.truncate, p, -1)


@case("truncate", "EACCES: no write permission")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x", 0o644)
    expect_user_errno(errno.EACCES, lambda: os.truncate(p, 0))


@case("truncate", "EINVAL: ftruncate on a file open only for reading")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x")
    fd = os.open(p, os.O_RDONLY)
    try:
        expect_errno(errno.EINVAL, os.ftruncate, fd, 0)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ chmod


@case("chmod", "sets the permission bits and ctime")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x", 0o644)
    before = os.stat(p).st_ctime_ns
    tick()
    os.chmod(p, 0o751)
    st = os.stat(p)
    check(stat.S_IMODE(st.st_mode) == 0o751, f"mode {oct(st.st_mode)}")
    check(st.st_ctime_ns > before, "ctime moved")


@case("chmod", "set-user-ID, set-group-ID and sticky bits are kept")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x")
    os.chmod(p, 0o7755)
    check(perm(p) == 0o7755, f"mode {oct(perm(p))}")


@case("chmod", "a directory's mode")
def _(d: str) -> None:
    p = os.path.join(d, "s")
    os.mkdir(p)
    os.chmod(p, 0o1777)
    check(perm(p) == 0o1777, f"mode {oct(perm(p))}")


@case("chmod", "fchmod on an open file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x")
    fd = os.open(p, os.O_RDONLY)
    os.fchmod(fd, 0o600)
    os.close(fd)
    check(perm(p) == 0o600, f"mode {oct(perm(p))}")


@case("chmod", "fchmod on a file being written")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"data")
    os.fchmod(fd, 0o700)
    os.close(fd)
    check(perm(p) == 0o700 and read(p) == b"data", "mode and content")


@case("chmod", "the owner may chmod its own file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    os.chown(p, USER, GROUP)
    as_user(lambda: os.chmod(p, 0o600))
    check(perm(p) == 0o600, "mode")


@case("chmod", "a non-root owner outside the group loses set-group-ID")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    os.chown(p, USER, SECOND_GROUP)
    as_user(lambda: os.chmod(p, 0o2755))
    check(perm(p) == 0o755, f"mode {oct(perm(p))}")


@case("chmod", "EPERM: not the owner")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"x", 0o666)
    expect_user_errno(errno.EPERM, lambda: os.chmod(p, 0o600))


@case("chmod", "ENOENT: no such file")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.chmod, os.path.join(d, "missing"), 0o600)


@case("chmod", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.chmod, os.path.join(d, "f", "x"), 0o600)


@case("chmod", "ENAMETOOLONG: a 256-byte name")
def _(d: str) -> None:
    expect_errno(errno.ENAMETOOLONG, os.chmod, os.path.join(d, LONG_NAME), 0o600)


@case("chmod", "EACCES: search permission denied")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o700)
    p = os.path.join(sub, "f")
    write(p)
    os.chown(p, USER, GROUP)
    expect_user_errno(errno.EACCES, lambda: os.chmod(p, 0o600))


@case("chmod", "ELOOP: a loop of symlinks")
def _(d: str) -> None:
    os.symlink("b", os.path.join(d, "a"))
    os.symlink("a", os.path.join(d, "b"))
    expect_errno(errno.ELOOP, os.chmod, os.path.join(d, "a"), 0o600)


@case("chmod", "follows a symlink to its target")
def _(d: str) -> None:
    write(os.path.join(d, "t"), b"x", 0o644)
    os.symlink("t", os.path.join(d, "l"))
    os.chmod(os.path.join(d, "l"), 0o600)
    check(perm(os.path.join(d, "t")) == 0o600, "target's mode")


# ------------------------------------------------------------------ chown


@case("chown", "root sets any owner and group; ctime moves")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    before = os.stat(p).st_ctime_ns
    tick()
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    check((st.st_uid, st.st_gid) == (1234, 5678), f"owner {st.st_uid}:{st.st_gid}")
    check(st.st_ctime_ns > before, "ctime moved")


@case("chown", "-1 leaves a field unchanged")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    os.chown(p, 1234, 5678)
    os.chown(p, -1, 42)
    st = os.stat(p)
    check((st.st_uid, st.st_gid) == (1234, 42), f"owner {st.st_uid}:{st.st_gid}")


@case("chown", "a directory's owner")
def _(d: str) -> None:
    p = os.path.join(d, "s")
    os.mkdir(p)
    os.chown(p, USER, GROUP)
    st = os.stat(p)
    check((st.st_uid, st.st_gid) == (USER, GROUP), "owner")


@case("chown", "the owner may give its file to a group it belongs to")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    os.chown(p, USER, GROUP)
    as_user(lambda: os.chown(p, -1, SECOND_GROUP), groups=(GROUP, SECOND_GROUP))
    check(os.stat(p).st_gid == SECOND_GROUP, "group")


@case("chown", "a non-root chown clears set-user-ID and set-group-ID")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    os.chown(p, USER, GROUP)
    os.chmod(p, 0o6755)
    as_user(lambda: os.chown(p, -1, SECOND_GROUP), groups=(GROUP, SECOND_GROUP))
    check(perm(p) == 0o755, f"mode {oct(perm(p))}")


@case("chown", "lchown changes a symlink, not its target")
def _(d: str) -> None:
    write(os.path.join(d, "t"))
    os.symlink("t", os.path.join(d, "l"))
    os.lchown(os.path.join(d, "l"), 1234, 5678)
    check(os.lstat(os.path.join(d, "l")).st_uid == 1234, "link owner")
    check(os.stat(os.path.join(d, "t")).st_uid == 0, "target unchanged")


@case("chown", "fchown on a file being written")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"data")
    os.fchown(fd, USER, GROUP)
    os.close(fd)
    st = os.stat(p)
    check((st.st_uid, st.st_gid) == (USER, GROUP), "owner")


@case("chown", "EPERM: the owner giving the file to another user")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    os.chown(p, USER, GROUP)
    expect_user_errno(errno.EPERM, lambda: os.chown(p, OTHER_USER, -1))


@case("chown", "EPERM: the owner giving the file to a group it is not in")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    os.chown(p, USER, GROUP)
    expect_user_errno(errno.EPERM, lambda: os.chown(p, -1, SECOND_GROUP))


@case("chown", "EPERM: not the owner")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"", 0o666)
    expect_user_errno(errno.EPERM, lambda: os.chown(p, -1, GROUP))


@case("chown", "ENOENT: no such file")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.chown, os.path.join(d, "missing"), 1, 1)


@case("chown", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.chown, os.path.join(d, "f", "x"), 1, 1)


@case("chown", "ELOOP: a loop of symlinks")
def _(d: str) -> None:
    os.symlink("b", os.path.join(d, "a"))
    os.symlink("a", os.path.join(d, "b"))
    expect_errno(errno.ELOOP, os.chown, os.path.join(d, "a"), 1, 1)


@case("chown", "EACCES: search permission denied")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o700)
    p = os.path.join(sub, "f")
    write(p)
    os.chown(p, USER, GROUP)
    expect_user_errno(errno.EACCES, lambda: os.chown(p, -1, GROUP))


# -------------------------------------------------------------- utimensat


@case("utimensat", "sets atime and mtime to the nanosecond; ctime moves")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    before = os.stat(p).st_ctime_ns
    tick()
    os.utime(p, ns=(1_600_000_000_123_456_789, 1_500_000_000_987_654_321))
    st = os.stat(p)
    check(st.st_atime_ns == 1_600_000_000_123_456_789, f"atime {st.st_atime_ns}")
    check(st.st_mtime_ns == 1_500_000_000_987_654_321, f"mtime {st.st_mtime_ns}")
    check(st.st_ctime_ns > before, "ctime moved")


@case("utimensat", "UTIME_NOW sets both times to now")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    start = time.time_ns() - 2_000_000_000
    os.utime(p)
    st = os.stat(p)
    check(st.st_mtime_ns >= start and st.st_atime_ns >= start, "now")


@case("utimensat", "UTIME_OMIT leaves a time unchanged")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))
    libc = ctypes.CDLL(None, use_errno=True)

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    utime_omit = (1 << 30) - 2
    times = (Timespec * 2)(Timespec(0, utime_omit), Timespec(3, 0))
    rc = libc.utimensat(-100, p.encode(), times, 0)
    check(rc == 0, f"utimensat failed: {os.strerror(ctypes.get_errno())}")
    st = os.stat(p)
    check(
        st.st_atime_ns == 1_000_000_000 and st.st_mtime_ns == 3_000_000_000,
        f"{st.st_atime_ns} {st.st_mtime_ns}",
    )


@case("utimensat", "a directory's times")
def _(d: str) -> None:
    p = os.path.join(d, "s")
    os.mkdir(p)
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))
    check(os.stat(p).st_mtime_ns == 2_000_000_000, "mtime")


@case("utimensat", "AT_SYMLINK_NOFOLLOW sets a symlink's own times")
def _(d: str) -> None:
    write(os.path.join(d, "t"))
    p = os.path.join(d, "l")
    os.symlink("t", p)
    target_mtime = os.stat(os.path.join(d, "t")).st_mtime_ns
    os.utime(p, ns=(1_000_000_000, 2_000_000_000), follow_symlinks=False)
    check(os.lstat(p).st_mtime_ns == 2_000_000_000, "link mtime")
    check(os.stat(os.path.join(d, "t")).st_mtime_ns == target_mtime, "target unchanged")


@case("utimensat", "futimens on a file being written")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"data")
    os.utime(fd, ns=(1_000_000_000, 2_000_000_000))
    os.close(fd)
    check(os.stat(p).st_mtime_ns == 2_000_000_000, "mtime kept after close")


@case("utimensat", "a write moves mtime")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"a")
    os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    write(p, b"b")
    check(os.stat(p).st_mtime_ns > 1_000_000_000, "mtime moved")


@case("utimensat", "a non-owner with write permission may set the times to now")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"", 0o666)
    os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    as_user(lambda: os.utime(p))
    check(os.stat(p).st_mtime_ns > 1_000_000_000, "mtime moved")


@case("utimensat", "EPERM: a non-owner setting explicit times")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"", 0o666)
    expect_user_errno(errno.EPERM, lambda: os.utime(p, ns=(1, 1)))


@case("utimensat", "EACCES: a non-owner without write permission setting now")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p, b"", 0o644)
    expect_user_errno(errno.EACCES, lambda: os.utime(p))


@case("utimensat", "ENOENT: no such file")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.utime, os.path.join(d, "missing"), ns=(1, 1))


@case("utimensat", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.utime, os.path.join(d, "f", "x"), ns=(1, 1))


@case("utimensat", "EINVAL: a nanosecond field out of range")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    write(p)
    libc = ctypes.CDLL(None, use_errno=True)

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    times = (Timespec * 2)(Timespec(0, 1_000_000_000), Timespec(0, 0))
    rc = libc.utimensat(-100, p.encode(), times, 0)
    check(rc == -1 and ctypes.get_errno() == errno.EINVAL, "EINVAL")


# ---------------------------------------------------------------- symlink


@case("symlink", "readlink returns the target; lstat shows a link of its length")
def _(d: str) -> None:
    p = os.path.join(d, "l")
    os.symlink("some/target/path", p)
    check(os.readlink(p) == "some/target/path", "target")
    st = os.lstat(p)
    check(stat.S_ISLNK(st.st_mode), "a symlink")
    check(st.st_size == len("some/target/path"), f"size {st.st_size}")


@case("symlink", "stat and open follow the link")
def _(d: str) -> None:
    write(os.path.join(d, "t"), b"through the link", 0o600)
    p = os.path.join(d, "l")
    os.symlink("t", p)
    check(read(p) == b"through the link", "content")
    check(
        stat.S_ISREG(os.stat(p).st_mode) and perm(os.path.join(d, "t")) == 0o600,
        "target's attributes",
    )


@case("symlink", "a link to a directory is followed")
def _(d: str) -> None:
    os.mkdir(os.path.join(d, "s"))
    write(os.path.join(d, "s", "f"), b"x")
    os.symlink("s", os.path.join(d, "l"))
    check(os.listdir(os.path.join(d, "l")) == ["f"], "listing through the link")


@case("symlink", "an absolute target")
def _(d: str) -> None:
    p = os.path.join(d, "l")
    os.symlink("/etc/hostname", p)
    check(os.readlink(p) == "/etc/hostname", "target")


@case("symlink", "the link is owned by the caller")
def _(d: str) -> None:
    os.chmod(d, 0o777)
    p = os.path.join(d, "l")
    as_user(lambda: os.symlink("t", p))
    st = os.lstat(p)
    check((st.st_uid, st.st_gid) == (USER, GROUP), "owner")


@case("symlink", "a dangling link: lstat works, stat is ENOENT")
def _(d: str) -> None:
    p = os.path.join(d, "l")
    os.symlink("missing", p)
    check(stat.S_ISLNK(os.lstat(p).st_mode), "lstat")
    expect_errno(errno.ENOENT, os.stat, p)


@case("symlink", "listed with its type")
def _(d: str) -> None:
    os.symlink("t", os.path.join(d, "l"))
    entries = {e.name: e for e in os.scandir(d)}
    check(entries["l"].is_symlink(), "d_type is a link")


@case("symlink", "EEXIST: the name exists")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.EEXIST, os.symlink, "t", os.path.join(d, "f"))


@case("symlink", "ENOENT: the directory does not exist")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.symlink, "t", os.path.join(d, "no", "l"))


@case("symlink", "ENOENT: an empty target")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.symlink, "", os.path.join(d, "l"))


@case("symlink", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.symlink, "t", os.path.join(d, "f", "l"))


@case("symlink", "ENAMETOOLONG: a 256-byte name")
def _(d: str) -> None:
    expect_errno(errno.ENAMETOOLONG, os.symlink, "t", os.path.join(d, LONG_NAME))


@case("symlink", "EACCES: no write permission on the directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o755)
    expect_user_errno(errno.EACCES, lambda: os.symlink("t", os.path.join(sub, "l")))


@case("symlink", "EINVAL: readlink of a file that is not a link")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.EINVAL, os.readlink, os.path.join(d, "f"))


# ------------------------------------------------------------------- link


@case("link", "a hard link shares the inode and raises nlink")
def _(d: str) -> None:
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    write(a, b"x")
    os.link(a, b)
    check(os.stat(a).st_ino == os.stat(b).st_ino, "same inode")
    check(os.stat(a).st_nlink == 2, "nlink 2")


@case("link", "EEXIST: the new name exists")
def _(d: str) -> None:
    write(os.path.join(d, "a"))
    write(os.path.join(d, "b"))
    expect_errno(errno.EEXIST, os.link, os.path.join(d, "a"), os.path.join(d, "b"))


@case("link", "ENOENT: the source does not exist")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.link, os.path.join(d, "missing"), os.path.join(d, "b"))


@case("link", "EPERM: a directory")
def _(d: str) -> None:
    os.mkdir(os.path.join(d, "s"))
    expect_errno(errno.EPERM, os.link, os.path.join(d, "s"), os.path.join(d, "t"))


@case("link", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.link, os.path.join(d, "f", "x"), os.path.join(d, "y"))


# ------------------------------------------------------------------ mknod


@case("mknod", "mkfifo makes a FIFO with the mode less the umask")
def _(d: str) -> None:
    p = os.path.join(d, "p")
    os.mkfifo(p, 0o666)
    st = os.lstat(p)
    check(
        stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644, f"mode {oct(st.st_mode)}"
    )
    check(st.st_size == 0 and st.st_uid == 0, "size and owner")


@case("mknod", "a socket node")
def _(d: str) -> None:
    p = os.path.join(d, "s")
    os.mknod(p, stat.S_IFSOCK | 0o600)
    check(stat.S_ISSOCK(os.lstat(p).st_mode), "a socket")


@case("mknod", "a character device keeps its device number")
def _(d: str) -> None:
    p = os.path.join(d, "c")
    os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    st = os.lstat(p)
    check(stat.S_ISCHR(st.st_mode), "a character device")
    check((os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3), f"rdev {st.st_rdev}")


@case("mknod", "a block device keeps its device number")
def _(d: str) -> None:
    p = os.path.join(d, "b")
    os.mknod(p, stat.S_IFBLK | 0o600, os.makedev(7, 0))
    st = os.lstat(p)
    check(stat.S_ISBLK(st.st_mode) and os.major(st.st_rdev) == 7, f"mode {oct(st.st_mode)}")


@case("mknod", "a regular file")
def _(d: str) -> None:
    p = os.path.join(d, "f")
    os.mknod(p, stat.S_IFREG | 0o600)
    st = os.lstat(p)
    check(stat.S_ISREG(st.st_mode) and st.st_size == 0 and perm(p) == 0o600, "an empty file")


@case("mknod", "chmod, chown and unlink of a FIFO")
def _(d: str) -> None:
    p = os.path.join(d, "p")
    os.mkfifo(p, 0o600)
    os.chmod(p, 0o640)
    os.chown(p, USER, GROUP)
    st = os.lstat(p)
    check(
        stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_uid == USER,
        "attributes",
    )
    os.unlink(p)
    check(not os.path.lexists(p), "gone")


@case("mknod", "a FIFO is listed with its type")
def _(d: str) -> None:
    os.mkfifo(os.path.join(d, "p"))
    entries = {e.name: e for e in os.scandir(d)}
    check(stat.S_ISFIFO(entries["p"].stat(follow_symlinks=False).st_mode), "FIFO")


@case("mknod", "EEXIST: the name exists")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.EEXIST, os.mkfifo, os.path.join(d, "f"))


@case("mknod", "ENOENT: the directory does not exist")
def _(d: str) -> None:
    expect_errno(errno.ENOENT, os.mkfifo, os.path.join(d, "no", "p"))


@case("mknod", "ENOTDIR: a path component is a file")
def _(d: str) -> None:
    write(os.path.join(d, "f"))
    expect_errno(errno.ENOTDIR, os.mkfifo, os.path.join(d, "f", "p"))


@case("mknod", "ENAMETOOLONG: a 256-byte name")
def _(d: str) -> None:
    expect_errno(errno.ENAMETOOLONG, os.mkfifo, os.path.join(d, LONG_NAME))


@case("mknod", "EPERM: an unprivileged caller making a device")
def _(d: str) -> None:
    os.chmod(d, 0o777)
    expect_user_errno(
        errno.EPERM, lambda: os.mknod(os.path.join(d, "c"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    )


@case("mknod", "EACCES: no write permission on the directory")
def _(d: str) -> None:
    sub = os.path.join(d, "s")
    os.mkdir(sub, 0o755)
    expect_user_errno(errno.EACCES, lambda: os.mkfifo(os.path.join(sub, "p")))


# ------------------------------------------------------------------- main


def run(root: str, only: str | None) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for i, (syscall, name, fn) in enumerate(CASES):
        if only and only not in f"{syscall}: {name}":
            continue
        d = os.path.join(root, f"c{i:03d}")
        os.mkdir(d)
        os.chmod(d, 0o755)
        entry = results.setdefault(syscall, {"passed": 0, "failed": []})
        try:
            fn(d)
            entry["passed"] += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported
            detail = str(e) or repr(e)
            if not isinstance(e, (AssertionError, OSError)):
                detail += "\n" + traceback.format_exc()
            entry["failed"].append(f"{name}: {detail}")
        shutil.rmtree(d, ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="an empty directory to run the cases in")
    parser.add_argument("--json", help="write per-syscall results here")
    parser.add_argument("--only", help="run cases whose 'syscall: name' contains this")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: cases switch to an unprivileged uid", file=sys.stderr)
        return 2
    os.umask(0o022)
    root = os.path.join(args.dir, f"conformance-{os.getpid()}")
    os.mkdir(root)
    os.chmod(root, 0o755)
    results = run(root, args.only)
    shutil.rmtree(root, ignore_errors=True)
    total = failed = 0
    for syscall, entry in results.items():
        n = entry["passed"] + len(entry["failed"])
        total += n
        failed += len(entry["failed"])
        print(f"{syscall:10} {entry['passed']:3}/{n}")
        for f in entry["failed"]:
            print(f"    FAIL {f}")
    print(f"{'total':10} {total - failed:3}/{total}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
