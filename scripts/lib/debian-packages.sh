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
