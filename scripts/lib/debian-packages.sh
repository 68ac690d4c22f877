# Sourced by scripts/bootstrap and scripts/bundle: the one list of the Debian packages that the
# C++ build compiles and links against (bootstrap installs them; bundle downloads them, with the
# libraries they depend on, for machines without a package registry).
build_packages=(
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libabsl-dev
  prometheus-cpp-dev libgtest-dev libgmock-dev nlohmann-json3-dev libssl-dev
  libcivetweb-dev  # prometheus-cpp's CMake config asks for it (remotehead serves /metrics itself)
  zlib1g-dev
  libgloo-dev  # c10d's Gloo header compiles against it (never linked)
)

# Installs those of the given Debian packages that are not installed (apt-get, through sudo when
# not root), saying which on stderr after `who:`. scripts/bootstrap and scripts/test-deploy.
install_missing_packages() {
  local who=$1 p sudo=""
  shift
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  echo "$who: installing Debian packages: ${missing[*]}" >&2
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}
