# Sourced by scripts/install-offline and scripts/gpu-check: a kit or bundle installed into one
# prefix and configured there, with no package registry and no change outside the prefix.
#   kit_install KIT PREFIX PYTHON
#       KIT/debs/*.deb unpacked with dpkg -x (or by hand where there is no dpkg) into
#       PREFIX/deps (no root, no apt); the wheels of
#       KIT/wheels (requirements.txt: pinned, --no-deps, no index) into PREFIX/python; writes
#       PREFIX/env.sh (the prefix's tools, libraries and Python packages first) and sources it
#   kit_configure SOURCE BUILD PREFIX PYTHON [CMAKE ARGS...]
#       CMake configuration of SOURCE into BUILD against the prefix's packages only (CMake finds
#       gRPC, protobuf and Abseil there, never the system's) and PYTHON's torch; the log in
#       BUILD/../configure.log

kit_install() {
  local kit=$1 prefix=$2 python=$3
  local deps=$prefix/deps deb
  mkdir -p "$deps" "$prefix/python"
  for deb in "$kit"/debs/*.deb; do kit_unpack_deb "$deb" "$deps" "$python"; done
  if [ -s "$kit/wheels/requirements.txt" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$prefix/python" \
      --find-links "$kit/wheels" -r "$kit/wheels/requirements.txt"
  fi
  local multiarch=$deps/usr/lib/$(kit_triplet)
  cat >"$prefix/env.sh" <<ENV
# source this: the kit's tools, libraries and Python packages first
export PATH="$deps/usr/bin:$prefix/python/bin\${PATH:+:\$PATH}"
export LD_LIBRARY_PATH="$multiarch\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export PYTHONPATH="$prefix/python\${PYTHONPATH:+:\$PYTHONPATH}"
ENV
  source "$prefix/env.sh"
}

# The machine's multiarch triplet (x86_64-linux-gnu), from the C++ compiler the build uses.
kit_triplet() { "${CXX:-c++}" -dumpmachine; }

# One .deb's files into DIR: dpkg -x, or where there is no dpkg (a machine that is not
# Debian-like) the same by hand: a .deb is an ar archive whose data.tar.* holds the files.
kit_unpack_deb() {
  local deb=$1 dir=$2 python=$3
  if command -v dpkg >/dev/null; then
    dpkg -x "$deb" "$dir"
    return
  fi
  "$python" - "$deb" "$dir" <<'PY'
import io, sys, tarfile
deb, out = sys.argv[1], sys.argv[2]
data = open(deb, "rb").read()
assert data[:8] == b"!<arch>\n", f"{deb}: not a .deb (ar) archive"
pos = 8
while pos < len(data):
    name = data[pos:pos + 16].decode().strip().rstrip("/")
    size = int(data[pos + 48:pos + 58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        if name.endswith(".zst"):
            raise SystemExit(f"{deb}: {name}: zstd is not readable here; install dpkg")
        # dpkg -x's semantics (a package's own absolute links kept): the "tar" filter where
        # Python has extraction filters.
        kw = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
        tarfile.open(fileobj=io.BytesIO(body)).extractall(out, **kw)
        break
    pos += 60 + size + (size % 2)
else:
    raise SystemExit(f"{deb}: no data.tar member")
PY
}

kit_configure() {
  local source=$1 build=$2 prefix=$3 python=$4
  shift 4
  local deps=$prefix/deps
  local multiarch=$deps/usr/lib/$(kit_triplet)
  # The packages' multiarch headers (e.g. openssl/opensslconf.h) live in include/<triplet>,
  # which the compiler searches by itself only under /usr; and their pkg-config files name
  # /usr/lib/<triplet> (gRPC's re2 links as -lre2), which the linker searches only there.
  cmake -S "$source" -B "$build" -G Ninja -DREMOTEHEAD_PYTHON="$python" \
    -DCMAKE_PREFIX_PATH="$deps/usr;$multiarch/cmake" \
    -DCMAKE_CXX_FLAGS="-isystem $deps/usr/include/$(kit_triplet)" \
    -DCMAKE_EXE_LINKER_FLAGS="-L$multiarch" -DCMAKE_SHARED_LINKER_FLAGS="-L$multiarch" \
    -DProtobuf_PROTOC_EXECUTABLE="$deps/usr/bin/protoc" \
    -DCMAKE_BUILD_RPATH="$multiarch" "$@" >"$(dirname "$build")/configure.log" 2>&1
}
