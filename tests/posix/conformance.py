#!/usr/bin/env python3
"""POSIX conformance of a mounted file system, table-driven like pjdfstest (issue 16).

    conformance.py MOUNTPOINT                     # every case; persistence cases are left for:
    conformance.py MOUNTPOINT --after-remount     # ... the run after the mount was restarted
    conformance.py MOUNTPOINT --remount 'CMD'     # both in one run: CMD (sh -c) remounts MOUNTPOINT

Runs as root. The tree it works in is MOUNTPOINT/posix-conformance/ (removed first; removed at the
end of a run that had no unexpected failure and no persistence cases left to check). Cases marked
"as 65534" run in a forked child after setgroups([])/setgid/setuid to 65534:65534, so the mount
must allow other users (`allow_other`) and enforce permissions (`default_permissions`).

Every row of TABLE is one case: (expected, op, args..., [options]). `expected` is "0" (success),
an errno name ("ENOENT"), or the value the op returns (lstat fields, a symlink target, file
contents). Arguments are formatted with the group's names: {n0}..{n11} are paths in the group's own
directory, {name255}/{name256} a component of 255/256 bytes, {key1024}/{key1025} a path whose S3
key (from the mount's root, plus --prefix-len bytes of the mount's prefix) is exactly 1024/1025
bytes. Options: AS_USER runs the case as 65534:65534; Known("reason") marks a known, explained
failure (it does not make the run fail; if it passes, it is reported as "XPASS" so that the
table gets updated). A REMOUNT row splits a group: the rows after it run after the remount.

Prints one line per case and `N passed, M failed` (known failures counted apart); exits 1 on an
unexpected failure, 0 otherwise. Standard library only.
"""

import ctypes
import errno
import os
import shutil
import stat
import subprocess
import sys
import time

USER = (65534, 65534)


class _As:
    def __repr__(self):
        return "AS_USER"


AS_USER = _As()
REMOUNT = ("REMOUNT",)


class Known:
    def __init__(self, reason):
        self.reason = reason


# Known failures, each with its reason (README's semantics table says the same).

O_WRCREAT = os.O_WRONLY | os.O_CREAT
O_EXCL = os.O_WRONLY | os.O_CREAT | os.O_EXCL
T1 = 1577934245_250000000  # 2020-01-02 03:04:05.25 UTC, in ns
T2 = 1262304000_000000001  # 2010-01-01 00:00:00.000000001
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100

# ---------------------------------------------------------------------------------------------
# The table. Groups run in order; rows within a group in order (later rows use what earlier
# ones made). Names: {n0}.. are in the group's directory, which is mode 0777 (set by its first
# row), so AS_USER cases can create there; directories a case makes root-only say so.
# ---------------------------------------------------------------------------------------------

TABLE = {
    "open": [
        ("0", "chmod", ".", 0o777),
        ("0", "open", "{n0}", O_EXCL, 0o644),
        ("regular,0644,0,0,0,1", "lstat", "{n0}", "type,mode,uid,gid,size,nlink"),
        ("recent", "times_recent", "{n0}"),
        ("EEXIST", "open", "{n0}", O_EXCL, 0o644),
        ("0", "open", "{n0}", O_WRCREAT, 0o600),  # without O_EXCL: opens it
        ("regular,0644", "lstat", "{n0}", "type,mode"),  # ... and leaves the mode alone
        ("0", "mkdir", "{n1}", 0o755),
        ("EEXIST", "open", "{n1}", O_EXCL, 0o644),
        ("0", "symlink", "{n0}", "{n2}"),
        ("EEXIST", "open", "{n2}", O_EXCL, 0o644),  # O_EXCL does not follow symlinks
        ("0", "symlink", "nowhere", "{n3}"),
        ("EEXIST", "open", "{n3}", O_EXCL, 0o644),  # ... not even dangling ones
        ("0", "mkfifo", "{n4}", 0o644),
        ("EEXIST", "open", "{n4}", O_EXCL, 0o644),
        ("ENOENT", "open", "{n5}/{n6}", O_EXCL, 0o644),
        ("ENOENT", "open", "{n5}", os.O_RDONLY, 0),
        ("ENOTDIR", "open", "{n0}/{n6}", O_EXCL, 0o644),
        ("EISDIR", "open", "{n1}", os.O_WRONLY, 0),
        ("EISDIR", "open", "{n1}", os.O_RDWR, 0),
        ("0", "open", "{n1}", os.O_RDONLY, 0),
        ("ELOOP", "open", "{n2}", os.O_RDONLY | os.O_NOFOLLOW, 0),
        ("0", "symlink", "{n7}", "{n8}"),
        ("0", "symlink", "{n8}", "{n7}"),
        ("ELOOP", "open", "{n7}", os.O_RDONLY, 0),
        ("0", "open", "{name255}", O_EXCL, 0o644),
        ("0", "unlink", "{name255}"),
        ("ENAMETOOLONG", "open", "{name256}", O_EXCL, 0o644),
        ("0", "makedirs", "{key_parent}"),
        ("0", "open", "{key1024}", O_EXCL, 0o644),
        ("ENAMETOOLONG", "open", "{key1025}", O_EXCL, 0o644),
        ("0", "write", "{n5}", "hello"),
        ("0", "open", "{n5}", os.O_WRONLY | os.O_TRUNC, 0),
        ("", "read", "{n5}"),
        # umask applies to O_CREAT
        ("0", "umask", 0o022),
        ("0", "open", "{n6}", O_EXCL, 0o777),
        ("regular,0755", "lstat", "{n6}", "type,mode"),
        ("0", "umask", 0),
        # permissions of another user
        ("0", "mkdir", "{n9}", 0o755),
        ("0", "open", "{n9}/f600", O_EXCL, 0o600),
        ("0", "open", "{n9}/f644", O_EXCL, 0o644),
        ("EACCES", "open", "{n9}/new", O_EXCL, 0o644, AS_USER),
        ("EACCES", "open", "{n9}/f600", os.O_RDONLY, 0, AS_USER),
        ("EACCES", "open", "{n9}/f644", os.O_WRONLY, 0, AS_USER),
        ("0", "open", "{n9}/f644", os.O_RDONLY, 0, AS_USER),
        ("0", "chmod", "{n9}", 0o700),
        ("EACCES", "open", "{n9}/f644", os.O_RDONLY, 0, AS_USER),  # no search permission
        ("EACCES", "open", "{n1}/mine", O_EXCL, 0o640, AS_USER),  # {n1} is 0755 root's
        ("0", "open", "mine", O_EXCL, 0o640, AS_USER),
        ("regular,0640,65534,65534", "lstat", "mine", "type,mode,uid,gid"),
        REMOUNT,
        ("regular,0644,0,0,0", "lstat", "{n0}", "type,mode,uid,gid,size"),
        ("regular,0640,65534,65534", "lstat", "mine", "type,mode,uid,gid"),
        ("regular,0755", "lstat", "{n6}", "type,mode"),
        ("", "read", "{n5}"),
    ],
    "mkdir": [
        ("0", "chmod", ".", 0o777),
        ("0", "mkdir", "{n0}", 0o755),
        ("dir,0755,0,0", "lstat", "{n0}", "type,mode,uid,gid"),
        ("recent", "times_recent", "{n0}"),
        ("0", "mkdir", "{n1}", 0o700),
        ("dir,0700", "lstat", "{n1}", "type,mode"),
        ("0", "mkdir", "{n2}", 0o1777),
        ("dir,1777", "lstat", "{n2}", "type,mode"),
        ("0", "umask", 0o027),
        ("0", "mkdir", "{n3}", 0o777),
        ("dir,0750", "lstat", "{n3}", "type,mode"),
        ("0", "umask", 0),
        ("EEXIST", "mkdir", "{n0}", 0o755),
        ("0", "write", "{n4}", "x"),
        ("EEXIST", "mkdir", "{n4}", 0o755),
        ("0", "symlink", "{n0}", "{n5}"),
        ("EEXIST", "mkdir", "{n5}", 0o755),
        ("0", "mkfifo", "{n6}", 0o644),
        ("EEXIST", "mkdir", "{n6}", 0o755),
        ("ENOENT", "mkdir", "{n7}/{n8}", 0o755),
        ("ENOTDIR", "mkdir", "{n4}/{n8}", 0o755),
        ("0", "mkdir", "{n0}/{n8}", 0o755),
        ("3", "lstat", "{n0}", "nlink"),  # 2 + one per subdirectory
        ("2", "lstat", "{n1}", "nlink"),
        ("0", "mkdir", "{name255}", 0o755),
        ("ENAMETOOLONG", "mkdir", "{name256}", 0o755),
        ("0", "makedirs", "{key_parent}"),
        ("0", "mkdir", "{key1023}", 0o755),  # its marker's key, with the '/', is 1024 bytes
        ("ENAMETOOLONG", "mkdir", "{key1024}", 0o755),
        ("EACCES", "mkdir", "{n0}/{n9}", 0o755, AS_USER),
        ("0", "mkdir", "{n9}", 0o750, AS_USER),
        ("dir,0750,65534,65534", "lstat", "{n9}", "type,mode,uid,gid"),
        ("0", "chmod", "{n0}", 0o766),  # others may write but not search
        ("EACCES", "mkdir", "{n0}/{n7}", 0o755, AS_USER),
        REMOUNT,
        ("dir,0755,0,0", "lstat", "{n0}/{n8}", "type,mode,uid,gid"),
        ("dir,0766", "lstat", "{n0}", "type,mode"),
        ("dir,0700", "lstat", "{n1}", "type,mode"),
        ("dir,1777", "lstat", "{n2}", "type,mode"),
        ("dir,0750", "lstat", "{n3}", "type,mode"),
        ("dir,0750,65534,65534", "lstat", "{n9}", "type,mode,uid,gid"),
        ("dir", "lstat", "{name255}", "type"),
    ],
    "rmdir": [
        ("0", "chmod", ".", 0o777),
        ("0", "mkdir", "{n0}", 0o755),
        ("0", "rmdir", "{n0}"),
        ("ENOENT", "lstat", "{n0}", "type"),
        ("ENOENT", "rmdir", "{n0}"),
        ("ENOENT", "rmdir", "{n1}/{n2}"),
        ("0", "mkdir", "{n1}", 0o755),
        ("0", "write", "{n1}/file", "x"),
        ("ENOTEMPTY", "rmdir", "{n1}"),
        ("0", "mkdir", "{n2}", 0o755),
        ("0", "mkdir", "{n2}/sub", 0o755),
        ("ENOTEMPTY", "rmdir", "{n2}"),
        ("0", "mkdir", "{n3}", 0o755),
        ("0", "symlink", "x", "{n3}/link"),
        ("ENOTEMPTY", "rmdir", "{n3}"),
        ("0", "mkdir", "{n4}", 0o755),
        ("0", "mkfifo", "{n4}/fifo", 0o644),
        ("ENOTEMPTY", "rmdir", "{n4}"),
        ("ENOTDIR", "rmdir", "{n1}/file"),
        ("ENOTDIR", "rmdir", "{n1}/file/x"),
        ("0", "symlink", "{n2}", "{n5}"),
        ("ENOTDIR", "rmdir", "{n5}"),
        ("EINVAL", "rmdir", "{n2}/sub/."),
        ("ENAMETOOLONG", "rmdir", "{name256}"),
        ("0", "mkdir", "{n6}", 0o755),
        ("0", "mkdir", "{n6}/sub", 0o755),
        ("EACCES", "rmdir", "{n6}/sub", AS_USER),
        ("0", "mkdir", "{n7}", 0o1777),
        ("0", "mkdir", "{n7}/roots", 0o755),
        ("EPERM", "rmdir", "{n7}/roots", AS_USER),  # sticky directory
        ("0", "mkdir", "{n7}/mine", 0o755, AS_USER),
        ("0", "rmdir", "{n7}/mine", AS_USER),
        ("0", "mkdir", "{n8}", 0o755),
        ("0", "mkdir", "{n9}", 0o755),
        ("0", "rmdir", "{n9}"),
        REMOUNT,
        ("ENOENT", "lstat", "{n0}", "type"),
        ("ENOENT", "lstat", "{n9}", "type"),
        ("0", "rmdir", "{n8}"),
        ("ENOENT", "lstat", "{n8}", "type"),
        ("ENOTEMPTY", "rmdir", "{n1}"),
    ],
    "unlink": [
        ("0", "chmod", ".", 0o777),
        ("0", "write", "{n0}", "x"),
        ("0", "unlink", "{n0}"),
        ("ENOENT", "lstat", "{n0}", "type"),
        ("ENOENT", "unlink", "{n0}"),
        ("ENOENT", "unlink", "{n1}/{n2}"),
        ("0", "write", "{n1}", "target"),
        ("0", "symlink", "{n1}", "{n2}"),
        ("0", "unlink", "{n2}"),
        ("ENOENT", "lstat", "{n2}", "type"),
        ("regular", "lstat", "{n1}", "type"),  # the link went, not its target
        ("0", "mkfifo", "{n3}", 0o644),
        ("0", "unlink", "{n3}"),
        ("ENOENT", "lstat", "{n3}", "type"),
        ("0", "mknod", "{n4}", stat.S_IFCHR | 0o644, os.makedev(1, 3)),
        ("0", "unlink", "{n4}"),
        ("0", "mknod", "{n4}", stat.S_IFSOCK | 0o644, 0),
        ("0", "unlink", "{n4}"),
        ("ENOTDIR", "unlink", "{n1}/{n2}"),
        ("0", "mkdir", "{n5}", 0o755),
        ("EISDIR", "unlink", "{n5}"),
        ("ENAMETOOLONG", "unlink", "{name256}"),
        ("0", "write", "{n5}/roots", "x"),
        ("EACCES", "unlink", "{n5}/roots", AS_USER),
        ("0", "mkdir", "{n6}", 0o1777),
        ("0", "write", "{n6}/roots", "x"),
        ("0", "chmod", "{n6}/roots", 0o666),
        ("EPERM", "unlink", "{n6}/roots", AS_USER),  # sticky directory
        ("0", "open", "{n6}/mine", O_EXCL, 0o644, AS_USER),
        ("0", "unlink", "{n6}/mine", AS_USER),
        ("0", "write", "{n7}", "x"),
        ("0", "unlink", "{n7}"),
        ("0", "write", "{n8}", "open while unlinked"),
        ("open while unlinked", "unlink_open_read", "{n8}"),
        ("written, then unlinked", "unlink_open_read", "{n9}", os.O_RDWR | os.O_CREAT),
        ("0", "write", "{n10}", "kept"),
        ("kept, and more|14", "unlink_open_write", "{n10}"),
        ("ENOENT", "lstat", "{n10}", "type"),
        ("ENOENT", "lstat", "{n9}", "type"),
        ("0", "write", "{n11}", "the old one"),
        ("0", "write", "{n0}.new", "the new one"),
        ("the old one|the new one", "rename_over_open_read", "{n0}.new", "{n11}"),
        REMOUNT,
        ("ENOENT", "lstat", "{n10}", "type"),
        ("the new one", "read", "{n11}"),
        ("ENOENT", "lstat", "{n7}", "type"),
        ("ENOENT", "lstat", "{n8}", "type"),
        ("ENOENT", "lstat", "{n9}", "type"),
        ("regular", "lstat", "{n1}", "type"),
    ],
    "link": [
        ("0", "chmod", ".", 0o777),
        ("0", "write", "{n0}", "x"),
        ("EPERM", "link", "{n0}", "{n1}"),  # hard links are refused (documented)
        ("ENOENT", "lstat", "{n1}", "type"),
        ("regular,1", "lstat", "{n0}", "type,nlink"),
        ("0", "write", "{n2}", "y"),
        ("EEXIST", "link", "{n0}", "{n2}"),
        ("ENOENT", "link", "{n3}", "{n4}"),
        ("ENOENT", "link", "{n0}", "{n3}/{n4}"),
        ("ENOTDIR", "link", "{n0}/x", "{n4}"),
        ("ENOTDIR", "link", "{n0}", "{n2}/{n4}"),
        ("0", "mkdir", "{n5}", 0o755),
        ("EPERM", "link", "{n5}", "{n6}"),  # directories: never
        ("ENAMETOOLONG", "link", "{n0}", "{name256}"),
        ("EACCES", "link", "{n0}", "{n5}/{n6}", AS_USER),
    ],
    "symlink": [
        ("0", "chmod", ".", 0o777),
        ("0", "write", "{n0}", "target data"),
        ("0", "symlink", "{n0}", "{n1}"),
        ("symlink,2,0,0", "lstat", "{n1}", "type,size,uid,gid"),  # size: the target's length
        ("regular", "stat", "{n1}", "type"),
        ("target data", "read", "{n1}"),
        ("{n0}", "readlink", "{n1}"),
        ("0", "symlink", "no/such/target", "{n2}"),
        ("ENOENT", "stat", "{n2}", "type"),
        ("symlink", "lstat", "{n2}", "type"),
        ("0", "symlink", "/abs/olute", "{n3}"),
        ("/abs/olute", "readlink", "{n3}"),
        ("0", "symlink", "{long1000}", "{n4}"),
        ("{long1000}", "readlink", "{n4}"),
        ("ENAMETOOLONG", "symlink", "{long4096}", "{n9}"),
        ("EEXIST", "symlink", "x", "{n0}"),
        ("EEXIST", "symlink", "x", "{n1}"),
        ("0", "mkdir", "{n5}", 0o755),
        ("EEXIST", "symlink", "x", "{n5}"),
        ("ENOENT", "symlink", "x", "{n6}/{n7}"),
        ("ENOTDIR", "symlink", "x", "{n0}/{n7}"),
        ("0", "symlink", "x", "{name255}"),
        ("ENAMETOOLONG", "symlink", "x", "{name256}"),
        ("EACCES", "symlink", "x", "{n5}/{n7}", AS_USER),
        ("0", "symlink", "{n5}", "{n6}", AS_USER),
        ("symlink,65534,65534", "lstat", "{n6}", "type,uid,gid"),
        ("dir", "stat", "{n6}", "type"),
        ("0", "write", "{n6}/through", "via link"),  # a path through a symlink to a directory
        ("via link", "read", "{n5}/through"),
        REMOUNT,
        ("symlink,2", "lstat", "{n1}", "type,size"),
        ("{n0}", "readlink", "{n1}"),
        ("target data", "read", "{n1}"),
        ("no/such/target", "readlink", "{n2}"),
        ("/abs/olute", "readlink", "{n3}"),
        ("{long1000}", "readlink", "{n4}"),
        ("symlink,65534,65534", "lstat", "{n6}", "type,uid,gid"),
        ("x", "readlink", "{name255}"),
    ],
    "readlink": [
        ("0", "chmod", ".", 0o777),
        ("0", "symlink", "some/target", "{n0}"),
        ("some/target", "readlink", "{n0}"),
        ("some/target", "readlink", "{n0}", AS_USER),
        ("ENOENT", "readlink", "{n1}"),
        ("0", "write", "{n1}", "x"),
        ("EINVAL", "readlink", "{n1}"),
        ("0", "mkdir", "{n2}", 0o700),
        ("EINVAL", "readlink", "{n2}"),
        ("ENOTDIR", "readlink", "{n1}/x"),
        ("ENAMETOOLONG", "readlink", "{name256}"),
        ("0", "symlink", "inside", "{n2}/link"),
        ("inside", "readlink", "{n2}/link"),
        ("EACCES", "readlink", "{n2}/link", AS_USER),  # {n2} is 0700
        ("0", "mkfifo", "{n3}", 0o644),
        ("EINVAL", "readlink", "{n3}"),
        REMOUNT,
        ("some/target", "readlink", "{n0}"),
        ("inside", "readlink", "{n2}/link"),
    ],
    "rename": [  # of files, symlinks and special files
        ("0", "chmod", ".", 0o777),
        ("0", "write", "{n0}", "data0"),
        ("0", "chmod", "{n0}", 0o640),
        ("0", "chown", "{n0}", 65534, 65534),
        ("0", "utimens", "{n0}", T2, T1),
        ("0", "rename", "{n0}", "{n1}"),
        ("ENOENT", "lstat", "{n0}", "type"),
        ("regular,0640,65534,65534,5", "lstat", "{n1}", "type,mode,uid,gid,size"),
        ("1577934245.250000000", "lstat", "{n1}", "mtime"),  # a rename changes only ctime
        ("data0", "read", "{n1}"),
        ("0", "write", "{n2}", "data2, longer"),
        ("0", "rename", "{n1}", "{n2}"),  # replaces
        ("ENOENT", "lstat", "{n1}", "type"),
        ("data0", "read", "{n2}"),
        ("0", "rename", "{n2}", "{n2}"),  # onto itself: nothing happens
        ("data0", "read", "{n2}"),
        ("0", "mkdir", "{n3}", 0o755),
        ("0", "rename", "{n2}", "{n3}/{n4}"),  # into a subdirectory
        ("data0", "read", "{n3}/{n4}"),
        ("0", "rename", "{n3}/{n4}", "{n2}"),  # and back
        ("EISDIR", "rename", "{n2}", "{n3}"),
        ("ENOTDIR", "rename", "{n3}", "{n2}"),
        ("ENOENT", "rename", "{n5}", "{n6}"),
        ("ENOENT", "rename", "{n2}", "{n5}/{n6}"),
        ("ENOTDIR", "rename", "{n2}/x", "{n6}"),
        ("ENOTDIR", "rename", "{n2}", "{n2}/x"),
        ("ENAMETOOLONG", "rename", "{n2}", "{name256}"),
        ("0", "rename", "{n2}", "{name255}"),
        ("0", "rename", "{name255}", "{n2}"),
        ("0", "symlink", "{n2}", "{n5}"),
        ("0", "rename", "{n5}", "{n6}"),
        ("{n2}", "readlink", "{n6}"),
        ("symlink", "lstat", "{n6}", "type"),
        ("regular", "lstat", "{n2}", "type"),  # the target stays where it is
        ("0", "mkfifo", "{n7}", 0o604),
        ("0", "rename", "{n7}", "{n8}"),
        ("fifo,0604", "lstat", "{n8}", "type,mode"),
        ("0", "write", "{n5}", "x"),
        ("EEXIST", "renameat2", "{n5}", "{n2}", RENAME_NOREPLACE),
        ("0", "renameat2", "{n5}", "{n7}", RENAME_NOREPLACE),
        # another user
        ("0", "write", "{n3}/roots", "x"),
        ("EACCES", "rename", "{n3}/roots", "stolen", AS_USER),  # {n3} is 0755
        ("0", "open", "mine", O_EXCL, 0o644, AS_USER),
        ("EACCES", "rename", "mine", "{n3}/mine", AS_USER),
        ("0", "mkdir", "{n9}", 0o1777),
        ("0", "write", "{n9}/roots", "x"),
        ("EPERM", "rename", "{n9}/roots", "{n9}/moved", AS_USER),  # sticky directory
        ("0", "rename", "mine", "{n9}/mine", AS_USER),
        ("0", "rename", "{n9}/mine", "mine", AS_USER),
        REMOUNT,
        ("regular,0640,65534,65534,5", "lstat", "{n2}", "type,mode,uid,gid,size"),
        ("1577934245.250000000", "lstat", "{n2}", "mtime"),
        ("ENOENT", "lstat", "{n0}", "type"),
        ("ENOENT", "lstat", "{n1}", "type"),
        ("{n2}", "readlink", "{n6}"),
        ("fifo,0604", "lstat", "{n8}", "type,mode"),
        ("regular", "lstat", "{n7}", "type"),
        ("regular,65534", "lstat", "mine", "type,uid"),
    ],
    "rename_dir": [
        ("0", "chmod", ".", 0o777),
        ("0", "mkdir", "{n0}", 0o750),
        ("0", "chown", "{n0}", 65534, 65534),
        ("0", "write", "{n0}/a", "a"),
        ("0", "mkdir", "{n0}/sub", 0o700),
        ("0", "write", "{n0}/sub/b", "b"),
        ("0", "mkdir", "{n0}/empty", 0o755),
        ("0", "symlink", "../a", "{n0}/sub/link"),
        ("0", "mkfifo", "{n0}/fifo", 0o600),
        ("0", "rename", "{n0}", "{n1}"),
        ("ENOENT", "lstat", "{n0}", "type"),
        ("dir,0750,65534,65534", "lstat", "{n1}", "type,mode,uid,gid"),
        ("a", "read", "{n1}/a"),
        ("b", "read", "{n1}/sub/b"),
        ("dir,0700", "lstat", "{n1}/sub", "type,mode"),
        ("dir", "lstat", "{n1}/empty", "type"),
        ("../a", "readlink", "{n1}/sub/link"),
        ("a", "read", "{n1}/sub/link"),
        ("fifo,0600", "lstat", "{n1}/fifo", "type,mode"),
        ("a,empty,fifo,sub", "listdir", "{n1}"),
        ("0", "mkdir", "{n2}", 0o755),  # onto an empty directory: replaces it
        ("0", "rename", "{n1}", "{n2}"),
        ("a,empty,fifo,sub", "listdir", "{n2}"),
        ("0", "mkdir", "{n3}", 0o755),
        ("0", "write", "{n3}/x", "x"),
        ("ENOTEMPTY", "rename", "{n2}", "{n3}"),  # onto a non-empty one
        ("x", "listdir", "{n3}"),
        ("a,empty,fifo,sub", "listdir", "{n2}"),
        ("EINVAL", "rename", "{n2}", "{n2}/sub/{n4}"),  # into itself
        ("0", "write", "{n4}", "file"),
        ("ENOTDIR", "rename", "{n2}", "{n4}"),
        ("EISDIR", "rename", "{n4}", "{n2}"),
        ("0", "rename", "{n2}/empty", "{n5}"),  # a directory with only its marker
        ("dir", "lstat", "{n5}", "type"),
        ("0", "rename", "{n5}", "{n3}/{n5}"),  # into another directory
        ("0", "rename", "{n2}", "{n2}"),
        ("ENAMETOOLONG", "rename", "{n2}", "{name256}"),
        ("0", "rename", "{n2}", "{name255}"),
        ("0", "rename", "{name255}", "{n2}"),
        ("0", "mkdir", "{n6}", 0o755),
        ("0", "mkdir", "{n6}/sub", 0o755),
        ("EACCES", "rename", "{n6}/sub", "{n6}/moved", AS_USER),
        ("EACCES", "rename", "{n6}/sub", "{n9}", AS_USER),
        ("0", "mkdir", "{n8}", 0o1777),
        ("0", "mkdir", "{n8}/roots", 0o777),
        ("EPERM", "rename", "{n8}/roots", "{n8}/moved", AS_USER),  # sticky directory
        ("0", "rename", "{n2}", "{n9}", AS_USER),  # {n2} is 0755 root's, in a 0777 directory
        ("0", "rename", "{n9}", "{n2}", AS_USER),
        ("0", "mkdir", "{n7}", 0o777),
        ("0", "mkdir", "{n7}/roots", 0o755),
        # to another parent its '..' changes: that needs write permission on the directory too
        ("EACCES", "rename", "{n7}/roots", "roots", AS_USER),
        ("0", "chmod", "{n7}/roots", 0o757),
        ("0", "rename", "{n7}/roots", "roots", AS_USER),
        ("0", "chown_rename_sweep", 18, 70, 2),  # chown + chmod, 70..104 ms, rename
        ("kept", "sweep_kept", 18),
        REMOUNT,
        ("kept", "sweep_kept", 18),
        ("ENOENT", "lstat", "{n0}", "type"),
        ("ENOENT", "lstat", "{n1}", "type"),
        ("a,fifo,sub", "listdir", "{n2}"),
        ("dir,0750,65534,65534", "lstat", "{n2}", "type,mode,uid,gid"),
        ("b", "read", "{n2}/sub/b"),
        ("dir,0700", "lstat", "{n2}/sub", "type,mode"),
        ("../a", "readlink", "{n2}/sub/link"),
        ("fifo,0600", "lstat", "{n2}/fifo", "type,mode"),
        ("{n5},x", "listdir", "{n3}"),
    ],
    "chmod": [
        ("0", "chmod", ".", 0o777),
        ("0", "write", "{n0}", "x"),
        ("0", "chmod", "{n0}", 0o600),
        ("regular,0600", "lstat", "{n0}", "type,mode"),
        ("0", "chmod", "{n0}", 0o4751),
        ("0o4751", "lstat", "{n0}", "mode"),
        ("0", "chmod", "{n0}", 0o2700),
        ("0o2700", "lstat", "{n0}", "mode"),
        ("0", "chmod", "{n0}", 0o7777),
        ("0o7777", "lstat", "{n0}", "mode"),
        ("0", "chmod", "{n0}", 0),
        ("0o0", "lstat", "{n0}", "mode"),
        ("0", "mkdir", "{n1}", 0o755),
        ("0", "chmod", "{n1}", 0o1700),
        ("dir,1700", "lstat", "{n1}", "type,mode"),
        ("0", "write", "{n2}", "x"),
        ("0", "symlink", "{n2}", "{n3}"),
        ("0", "chmod", "{n3}", 0o604),  # follows the symlink
        ("regular,0604", "lstat", "{n2}", "type,mode"),
        ("symlink,0777", "lstat", "{n3}", "type,mode"),
        ("0", "mkfifo", "{n4}", 0o644),
        ("0", "chmod", "{n4}", 0o620),
        ("fifo,0620", "lstat", "{n4}", "type,mode"),
        ("ENOENT", "chmod", "{n5}", 0o644),
        ("ENOENT", "chmod", "{n5}/{n6}", 0o644),
        ("ENOTDIR", "chmod", "{n2}/{n6}", 0o644),
        ("ENAMETOOLONG", "chmod", "{name256}", 0o644),
        ("EPERM", "chmod", "{n2}", 0o777, AS_USER),
        ("regular,0604", "lstat", "{n2}", "type,mode"),
        ("0", "open", "{n5}", O_EXCL, 0o644, AS_USER),
        ("0", "chmod", "{n5}", 0o4700, AS_USER),
        ("0o4700", "lstat", "{n5}", "mode"),
        ("0", "chown", "{n5}", 65534, 0),
        ("0", "chmod", "{n5}", 0o2755, AS_USER),  # not in group 0: S_ISGID is dropped
        ("0o755", "lstat", "{n5}", "mode"),
        ("0", "mkdir", "{n6}", 0o700),
        ("0", "write", "{n6}/f", "x"),
        ("EACCES", "chmod", "{n6}/f", 0o777, AS_USER),  # no search permission on {n6}
        # A write or an O_TRUNC open without CAP_FSETID clears S_ISUID, and S_ISGID if the
        # group may execute (issue 40.6); root's keep them.
        ("0", "write", "{n8}", "x"),
        ("0", "chmod", "{n8}", 0o6777),
        ("0", "append", "{n8}", "y"),
        ("0o6777", "lstat", "{n8}", "mode"),
        ("0", "append", "{n8}", "z", AS_USER),
        ("0o777", "lstat", "{n8}", "mode"),
        ("xyz", "read", "{n8}"),
        ("0", "chmod", "{n8}", 0o6777),
        ("0", "open", "{n8}", os.O_WRONLY | os.O_TRUNC, 0, AS_USER),
        ("0o777", "lstat", "{n8}", "mode"),
        ("0", "chmod", "{n8}", 0o6767),  # S_ISGID without group execute stays
        ("0", "append", "{n8}", "w", AS_USER),
        ("0o2767", "lstat", "{n8}", "mode"),
        REMOUNT,
        ("0o2767", "lstat", "{n8}", "mode"),
        ("0o0", "lstat", "{n0}", "mode"),
        ("dir,1700", "lstat", "{n1}", "type,mode"),
        ("regular,0604", "lstat", "{n2}", "type,mode"),
        ("fifo,0620", "lstat", "{n4}", "type,mode"),
        ("regular,0755,65534,0", "lstat", "{n5}", "type,mode,uid,gid"),
    ],
    "chown": [
        ("0", "chmod", ".", 0o777),
        ("0", "write", "{n0}", "x"),
        ("0", "chown", "{n0}", 65534, 65533),
        ("65534,65533", "lstat", "{n0}", "uid,gid"),
        ("0", "chown", "{n0}", -1, 123),
        ("65534,123", "lstat", "{n0}", "uid,gid"),
        ("0", "chown", "{n0}", 456, -1),
        ("456,123", "lstat", "{n0}", "uid,gid"),
        ("0", "chown", "{n0}", -1, -1),
        ("456,123", "lstat", "{n0}", "uid,gid"),
        ("0", "mkdir", "{n1}", 0o755),
        ("0", "chown", "{n1}", 65534, 65534),
        ("dir,65534,65534", "lstat", "{n1}", "type,uid,gid"),
        ("0", "write", "{n2}", "x"),
        ("0", "symlink", "{n2}", "{n3}"),
        ("0", "chown", "{n3}", 777, 778),  # follows the symlink
        ("777,778", "lstat", "{n2}", "uid,gid"),
        ("0,0", "lstat", "{n3}", "uid,gid"),
        ("0", "lchown", "{n3}", 779, 780),  # the link itself
        ("779,780", "lstat", "{n3}", "uid,gid"),
        ("777,778", "lstat", "{n2}", "uid,gid"),
        ("0", "mkfifo", "{n4}", 0o644),
        ("0", "chown", "{n4}", 12, 13),
        ("fifo,12,13", "lstat", "{n4}", "type,uid,gid"),
        ("0", "write", "{n5}", "x"),
        ("0", "chmod", "{n5}", 0o6755),
        ("0", "chown", "{n5}", 1000, 1000),  # clears S_ISUID and S_ISGID, even for root
        ("0o755,1000,1000", "lstat", "{n5}", "mode,uid,gid"),
        ("0", "chmod", "{n1}", 0o6755),
        ("0", "chown", "{n1}", 1001, 1001),  # ... but not on a directory
        ("0o6755,1001,1001", "lstat", "{n1}", "mode,uid,gid"),
        ("ENOENT", "chown", "{n6}", 0, 0),
        ("ENOENT", "chown", "{n6}/{n7}", 0, 0),
        ("ENOTDIR", "chown", "{n2}/{n7}", 0, 0),
        ("ENAMETOOLONG", "chown", "{name256}", 0, 0),
        # another user
        ("EPERM", "chown", "{n2}", 65534, 65534, AS_USER),
        ("0", "open", "{n6}", O_EXCL, 0o644, AS_USER),
        ("EPERM", "chown", "{n6}", 0, -1, AS_USER),  # give it away
        ("EPERM", "chown", "{n6}", -1, 0, AS_USER),  # a group it is not in
        ("0", "chown", "{n6}", 65534, 65534, AS_USER),  # to itself: allowed
        ("0", "chown", "{n6}", -1, -1, AS_USER),
        ("65534,65534", "lstat", "{n6}", "uid,gid"),
        REMOUNT,
        ("456,123", "lstat", "{n0}", "uid,gid"),
        ("dir,6755,1001,1001", "lstat", "{n1}", "type,mode,uid,gid"),
        ("777,778", "lstat", "{n2}", "uid,gid"),
        ("symlink,779,780", "lstat", "{n3}", "type,uid,gid"),
        ("fifo,12,13", "lstat", "{n4}", "type,uid,gid"),
        ("0o755,1000,1000", "lstat", "{n5}", "mode,uid,gid"),
    ],
    "utimensat": [
        ("0", "chmod", ".", 0o777),
        ("0", "write", "{n0}", "x"),
        ("0", "utimens", "{n0}", T2, T1),
        ("1577934245.250000000", "lstat", "{n0}", "mtime"),
        ("1262304000.000000001", "lstat", "{n0}", "atime"),
        ("0", "utimens", "{n0}", UTIME_OMIT, T2),
        ("1262304000.000000001", "lstat", "{n0}", "mtime"),
        ("0", "utimens", "{n0}", T1, UTIME_OMIT),
        ("1262304000.000000001", "lstat", "{n0}", "mtime"),  # UTIME_OMIT: left alone
        ("1577934245.250000000", "lstat", "{n0}", "atime"),
        ("0", "utimens", "{n0}", UTIME_NOW, UTIME_NOW),
        ("recent", "times_recent", "{n0}"),
        ("0", "utimens", "{n0}", 0, 0),
        ("0.000000000", "lstat", "{n0}", "mtime"),
        ("0", "utimens", "{n0}", None, None),  # utimes(path, NULL): now
        ("recent", "times_recent", "{n0}"),
        ("0", "mkdir", "{n1}", 0o755),
        ("0", "utimens", "{n1}", T1, T1),
        ("1577934245.250000000", "lstat", "{n1}", "mtime"),
        ("0", "write", "{n2}", "x"),
        ("0", "utimens", "{n2}", T1, T1),
        ("0", "symlink", "{n2}", "{n3}"),
        ("0", "utimens", "{n3}", T2, T2, AT_SYMLINK_NOFOLLOW),  # the link itself
        ("1262304000.000000001", "lstat", "{n3}", "mtime"),
        ("1577934245.250000000", "lstat", "{n2}", "mtime"),
        ("0", "utimens", "{n3}", T2, T2),  # follows
        ("1262304000.000000001", "lstat", "{n2}", "mtime"),
        ("0", "mkfifo", "{n4}", 0o644),
        ("0", "utimens", "{n4}", T1, T1),
        ("fifo,1577934245.250000000", "lstat", "{n4}", "type,mtime"),
        ("EINVAL", "utimens", "{n0}", 0, 1_000_000_000, "raw"),  # tv_nsec out of range
        ("ENOENT", "utimens", "{n5}", T1, T1),
        ("ENOTDIR", "utimens", "{n0}/{n5}", T1, T1),
        ("ENAMETOOLONG", "utimens", "{name256}", T1, T1),
        # another user: setting times needs ownership; setting them to now, write permission
        ("0", "write", "{n6}", "x"),
        ("0", "chmod", "{n6}", 0o644),
        ("EPERM", "utimens", "{n6}", T1, T1, AS_USER),
        ("EACCES", "utimens", "{n6}", UTIME_NOW, UTIME_NOW, AS_USER),
        ("EACCES", "utimens", "{n6}", None, None, AS_USER),
        ("0", "chmod", "{n6}", 0o666),
        ("EPERM", "utimens", "{n6}", T1, T1, AS_USER),
        ("0", "utimens", "{n6}", UTIME_NOW, UTIME_NOW, AS_USER),
        ("0", "open", "{n7}", O_EXCL, 0o600, AS_USER),
        ("0", "utimens", "{n7}", T1, T2, AS_USER),
        ("1262304000.000000001", "lstat", "{n7}", "mtime"),
        ("0", "utimens", "{n0}", T1, T2),
        REMOUNT,
        ("1262304000.000000001", "lstat", "{n0}", "mtime"),
        ("1577934245.250000000", "lstat", "{n0}", "atime"),
        ("1577934245.250000000", "lstat", "{n1}", "mtime"),
        ("1262304000.000000001", "lstat", "{n2}", "mtime"),
        ("1262304000.000000001", "lstat", "{n3}", "mtime"),
        ("fifo,1577934245.250000000", "lstat", "{n4}", "type,mtime"),
        ("1262304000.000000001", "lstat", "{n7}", "mtime"),
    ],
    "mkfifo": [
        ("0", "chmod", ".", 0o777),
        ("0", "mkfifo", "{n0}", 0o640),
        ("fifo,0640,0,0,0", "lstat", "{n0}", "type,mode,uid,gid,size"),
        ("recent", "times_recent", "{n0}"),
        ("0", "open", "{n0}", os.O_RDONLY | os.O_NONBLOCK, 0),  # a pipe: a reader opens at once
        ("ENXIO", "open", "{n0}", os.O_WRONLY | os.O_NONBLOCK, 0),  # ... a writer needs one
        ("fifo-roundtrip", "fifo_roundtrip", "{n0}"),
        ("0", "umask", 0o077),
        ("0", "mkfifo", "{n1}", 0o666),
        ("fifo,0600", "lstat", "{n1}", "type,mode"),
        ("0", "umask", 0),
        ("EEXIST", "mkfifo", "{n0}", 0o644),
        ("0", "write", "{n2}", "x"),
        ("EEXIST", "mkfifo", "{n2}", 0o644),
        ("0", "mkdir", "{n3}", 0o755),
        ("EEXIST", "mkfifo", "{n3}", 0o644),
        ("0", "symlink", "nowhere", "{n4}"),
        ("EEXIST", "mkfifo", "{n4}", 0o644),
        ("ENOENT", "mkfifo", "{n5}/{n6}", 0o644),
        ("ENOTDIR", "mkfifo", "{n2}/{n6}", 0o644),
        ("0", "mkfifo", "{name255}", 0o644),
        ("ENAMETOOLONG", "mkfifo", "{name256}", 0o644),
        ("EACCES", "mkfifo", "{n3}/{n6}", 0o644, AS_USER),
        ("0", "mkfifo", "{n6}", 0o604, AS_USER),
        ("fifo,0604,65534,65534", "lstat", "{n6}", "type,mode,uid,gid"),
        REMOUNT,
        ("fifo,0640,0,0,0", "lstat", "{n0}", "type,mode,uid,gid,size"),
        ("fifo,0600", "lstat", "{n1}", "type,mode"),
        ("fifo,0604,65534,65534", "lstat", "{n6}", "type,mode,uid,gid"),
        ("fifo-roundtrip", "fifo_roundtrip", "{n0}"),
    ],
    "mknod": [
        ("0", "chmod", ".", 0o777),
        ("0", "mknod", "{n0}", stat.S_IFIFO | 0o644, 0),
        ("fifo,0644", "lstat", "{n0}", "type,mode"),
        ("0", "mknod", "{n1}", stat.S_IFCHR | 0o600, os.makedev(1, 3)),
        ("char,0600,0,0", "lstat", "{n1}", "type,mode,uid,gid"),
        ("1,3", "lstat", "{n1}", "rdev"),
        ("0", "mknod", "{n2}", stat.S_IFBLK | 0o640, os.makedev(7, 0)),
        ("block,0640", "lstat", "{n2}", "type,mode"),
        ("7,0", "lstat", "{n2}", "rdev"),
        ("0", "mknod", "{n3}", stat.S_IFSOCK | 0o755, 0),
        ("socket,0755", "lstat", "{n3}", "type,mode"),
        ("0", "mknod", "{n4}", stat.S_IFREG | 0o640, 0),
        ("regular,0640,0", "lstat", "{n4}", "type,mode,size"),
        ("0", "mknod", "{n5}", 0o640, 0),  # no type: a regular file
        ("regular,0640", "lstat", "{n5}", "type,mode"),
        ("ENXIO", "open", "{n3}", os.O_RDONLY, 0),  # a socket cannot be opened
        ("EACCES", "open", "{n1}", os.O_RDONLY, 0),  # the mount is nodev
        ("EPERM", "mknod", "{n6}", stat.S_IFDIR | 0o755, 0),
        ("EINVAL", "mknod", "{n6}", 0o170000 | 0o644, 0),
        ("EEXIST", "mknod", "{n0}", stat.S_IFIFO | 0o644, 0),
        ("EEXIST", "mknod", "{n4}", stat.S_IFCHR | 0o644, os.makedev(1, 3)),
        ("ENOENT", "mknod", "{n6}/{n7}", stat.S_IFIFO | 0o644, 0),
        ("ENOTDIR", "mknod", "{n4}/{n7}", stat.S_IFIFO | 0o644, 0),
        ("ENAMETOOLONG", "mknod", "{name256}", stat.S_IFIFO | 0o644, 0),
        ("0", "mkdir", "{n8}", 0o755),
        ("EACCES", "mknod", "{n8}/{n7}", stat.S_IFIFO | 0o644, 0, AS_USER),
        ("EPERM", "mknod", "{n7}", stat.S_IFCHR | 0o644, os.makedev(1, 3), AS_USER),  # CAP_MKNOD
        ("0", "mknod", "{n7}", stat.S_IFIFO | 0o644, 0, AS_USER),
        ("fifo,65534,65534", "lstat", "{n7}", "type,uid,gid"),
        REMOUNT,
        ("fifo,0644", "lstat", "{n0}", "type,mode"),
        ("char,0600,0,0", "lstat", "{n1}", "type,mode,uid,gid"),
        ("1,3", "lstat", "{n1}", "rdev"),
        ("block,0640", "lstat", "{n2}", "type,mode"),
        ("7,0", "lstat", "{n2}", "rdev"),
        ("socket,0755", "lstat", "{n3}", "type,mode"),
        ("regular,0640,0", "lstat", "{n4}", "type,mode,size"),
        ("fifo,65534,65534", "lstat", "{n7}", "type,uid,gid"),
    ],
    "truncate": [
        ("0", "chmod", ".", 0o777),
        ("0", "write", "{n0}", "0123456789"),
        ("0", "truncate", "{n0}", 4),
        ("regular,4", "lstat", "{n0}", "type,size"),
        ("0123", "read", "{n0}"),
        ("0", "truncate", "{n0}", 8),
        ("0123\0\0\0\0", "read", "{n0}"),
        ("0", "truncate", "{n0}", 0),
        ("", "read", "{n0}"),
        ("0", "truncate", "{n0}", 20_000_000),  # larger than a part
        ("20000000", "lstat", "{n0}", "size"),
        ("0", "truncate", "{n0}", 3),
        ("\0\0\0", "read", "{n0}"),
        ("0", "write", "{n1}", "abc"),
        ("0", "utimens", "{n1}", T2, T2),
        ("0", "truncate", "{n1}", 1),
        ("recent", "mtime_recent", "{n1}"),  # a size change sets mtime
        ("0", "write", "{n2}", "data"),
        ("0", "symlink", "{n2}", "{n3}"),
        ("0", "truncate", "{n3}", 2),  # follows
        ("da", "read", "{n2}"),
        ("EINVAL", "truncate", "{n2}", -1),
        ("0", "mkdir", "{n4}", 0o755),
        ("EISDIR", "truncate", "{n4}", 0),
        ("0", "mkfifo", "{n5}", 0o666),
        ("EINVAL", "truncate", "{n5}", 0),
        ("ENOENT", "truncate", "{n6}", 0),
        ("ENOENT", "truncate", "{n6}/{n7}", 0),
        ("ENOTDIR", "truncate", "{n2}/{n7}", 0),
        ("ENAMETOOLONG", "truncate", "{name256}", 0),
        ("0", "write", "{n6}", "roots"),
        ("0", "chmod", "{n6}", 0o644),
        ("EACCES", "truncate", "{n6}", 0, AS_USER),
        ("0", "chmod", "{n6}", 0o666),
        ("0", "truncate", "{n6}", 2, AS_USER),
        ("ro", "read", "{n6}"),
        ("0", "write", "{n7}", "abcdef"),
        ("0", "ftruncate", "{n7}", 3),
        ("abc", "read", "{n7}"),
        ("0", "write", "{n8}", "old"),
        ("0", "utimens", "{n8}", T2, T2),
        ("0", "write", "{n8}", "new"),
        ("recent", "mtime_recent", "{n8}"),  # so does a write
        REMOUNT,
        ("regular,3", "lstat", "{n0}", "type,size"),
        ("\0\0\0", "read", "{n0}"),
        ("da", "read", "{n2}"),
        ("ro", "read", "{n6}"),
        ("abc", "read", "{n7}"),
    ],
    "ctime": [  # what changes st_ctime (one shared 1.1 s wait)
        ("0", "write", "{n0}", "x"),
        ("0", "write", "{n1}", "x"),
        ("0", "write", "{n2}", "x"),
        ("0", "write", "{n3}", "x"),
        ("0", "write", "{n4}", "x"),
        ("0", "mkdir", "{n5}", 0o755),
        ("0", "mkdir", "{n9}", 0o755),
        ("0", "write", "{n9}/f", "x"),
        ("0", "save_times", "{n9}"),
        ("0", "write", "{n7}", "x"),
        ("0", "write", "{n8}", "x"),
        ("0", "save_times", "{n7}"),
        ("0", "save_times", "{n8}"),
        ("0", "save_times", "{n0}"),
        ("0", "save_times", "{n1}"),
        ("0", "save_times", "{n2}"),
        ("0", "save_times", "{n3}"),
        ("0", "save_times", "{n4}"),
        ("0", "save_times", "{n5}"),
        ("0", "sleep", 1.1),
        ("0", "chmod", "{n0}", 0o600),
        ("0", "chown", "{n1}", 5, 5),
        ("0", "utimens", "{n2}", T1, T1),
        ("0", "truncate", "{n3}", 0),
        ("0", "rename", "{n4}", "{n6}"),
        ("0", "mkdir", "{n5}/sub", 0o755),
        ("0", "unlink", "{n9}/f"),
        ("0", "write", "{n7}", "y"),
        ("0", "ftruncate", "{n8}", 0),
        ("ctime+,mtime+", "times_changed", "{n7}"),
        ("ctime+,mtime+", "times_changed", "{n8}"),
        ("ctime+", "times_changed", "{n0}"),
        ("ctime+", "times_changed", "{n1}"),
        ("ctime+,mtime-", "times_changed", "{n2}"),
        ("ctime+,mtime+", "times_changed", "{n3}"),
        ("ctime+", "times_changed", "{n6}", "{n4}"),  # rename changes the ctime (40.4)
        ("ctime+,mtime+", "times_changed", "{n5}"),  # a new entry changes its directory
        ("ctime+,mtime+", "times_changed", "{n9}"),  # ... and so does an unlink
    ],
}

# ---------------------------------------------------------------------------------------------
# The operations. Each returns a string ("0" for success without a value) or raises OSError.
# ---------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _check(ret):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return "0"


def op_utimens(path, atime, mtime, flags=0, raw=None):
    if flags == "raw":
        flags, raw = 0, True
    if atime is None and mtime is None:
        return _check(_libc.utimensat(AT_FDCWD, os.fsencode(path), None, flags))
    ts = (_Timespec * 2)()
    for i, t in enumerate((atime, mtime)):
        if raw or t in (UTIME_NOW, UTIME_OMIT):
            ts[i].tv_sec, ts[i].tv_nsec = 0, t
        else:
            ts[i].tv_sec, ts[i].tv_nsec = divmod(t, 1_000_000_000)
    return _check(_libc.utimensat(AT_FDCWD, os.fsencode(path), ts, flags))


def op_renameat2(src, dst, flags):
    return _check(_libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags))


TYPES = [(stat.S_ISREG, "regular"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"),
         (stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "char"), (stat.S_ISBLK, "block"),
         (stat.S_ISSOCK, "socket")]


def _ts(ns):
    return "%d.%09d" % divmod(ns, 1_000_000_000)


def _fields(st, fields):
    out = []
    for f in fields.split(","):
        if f == "type":
            out.append(next(name for test, name in TYPES if test(st.st_mode)))
        elif f == "mode":  # with "type" 4 digits, alone 0o-prefixed (as pjdfstest prints it)
            m = stat.S_IMODE(st.st_mode)
            out.append("%04o" % m if "type" in fields else oct(m))
        elif f in ("uid", "gid", "size", "nlink"):
            out.append(str(getattr(st, "st_" + f)))
        elif f in ("mtime", "atime", "ctime"):
            out.append(_ts(getattr(st, "st_%s_ns" % f)))
        elif f == "rdev":
            out.append("%d,%d" % (os.major(st.st_rdev), os.minor(st.st_rdev)))
        else:
            raise ValueError("unknown field " + f)
    return ",".join(out)


def op_open(path, flags, mode):
    os.close(os.open(path, flags, mode))
    return "0"


def op_write(path, data):
    with open(path, "wb") as f:
        f.write(data.encode("latin-1"))
    return "0"


def op_append(path, data):
    with open(path, "ab") as f:
        f.write(data.encode("latin-1"))
    return "0"


def op_read(path):
    with open(path, "rb") as f:
        return f.read().decode("latin-1")


def op_ftruncate(path, size):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return "0"


def op_unlink_open_read(path, flags=os.O_RDONLY):
    """Unlinks a file while it is open, waits 0.3 s, then reads through the descriptor."""
    fd = os.open(path, flags, 0o644)
    try:
        if flags & os.O_CREAT:
            os.write(fd, b"written, then unlinked")
        os.unlink(path)
        time.sleep(0.3)
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 1 << 16).decode("latin-1")
    finally:
        os.close(fd)


def op_unlink_open_write(path):
    """Opens a file read-write, unlinks it, waits 0.3 s, appends through the descriptor,
    then reads it back whole: content|size as fstat says."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.unlink(path)
        time.sleep(0.3)
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, b", and more")
        os.lseek(fd, 0, os.SEEK_SET)
        return "%s|%d" % (os.read(fd, 1 << 16).decode("latin-1"), os.fstat(fd).st_size)
    finally:
        os.close(fd)


def op_rename_over_open_read(src, dst):
    """Renames src onto dst while dst is open for reading, waits 0.3 s, then reads through
    the descriptor (the replaced file) and by name (the new one)."""
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.rename(src, dst)
        time.sleep(0.3)
        with open(dst, "rb") as f:
            new = f.read().decode("latin-1")
        return "%s|%s" % (os.read(fd, 1 << 16).decode("latin-1"), new)
    finally:
        os.close(fd)


def op_fifo_roundtrip(path):
    r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        w = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(w, b"fifo-roundtrip")
        finally:
            os.close(w)
        return os.read(r, 100).decode()
    finally:
        os.close(r)


def _recent(ns, window=10):
    return abs(ns / 1e9 - time.time()) < window


def op_times_recent(path):
    st = os.lstat(path)
    ok = all(_recent(getattr(st, "st_%s_ns" % f)) for f in ("mtime", "ctime"))
    return "recent" if ok else "mtime %s ctime %s, now %.3f" % (
        _ts(st.st_mtime_ns), _ts(st.st_ctime_ns), time.time())


def op_mtime_recent(path):
    st = os.lstat(path)
    return "recent" if _recent(st.st_mtime_ns) else "mtime %s, now %.3f" % (
        _ts(st.st_mtime_ns), time.time())


_saved = {}


def op_save_times(path):
    _saved[path] = os.lstat(path)
    return "0"


def op_times_changed(path, saved_as=None):
    before = _saved[saved_as or path]
    now = os.lstat(path)
    out = []
    for f in ("ctime", "mtime"):
        a, b = getattr(before, "st_%s_ns" % f), getattr(now, "st_%s_ns" % f)
        if b > a:
            out.append(f + "+")
        elif b < a:
            out.append(f + "-")
    return ",".join(out) or "unchanged"


def op_chown_rename_sweep(count, start_ms, step_ms):
    """chown + chmod, then a directory rename after a delay that sweeps a range: s3csi saves
    metadata changes ~100 ms after they are made, and a rename must not lose one whose save
    falls due while the directory is being copied."""
    for i in range(count):
        d = "sweep%d" % i
        os.mkdir(d, 0o750)
        with open(d + "/f", "w") as f:
            f.write("x")
        os.chown(d, 65534, 65534)
        os.chmod(d + "/f", 0o600)
        time.sleep((start_ms + i * step_ms) / 1000)
        os.rename(d, "swept%d" % i)
    return "0"


def op_sweep_kept(count):
    lost = [i for i in range(count)
            if (os.lstat("swept%d" % i).st_uid, stat.S_IMODE(os.lstat("swept%d/f" % i).st_mode))
            != (65534, 0o600)]
    return "kept" if not lost else "lost after a delay of: %s" % lost


def op_umask(mask):
    os.umask(mask)
    return "0"


def op_sleep(secs):
    time.sleep(secs)
    return "0"


def _wrap(fn, value=None):
    def run(*args):
        r = fn(*args)
        return value if value is not None else ("0" if r is None else r)
    return run


OPS = {
    "open": op_open,
    "write": op_write,
    "append": op_append,
    "read": op_read,
    "mkdir": _wrap(os.mkdir, "0"),
    "makedirs": _wrap(lambda p: os.makedirs(p, exist_ok=True), "0"),
    "rmdir": _wrap(os.rmdir, "0"),
    "unlink": _wrap(os.unlink, "0"),
    "link": _wrap(os.link, "0"),
    "symlink": _wrap(os.symlink, "0"),
    "readlink": _wrap(os.readlink),
    "rename": _wrap(os.rename, "0"),
    "renameat2": op_renameat2,
    "chmod": _wrap(os.chmod, "0"),
    "chown": _wrap(os.chown, "0"),
    "lchown": _wrap(os.lchown, "0"),
    "utimens": op_utimens,
    "truncate": _wrap(os.truncate, "0"),
    "ftruncate": op_ftruncate,
    "mkfifo": _wrap(os.mkfifo, "0"),
    "mknod": _wrap(os.mknod, "0"),
    "lstat": lambda p, f: _fields(os.lstat(p), f),
    "stat": lambda p, f: _fields(os.stat(p), f),
    "listdir": lambda p: ",".join(sorted(os.listdir(p))),
    "unlink_open_read": op_unlink_open_read,
    "unlink_open_write": op_unlink_open_write,
    "rename_over_open_read": op_rename_over_open_read,
    "fifo_roundtrip": op_fifo_roundtrip,
    "times_recent": op_times_recent,
    "mtime_recent": op_mtime_recent,
    "save_times": op_save_times,
    "times_changed": op_times_changed,
    "umask": op_umask,
    "chown_rename_sweep": op_chown_rename_sweep,
    "sweep_kept": op_sweep_kept,
    "sleep": op_sleep,
}

# ---------------------------------------------------------------------------------------------
# The runner.
# ---------------------------------------------------------------------------------------------

ROOT = "posix-conformance"


def call(op, args):
    try:
        return OPS[op](*args)
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


def call_as_user(op, args):
    """Runs the op in a forked child that has become 65534:65534."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(USER[1])
            os.setuid(USER[0])
            out = call(op, args)
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            out = "child error: %r" % e
        os.write(w, out.encode("utf-8", "surrogateescape"))
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode("utf-8", "surrogateescape")


def names_for(group, prefix_len):
    names = {"n%d" % i: "n%d" % i for i in range(12)}
    names["name255"] = "N" * 255
    names["name256"] = "N" * 256
    names["long1000"] = "/".join(["t" * 99] * 10)[:1000]
    names["long4096"] = "t" * 4096
    # {key_parent}: four levels of 200 bytes; {keyN}: a name in it making the key N bytes.
    parent = "K/" + "/".join(["k" * 200] * 4)
    names["key_parent"] = parent
    used = prefix_len + len("%s/%s/%s/" % (ROOT, group, parent))
    for n in (1023, 1024, 1025):
        names["key%d" % n] = parent + "/" + "x" * (n - used)
    return names


MODE_ARG = {"chmod": 1, "mkdir": 1, "open": 2, "mkfifo": 1, "mknod": 1, "umask": 0}
FLAG_NAMES = ["O_WRONLY", "O_RDWR", "O_CREAT", "O_EXCL", "O_TRUNC", "O_NONBLOCK", "O_NOFOLLOW"]
NODE_TYPES = {stat.S_IFIFO: "S_IFIFO", stat.S_IFCHR: "S_IFCHR", stat.S_IFBLK: "S_IFBLK",
              stat.S_IFSOCK: "S_IFSOCK", stat.S_IFREG: "S_IFREG", stat.S_IFDIR: "S_IFDIR"}
TIME_NAMES = {UTIME_NOW: "UTIME_NOW", UTIME_OMIT: "UTIME_OMIT"}


def fmt_args(op, args):
    out = []
    for i, a in enumerate(args):
        if op == "open" and i == 1:
            names = [n for n in FLAG_NAMES if a & getattr(os, n)]
            out.append("|".join(names) or "O_RDONLY")
        elif op == "mknod" and i == 1 and a & 0o170000:
            kind = NODE_TYPES.get(stat.S_IFMT(a), oct(stat.S_IFMT(a)))
            out.append("%s|%s" % (kind, oct(stat.S_IMODE(a))))
        elif op == "mknod" and i == 2 and a:
            out.append("makedev(%d,%d)" % (os.major(a), os.minor(a)))
        elif MODE_ARG.get(op) == i:
            out.append(oct(a))
        elif op == "utimens" and i in (1, 2) and isinstance(a, int):
            out.append(TIME_NAMES.get(a) or (_ts(a) if a > 1_000_000_000 else str(a)))
        elif op == "utimens" and i == 3 and a == AT_SYMLINK_NOFOLLOW:
            out.append("AT_SYMLINK_NOFOLLOW")
        elif op == "renameat2" and i == 2:
            out.append({RENAME_NOREPLACE: "RENAME_NOREPLACE"}.get(a, str(a)))
        else:
            out.append(fmt_arg(a))
    return ", ".join(out)


def fmt_arg(a):
    if isinstance(a, str) and len(a) > 40:
        return "%s…(%d bytes)" % (a[:12], len(a))
    return repr(a) if isinstance(a, str) else str(a)


def short(s):
    s = repr(s)
    return s if len(s) <= 60 else s[:40] + "…(%d chars)'" % len(s)


def rows_of(group, rows, phase):
    """The rows of one phase ("before" or "after" the remount) with their numbers."""
    seen_remount = False
    for i, row in enumerate(rows, 1):
        if row == REMOUNT:
            seen_remount = True
            continue
        if (phase == "after") == seen_remount:
            yield i, row


def run_phase(mount, phase, prefix_len, results, only):
    for group, rows in TABLE.items():
        if only and group not in only:
            continue
        gdir = os.path.join(mount, ROOT, group)
        if phase == "before":
            os.makedirs(gdir, exist_ok=True)
        names = names_for(group, prefix_len)
        os.chdir(gdir)
        os.umask(0)
        for i, row in rows_of(group, rows, phase):
            opts = [x for x in row if isinstance(x, (_As, Known))]
            row = [x for x in row if not isinstance(x, (_As, Known))]
            expected, op, args = row[0], row[1], row[2:]
            expected = expected.format(**names)
            args = [a.format(**names) if isinstance(a, str) else a for a in args]
            as_user = any(isinstance(x, _As) for x in opts)
            known = next((x.reason for x in opts if isinstance(x, Known)), None)
            got = call_as_user(op, args) if as_user else call(op, args)
            ok = got == expected
            status = ("PASS" if ok else "FAIL") if known is None else ("XPASS" if ok else "KNOWN")
            desc = "%s#%d %s(%s)%s%s" % (group, i, op, fmt_args(op, args),
                                         " as 65534" if as_user else "",
                                         " after remount" if phase == "after" else "")
            line = "%-5s %s: expected %s, got %s" % (status, desc, short(expected), short(got))
            if known is not None:
                line += " [known: %s]" % known
            print(line, flush=True)
            results.append(status)
        os.umask(0)
    os.chdir("/")


def main(argv):
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mountpoint")
    p.add_argument("--remount", metavar="CMD",
                   help="shell command that unmounts and mounts MOUNTPOINT again")
    p.add_argument("--after-remount", action="store_true",
                   help="only the persistence cases, on a tree an earlier run left")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="bytes the mount's PREFIX adds to every key (with its '/')")
    p.add_argument("--keep", action="store_true", help="leave the tree in place")
    p.add_argument("--only", metavar="GROUP,...", help="run only these groups (%s)" % ",".join(TABLE))
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("conformance.py must run as root (it switches to uid 65534 for some cases)")
    mount = os.path.abspath(a.mountpoint)
    only = set(a.only.split(",")) if a.only else None
    if not os.path.ismount(mount):
        sys.exit("%s is not a mount point" % mount)
    root = os.path.join(mount, ROOT)
    results = []
    start = time.monotonic()
    if not a.after_remount:
        if os.path.lexists(root):
            shutil.rmtree(root)
        os.mkdir(root, 0o755)
        run_phase(mount, "before", a.prefix_len, results, only)
        if a.remount:
            print("# remount: %s" % a.remount, flush=True)
            subprocess.run(["sh", "-c", a.remount], check=True)
            if not os.path.ismount(mount):
                sys.exit("%s is not a mount point after --remount" % mount)
    if a.after_remount or a.remount:
        run_phase(mount, "after", a.prefix_len, results, only)
    pending = not (a.after_remount or a.remount)
    passed = results.count("PASS") + results.count("XPASS")
    failed = results.count("FAIL")
    known = results.count("KNOWN")
    print("%d passed, %d failed (%d known failures, %d unexpected passes), %d cases, %.1f s%s" % (
        passed, failed + known, known, results.count("XPASS"), len(results),
        time.monotonic() - start,
        "; persistence cases left for --after-remount" if pending else ""))
    if failed == 0 and not pending and not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
