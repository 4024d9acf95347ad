#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages that loom's build, tests and examples need, and only
# those that are missing (nothing is touched when all are there).
#   scripts/install-deps.sh            compilers, CMake, Eigen, doctest, Open MPI, CLI11, JSON
#   scripts/install-deps.sh --bench    also PyTorch (the reference benchmarks) and OpenBLAS
#   scripts/install-deps.sh --clang    also Clang and its OpenMP (scripts/clang_check.sh)
set -euo pipefail

packages=(build-essential cmake libeigen3-dev doctest-dev libopenmpi-dev openmpi-bin
          libcli11-dev nlohmann-json3-dev)
for arg in "$@"; do
  case "$arg" in
    --bench) packages+=(python3-torch libopenblas0-pthread) ;;
    --clang) packages+=(clang libomp-dev) ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "install-deps.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "install-deps.sh: not a Debian-based system; install these yourself: ${packages[*]}" >&2
  exit 0
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps.sh: all ${#packages[@]} packages are installed"
  exit 0
fi

echo "install-deps.sh: installing ${missing[*]}"
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "install-deps.sh: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get update
${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
