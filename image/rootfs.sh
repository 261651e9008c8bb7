#!/bin/sh
# image/rootfs.sh ROOTFS BINARY — lays out the s3csi image's file system in ROOTFS: the binary
# at /usr/local/bin/s3csi (debug info stripped), the shared libraries it links (from ldd, with
# the dynamic loader), CA certificates (TLS to S3 endpoints), fusermount3 and /etc/fuse.conf
# (for `s3csi mount` run unprivileged), an empty /tmp. Nothing else: no shell, no package
# manager. The Containerfile runs it in its build stage and copies ROOTFS into an empty
# image; tests/e2e runs it on the host and packs ROOTFS as an image tar (mkimage.py), so
# both describe the same image. Needs ldd, strip, fuse3 and ca-certificates on the host.
set -eu
root=$1 bin=$2
rm -rf "$root"
mkdir -p "$root/usr/local/bin" "$root/usr/bin" "$root/etc/ssl/certs" "$root/tmp"
chmod 1777 "$root/tmp"
strip --strip-debug -o "$root/usr/local/bin/s3csi" "$bin"
chmod 0755 "$root/usr/local/bin/s3csi"
cp /usr/bin/fusermount3 "$root/usr/bin/fusermount3"
[ -f /etc/fuse.conf ] && cp /etc/fuse.conf "$root/etc/fuse.conf"
cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
# Every library either program links, at the path ldd names (the loader's own path too).
for lib in $( (ldd "$bin"; ldd /usr/bin/fusermount3) | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | sort -u); do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
# Debian's loader path is /lib64/ld-linux-x86-64.so.2 and libraries are under /lib/x86_64-linux-gnu
# (merged /usr: /lib is a link to usr/lib on the host; in the image real directories do).
echo 'root:x:0:0:root:/root:/sbin/nologin' >"$root/etc/passwd"
echo 'root:x:0:' >"$root/etc/group"
