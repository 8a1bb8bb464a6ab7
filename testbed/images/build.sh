#!/usr/bin/env bash
# Builds kt's five images offline (`make images`).
#
# No image can be pulled on our CI machines, so the public bases the
# Dockerfiles default to (distroless cc, and its :debug variant with a busybox
# shell for the client) are replaced by bases assembled here from this
# machine's own files: glibc and libgcc exactly as the binaries link them, CA
# certificates, a passwd/group with the nonroot user 65532 and, for the
# client, a static busybox under /busybox (the layout of distroless :debug).
# The same Dockerfiles then build on top with `--build-arg BASE=...`.
#
# Users with a registry build with the defaults:
#   docker build -f components/kt-store/Dockerfile <dir holding kt-store>
#
# Usage: testbed/images/build.sh BIN_DIR
#   KT_IMAGE_REPO  image name prefix (default ghcr.io/kt-dev)
#   KT_IMAGE_TAG   tag (default: the git revision, -dirty when the tree is)
#   KT_IMAGE_BASE  use this base for the servers instead of assembling one
#   KT_IMAGE_DEBUG_BASE  the same for the client (needs /bin/sh)
#   KT_IMAGE_GPU   1: also kt-agent-gpu, the agent with NCCL (`make images-gpu`)
#   KT_NCCL_WHEEL  the NCCL wheel it takes libnccl.so.2 from (pip requirement,
#                  default nvidia-nccl-cu12==2.28.9; ~340 MB, cached)
set -euo pipefail
cd "$(dirname "$0")/../.."

bin_dir=${1:?usage: build.sh BIN_DIR}
repo=${KT_IMAGE_REPO:-ghcr.io/kt-dev}
tag=${KT_IMAGE_TAG:-$(testbed/images/tag.sh)}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
work=${KT_IMAGE_WORK:-$(dirname "$bin_dir")/images}
export DOCKER_BUILDKIT=0

die() { echo "images: $*" >&2; exit 1; }
command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (is dockerd running, may this user use it?)"
components=(kt-metadata kt-store kt-agent kt-client kt-dataset)
binary() {
  case $1 in
    kt-client) echo kt ;;
    kt-dataset) echo kt-dataset-controller ;;
    *) echo "$1" ;;
  esac
}
for c in "${components[@]}"; do
  [ -x "$bin_dir/$(binary "$c")" ] || die "$bin_dir/$(binary "$c") is missing: build the release binaries first (make release)"
done

rm -rf "$work" && mkdir -p "$work"

# --- bases --------------------------------------------------------------
busybox_path() {
  # A static busybox: the host's if it has one, else Debian's package,
  # downloaded (not installed) and unpacked.
  local b
  for b in /bin/busybox /usr/bin/busybox; do
    if [ -x "$b" ] && ! ldd "$b" >/dev/null 2>&1; then echo "$b"; return; fi
  done
  local cache=${KT_IMAGE_CACHE:-$(dirname "$bin_dir")/image-cache}
  if [ ! -x "$cache/bin/busybox" ]; then
    mkdir -p "$cache"
    (cd "$cache" && { apt-get download busybox-static >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null && apt-get download busybox-static >/dev/null; }; }) ||
      die "no static busybox: apt-get download busybox-static failed"
    dpkg-deb -x "$cache"/busybox-static_*.deb "$cache/pkg"
    mkdir -p "$cache/bin" && cp "$cache/pkg/bin/busybox" "$cache/bin/busybox"
  fi
  echo "$cache/bin/busybox"
}

assemble_base() { # DIR WITH_SHELL
  local root=$1 shell=$2 lib
  mkdir -p "$root"/{etc/ssl/certs,tmp,home/nonroot,usr/local/bin,var/lib/kt,run/kt}
  chmod 1777 "$root/tmp"
  # Every shared library the binaries load, at the path the loader looks for.
  for c in "${components[@]}"; do
    ldd "$bin_dir/$(binary "$c")" | awk '/=> \//{print $3} /^\t\/lib|^\t\/usr/{print $1}'
  done | sort -u | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
  # The loader is asked for by its canonical path too (/lib64 -> /usr/lib64 on merged /usr).
  [ -e /lib64/ld-linux-x86-64.so.2 ] && mkdir -p "$root/lib64" &&
    cp -L /lib64/ld-linux-x86-64.so.2 "$root/lib64/" || true
  cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/" 2>/dev/null || true
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$root/etc/group"
  printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
  chown -R 65532:65532 "$root/home/nonroot" "$root/var/lib/kt" "$root/run/kt" 2>/dev/null || true
  if [ "$shell" = 1 ]; then
    mkdir -p "$root/busybox" "$root/bin"
    cp "$(busybox_path)" "$root/busybox/busybox"
    local applet
    for applet in $("$root/busybox/busybox" --list); do
      [ "$applet" = busybox ] || ln -s busybox "$root/busybox/$applet"
    done
    ln -s /busybox/sh "$root/bin/sh"
  fi
}

import_base() { # DIR NAME WITH_SHELL
  local path=/usr/local/bin:/usr/bin:/bin
  [ "$3" = 1 ] && path=$path:/busybox
  tar -C "$1" --numeric-owner -c . |
    docker import --change "ENV PATH=$path" --change "USER 65532:65532" - "$2" >/dev/null
}

base=${KT_IMAGE_BASE:-}
debug_base=${KT_IMAGE_DEBUG_BASE:-}
if [ -z "$base" ]; then
  echo "== assembling the base image (glibc, libgcc, CA certificates, nonroot user)"
  assemble_base "$work/base" 0
  base=kt-base:$tag
  import_base "$work/base" "$base" 0
fi
if [ -z "$debug_base" ]; then
  echo "== assembling the client base (the same, plus a static busybox under /busybox)"
  assemble_base "$work/debug-base" 1
  debug_base=kt-base-debug:$tag
  import_base "$work/debug-base" "$debug_base" 1
fi

# --- images --------------------------------------------------------------
for c in "${components[@]}"; do
  b=$(binary "$c")
  ctx="$work/ctx/$c"
  mkdir -p "$ctx"
  # Debug info stays in target/; the image keeps symbols for backtraces.
  strip --strip-debug -o "$ctx/$b" "$bin_dir/$b"
  from=$base
  [ "$c" = kt-client ] && from=$debug_base
  echo "== $repo/$c:$tag (FROM $from)"
  # The legacy builder (no buildx here) warns that it is deprecated: only
  # the rest of its output is shown, and only when the build fails.
  if ! out=$(docker build -q -f "components/$c/Dockerfile" --build-arg "BASE=$from" \
    --label "org.opencontainers.image.revision=$tag" \
    --label "org.opencontainers.image.version=$version" \
    -t "$repo/$c:$tag" -t "$repo/$c:$version" "$ctx" 2>&1); then
    echo "$out" | grep -v -e DEPRECATED -e "legacy builder" -e "BuildKit is" -e "environment-variable" >&2
    die "building $repo/$c:$tag failed"
  fi
done

# --- the GPU agent ---------------------------------------------------------
if [ "${KT_IMAGE_GPU:-0}" = 1 ]; then
  wheel=${KT_NCCL_WHEEL:-nvidia-nccl-cu12==2.28.9}
  cache=${KT_IMAGE_CACHE:-$(dirname "$bin_dir")/image-cache}/nccl/${wheel//[^A-Za-z0-9._-]/_}
  if [ ! -f "$cache/libnccl.so.2" ]; then
    echo "== downloading $wheel (NCCL for kt-agent-gpu)"
    mkdir -p "$cache/wheel"
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_18_x86_64 \
      --platform manylinux2014_x86_64 --python-version 3.11 -d "$cache/wheel" "$wheel" ||
      die "pip could not download $wheel"
    unzip -q -o -j "$cache"/wheel/*.whl 'nvidia/nccl/lib/libnccl.so.2' -d "$cache" ||
      die "no nvidia/nccl/lib/libnccl.so.2 in $wheel"
  fi
  ctx="$work/ctx/kt-agent-gpu"
  mkdir -p "$ctx/nccl" "$ctx/lib"
  cp "$cache/libnccl.so.2" "$ctx/nccl/"
  # What NCCL links that a base assembled here lacks (libstdc++, glibc's
  # libpthread/librt/libdl/libm stubs), from this machine's glibc as the
  # base is. A given KT_IMAGE_BASE (distroless cc) has them all.
  if [ -d "$work/base" ]; then
    ldd "$ctx/nccl/libnccl.so.2" | awk '/=> \//{print $3}' | while read -r lib; do
      [ -e "$work/base$lib" ] || cp -L "$lib" "$ctx/lib/"
    done
  fi
  echo "== $repo/kt-agent-gpu:$tag (FROM $repo/kt-agent:$tag, $wheel)"
  if ! out=$(docker build -q -f components/kt-agent/Dockerfile.gpu --build-arg "AGENT=$repo/kt-agent:$tag" \
    --label "org.opencontainers.image.revision=$tag" \
    --label "org.opencontainers.image.version=$version" \
    -t "$repo/kt-agent-gpu:$tag" -t "$repo/kt-agent-gpu:$version" "$ctx" 2>&1); then
    echo "$out" | grep -v -e DEPRECATED -e "legacy builder" -e "BuildKit is" -e "environment-variable" >&2
    die "building $repo/kt-agent-gpu:$tag failed"
  fi
  components+=(kt-agent-gpu)
fi

echo "== images"
for c in "${components[@]}"; do
  docker image inspect -f "{{.Size}}" "$repo/$c:$tag" |
    awk -v name="$repo/$c:$tag" '{printf "%-56s %6.1f MiB\n", name, $1/1048576}'
done
