#!/usr/bin/env bash
# Builds the vgpu container images on this machine, without any image registry: FROM scratch
# images holding the binaries built here plus, for glibc binaries, exactly the shared libraries
# they load (ldd). Prints the image sizes and smoke-tests each image.
#
#   deploy/docker/build.sh                           # tags vgpu/vgpu-cp:dev, vgpu/vgpu-agent:dev, vgpu/vgpuctl:dev
#   TAG=0.1 deploy/docker/build.sh
#   VGPU_IMAGE_LIBC=glibc deploy/docker/build.sh     # glibc binaries even where musl is available
#   PROFILE=debug deploy/docker/build.sh             # debug binaries (quicker to build; tests)
#
# vgpu-cp and vgpuctl are static musl binaries when the Rust target x86_64-unknown-linux-musl is
# installed (`rustup target add x86_64-unknown-linux-musl`), else glibc binaries with their
# libraries. vgpu-agent is always a glibc binary: on GPU nodes it dlopens NVIDIA's glibc-linked
# driver libraries (NVML, libcuda), which a static musl binary cannot load. The interposer
# (libvgpu_cuda.so) goes into the agent image at /usr/lib/vgpu/ when target/release (or
# target/debug with PROFILE=debug) has one (`cargo build --release -p interposer`).
set -euo pipefail
cd "$(dirname "$0")/../.."

tag="${TAG:-dev}"
libc="${VGPU_IMAGE_LIBC:-auto}"
musl_target=x86_64-unknown-linux-musl
if [ "$libc" = auto ]; then
  libc=glibc
  if rustup target list --installed 2>/dev/null | grep -qx "$musl_target"; then
    libc=musl
  fi
fi

profile="${PROFILE:-release}"
case "$profile" in
  release) profile_flag=(--release) ;;
  debug) profile_flag=() ;;
  *) echo "build.sh: PROFILE is release or debug, not '$profile'" >&2; exit 2 ;;
esac

echo "building the binaries ($profile; vgpu-cp and vgpuctl: $libc)..." >&2
cargo build "${profile_flag[@]}" --quiet -p vgpu-cp -p vgpu-agent -p vgpu-dra -p vgpuctl
cargo_target="${CARGO_TARGET_DIR:-$PWD/target}"
glibc_bin="$cargo_target/$profile"
small_bin="$glibc_bin"
if [ "$libc" = musl ]; then
  cargo build "${profile_flag[@]}" --quiet --target "$musl_target" -p vgpu-cp -p vgpuctl
  small_bin="$cargo_target/$musl_target/$profile"
fi

# One context per tag, so that builds of different tags (nemesis.sh builds `nemesis`) can run at once.
context="$PWD/target/docker-context${TAG:+-$TAG}"
rm -rf "$context"
mkdir -p "$context"/{cp,agent,ctl,data}

# add ROOT BINARY [DESTINATION_DIR]: the binary (debug info stripped) and the libraries it loads.
add() {
  local root="$1" binary="$2" destination="${3:-/usr/local/bin}"
  mkdir -p "$root$destination"
  local target
  target="$root$destination/$(basename "$binary")"
  if command -v strip >/dev/null 2>&1; then
    strip --strip-debug -o "$target" "$binary"
  else
    cp "$binary" "$target"
  fi
  if ldd "$binary" >/dev/null 2>&1; then
    # Lines are `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` and the loader's
    # `/lib64/ld-linux-x86-64.so.2 (0x...)`; copy each under the same path.
    ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' |
      while read -r library; do
        cp -L --parents "$library" "$root/"
      done
  fi
}

# Name resolution for glibc (host names such as `cp1` in compose); musl reads the files itself.
for root in "$context"/{cp,agent,ctl}; do
  mkdir -p "$root/etc" "$root/tmp"
  chmod 1777 "$root/tmp"
  printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
  printf 'root:x:0:0:root:/:/sbin/nologin\nvgpu:x:65532:65532:vgpu:/var/lib/vgpu-cp:/sbin/nologin\n' >"$root/etc/passwd"
  printf 'root:x:0:\nvgpu:x:65532:\n' >"$root/etc/group"
done

add "$context/cp" "$small_bin/vgpu-cp"
add "$context/cp" "$small_bin/vgpuctl"
add "$context/agent" "$glibc_bin/vgpu-agent"
# The Kubernetes DRA driver (deploy/k8s/dra) runs from the agent image.
add "$context/agent" "$glibc_bin/vgpu-dra"
add "$context/agent" "$small_bin/vgpuctl"
mkdir -p "$context/agent/var/lib/vgpu-agent" "$context/agent/var/run/cdi"
for lib in libvgpu_cuda.so libvgpu_nccl.so; do
  if [ -f "$glibc_bin/$lib" ]; then
    add "$context/agent" "$glibc_bin/$lib" /usr/lib/vgpu
  fi
done
add "$context/ctl" "$small_bin/vgpuctl"

for image in vgpu-cp vgpu-agent vgpuctl; do
  echo "building vgpu/$image:$tag..." >&2
  if ! docker build --quiet -f deploy/docker/Dockerfile --target "$image" -t "vgpu/$image:$tag" \
    "$context" >"$context/$image.log" 2>&1; then
    cat "$context/$image.log" >&2
    exit 1
  fi
done

# Smoke tests: each image starts, and the agent's simulated inventory needs no NVML.
docker run --rm "vgpu/vgpuctl:$tag" --version >/dev/null
docker run --rm --entrypoint /usr/local/bin/vgpu-cp "vgpu/vgpu-cp:$tag" --version >/dev/null
docker run --rm "vgpu/vgpu-agent:$tag" inventory --simulate 2xH100-80GB --name smoke >/dev/null
docker run --rm --entrypoint /usr/local/bin/vgpu-dra "vgpu/vgpu-agent:$tag" \
  print-slice --node-name smoke --simulate 2xH100-80GB >/dev/null

echo "images (vgpu-cp/vgpuctl: $libc):"
for image in vgpu-cp vgpu-agent vgpuctl; do
  size="$(docker image inspect --format '{{.Size}}' "vgpu/$image:$tag")"
  awk -v name="vgpu/$image:$tag" -v size="$size" 'BEGIN { printf "  %-22s %6.1f MB\n", name, size / 1e6 }'
done
