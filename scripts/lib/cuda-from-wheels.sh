#!/usr/bin/env bash
# A CUDA toolkit root made from wheels, for LibTorch's CMake configuration on a machine without
# the CUDA toolkit (the image's build stage on a plain Debian base, docker/Dockerfile). The pinned
# torch wheel is the CUDA build, and its CMake configuration asks for nvcc and the CUDA headers
# (FindCUDA) even though remotehead compiles no CUDA code. The wheel already brings the runtime's
# headers and libraries (site-packages/nvidia/cu13); this adds nvcc, its crt headers and nvvm
# from NVIDIA's wheels at the runtime's major.minor (FindCUDA refuses an nvcc of another minor
# than the headers), links them into one root, and prints the root.
#   scripts/lib/cuda-from-wheels.sh VENV OUT
# then configure with PATH=OUT/bin:$PATH CUDACXX=OUT/bin/nvcc CUDAARCHS=<an architecture>.
set -euo pipefail
venv=$1
out=$2
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cu=$site/nvidia/cu13
[ -d "$cu/include" ] && [ -d "$cu/lib" ] ||
  { echo "cuda-from-wheels: expected the torch wheel's CUDA 13 runtime in $cu" >&2; exit 2; }
minor=$("$venv/bin/python" -c 'import importlib.metadata as m
print(".".join(m.version("nvidia-cuda-runtime").split(".")[:2]))')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" -m pip download -q --no-deps -d "$work/wheels" "nvidia-cuda-nvcc==$minor.*" \
  "nvidia-cuda-crt==$minor.*" "nvidia-nvvm==$minor.*"
for wheel in "$work"/wheels/*.whl; do "$venv/bin/python" -m zipfile -e "$wheel" "$work/unpacked"; done
rm -rf "$out"
mkdir -p "$out/lib64" "$out/include"
cp -a "$work/unpacked/nvidia/cu13/bin" "$work/unpacked/nvidia/cu13/nvvm" "$out/"
cp -a "$work/unpacked/nvidia/cu13/include/." "$cu/include/." "$out/include/"
[ -d "$work/unpacked/nvidia/cu13/lib" ] && cp -a "$work/unpacked/nvidia/cu13/lib/." "$out/lib64/"
# The runtime's libraries where a toolkit has them: unversioned names for find_library, the
# static runtime nvcc links by default.
for lib in "$cu"/lib/*.so.*; do
  name=$(basename "$lib")
  ln -sf "$lib" "$out/lib64/$name"
  ln -sf "$lib" "$out/lib64/${name%%.so.*}.so"
done
for lib in "$cu"/lib/*.a; do ln -sf "$lib" "$out/lib64/"; done
ln -sfn lib64 "$out/lib"
chmod -R +x "$out/bin" "$out/nvvm/bin"
echo "$out"
