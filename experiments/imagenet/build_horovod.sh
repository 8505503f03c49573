#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyPI source) for CPU with Gloo into its own environment, beside .venv.
#
#   experiments/imagenet/build_horovod.sh [VENV]    # make horovod; default VENV: .venv-horovod
#
# The environment sees the project's .venv through a .pth file (torch, torchvision and
# gradientflow are not installed twice) and holds Horovod alone, so `make install` never pulls
# it in. Horovod 0.28.1 predates torch 2.14: its torch extension is compiled as C++14 and its
# bundled Gloo as C++11, and torch 2.14's headers need C++17 or later, so the source is patched
# to C++20 for the extension and C++17 for Gloo. CUDA detection is turned off (the torch wheel
# here is a CUDA build, but there is no toolkit to compile against), and MPI, TensorFlow and
# MXNet are left out. One compiler job (MAKEFLAGS=-j1): about 20 minutes of one core.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BASE="$ROOT/.venv"
VENV="${1:-$ROOT/.venv-horovod}"
VERSION=0.28.1
WORK="$ROOT/build/horovod"

if [ ! -x "$BASE/bin/python" ]; then
    echo "build_horovod.sh: $BASE is missing: run 'make install' first" >&2
    exit 2
fi
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    echo "build_horovod.sh: Horovod needs cmake (>= 3.13) and g++ (>= 10):" \
        "apt-get install -y cmake g++" >&2
    exit 2
fi

"$BASE/bin/python" -m venv "$VENV"
base_site="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
venv_site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir, not a bare path: the base's own .pth files (an editable install, a shared
# dependency folder) are then read too.
echo "import site; site.addsitedir('$base_site')" > "$venv_site/_gradientflow_base.pth"
"$VENV/bin/python" -m pip install -q wheel

rm -rf "$WORK" && mkdir -p "$WORK"
"$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: "horovod==$VERSION" -d "$WORK"
tar -xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
src="$WORK/horovod-$VERSION"

# C++ standards torch 2.14's headers accept.
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' "$src/horovod/torch/CMakeLists.txt"
# Gloo's own flag is overridden by the CMAKE_CXX_STANDARD in force (Horovod's 14), so both are
# raised, as Horovod itself does for the Gloo it builds for C++17 TensorFlow: compiled as C++14,
# Gloo defines Store::kDefaultTimeout out of line while the C++20 extension emits it inline,
# and the link fails with a multiple definition.
sed -i -e 's/-std=c++11/-std=c++17/' -e '1i set(CMAKE_CXX_STANDARD 17)' \
    "$src/third_party/gloo/CMakeLists.txt"
# No CUDA: without this, CMake's probes can find a CUDA runtime beside the torch wheel and
# switch on GPU code paths that cannot compile here.
sed -i -e 's/^check_language(CUDA)$/# CUDA detection off (CPU build)/' \
    -e 's/^    find_package(CUDAToolkit)$/    # find_package(CUDAToolkit): off (CPU build)/' \
    "$src/CMakeLists.txt"
# torch's cpp_extension falls back to CUDA_HOME=/usr/local when no toolkit is found, which
# makes Horovod's FindPytorch report a CUDA torch and ask for the toolkit: report a CPU one.
sed -i 's/^string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)$/set(Pytorch_CUDA FALSE)  # CPU build/' \
    "$src/cmake/Modules/FindPytorch.cmake"
# Horovod 0.28.1's process-set contexts create their Gloo device from their own, never set,
# interface name instead of the global context's (HOROVOD_GLOO_IFACE), so they bind to what the
# hostname resolves to: 127.0.0.1 inside a network namespace, where no peer can reach it.
sed -i '/^void GlooContext::InitializeForProcessSet/,/CreateDevice/ s/device_attr.iface = gloo_iface_;/device_attr.iface = global_context.gloo_iface_;/' \
    "$src/horovod/common/gloo/gloo_context.cc"
grep -q 'device_attr.iface = global_context.gloo_iface_;' "$src/horovod/common/gloo/gloo_context.cc"
grep -q 'CMAKE_CXX_STANDARD 20' "$src/horovod/torch/CMakeLists.txt"
grep -q 'set(Pytorch_CUDA FALSE)' "$src/cmake/Modules/FindPytorch.cmake"
grep -q '^set(CMAKE_CXX_STANDARD 17)' "$src/third_party/gloo/CMakeLists.txt"
grep -q 'CUDA detection off' "$src/CMakeLists.txt"

env -u CUDA_HOME -u CUDA_PATH \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_NVTX=1 HOROVOD_CPU_OPERATIONS=GLOO \
    MAKEFLAGS=-j1 \
    "$VENV/bin/python" -m pip install --no-build-isolation --no-deps -v "$src" \
    > "$WORK/build.log" 2>&1 || {
        echo "build_horovod.sh: the build failed; the last lines of $WORK/build.log:" >&2
        tail -30 "$WORK/build.log" >&2
        exit 1
    }
"$VENV/bin/python" -m pip install -q cloudpickle psutil pyyaml packaging cffi
"$VENV/bin/python" -c "import horovod.torch as hvd; hvd.init(); \
print('horovod', __import__('horovod').__version__, 'gloo built:', hvd.gloo_built(), \
'size', hvd.size())"
touch "$VENV/.installed"
