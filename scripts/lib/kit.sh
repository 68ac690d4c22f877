# Sourced by scripts/bundle and scripts/gpu-kit: the pieces of a kit that builds remotehead on a
# machine with no package registry. Each function writes one folder of OUT.
#   kit_source OUT      OUT/source.tar.gz: the project at HEAD (git archive), and the working
#                       tree's uncommitted changes (a kit made to try a change)
#   kit_debs OUT        OUT/debs/: the .deb files of the build's Debian packages
#                       (scripts/lib/debian-packages.sh) and of every library they depend on,
#                       less what a machine that compiles C++ has (build-essential's closure:
#                       the C library, the compiler's runtime) and Debian's required / important
#                       packages
#   kit_wheels DIR REQS [X.Y]   the wheels of requirements file REQS (pinned, --no-deps) into
#                       DIR, for Python X.Y on manylinux x86_64 when given (else this Python)
# Needs: root (the caller), git, apt, and $venv (the project's environment, for pip).

kit_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$kit_root/scripts/lib/debian-packages.sh"  # build_packages

kit_source() {
  local out=$1 stage
  stage=$(mktemp -d)
  git -C "$kit_root" archive --format=tar --prefix=source/ HEAD | tar -x -C "$stage"
  # The working tree's changes (a kit made to try an uncommitted change): tracked files as they
  # are there, and files git does not ignore but has not been told of yet. --no-renames: a moved
  # file is its old path (removed here) and its new one, not the new one alone.
  { git -C "$kit_root" diff --name-only --no-renames HEAD
    git -C "$kit_root" ls-files --others --exclude-standard; } |
    while read -r f; do
      if [ -f "$kit_root/$f" ]; then
        mkdir -p "$stage/source/$(dirname "$f")" && cp -p "$kit_root/$f" "$stage/source/$f"
      else
        rm -f "$stage/source/$f"
      fi
    done
  tar -czf "$out/source.tar.gz" -C "$stage" source
  rm -rf "$stage"
}

kit_debs() {
  local out=$1
  mkdir -p "$out/debs"
  closure() {
    apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
      --no-replaces --no-enhances "$@" | grep -E '^[a-z0-9]' | sort -u
  }
  declare -A present=()
  local p priority
  for p in $(closure build-essential); do present[$p]=1; done
  kit_deb_names=()
  for p in $(closure "${build_packages[@]}"); do
    [ -n "${present[$p]:-}" ] && continue
    priority=$(apt-cache show --no-all-versions "$p" 2>/dev/null | sed -n 's/^Priority: //p' | head -1)
    case $priority in required|important) ;; *) kit_deb_names+=("$p") ;; esac
  done
  local sandbox=()
  [ "$(id -u)" -eq 0 ] && sandbox=(-o APT::Sandbox::User=root)  # root: no _apt download user
  download() { (cd "$out/debs" && apt-get download "${sandbox[@]}" "${kit_deb_names[@]}" >/dev/null); }
  if ! download 2>/dev/null; then
    # No package lists yet (a machine whose packages came preinstalled): fetch them once.
    echo "kit: apt-get update" >&2
    local sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    download || { echo "kit: apt-get download failed" >&2; return 1; }
  fi
}

kit_wheels() {
  local dir=$1 reqs=$2 python_version=${3:-}
  mkdir -p "$dir"
  [ -s "$reqs" ] || return 0
  local platform=()
  if [ -n "$python_version" ]; then
    platform=(--python-version "$python_version" --only-binary=:all: --implementation cp
              --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
              --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
              --platform manylinux_2_34_x86_64)
  fi
  "$venv/bin/python" -m pip download -q --no-deps "${platform[@]}" -d "$dir" -r "$reqs"
}
