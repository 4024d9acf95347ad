#!/usr/bin/env bash
# Compiles every unit test, example and benchmark source with Clang (syntax and template
# instantiation only, -fsyntax-only: no code generated), so that a construct Clang rejects or
# crashes on does not reach users who build with it; CI's builds use GCC. docs/building.md lists
# Clang 14 as supported: Debian 12's clang is 14. Installs Clang first where it is missing
# (scripts/install-deps.sh --clang). Exits non-zero, naming the files, if any fails.
#   scripts/clang_check.sh [files...]   (default: tests/unit, tests/sweep, examples and bench sources)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

command -v clang++ >/dev/null 2>&1 || scripts/install-deps.sh --clang
scripts/install-deps.sh >/dev/null

files=("$@")
[ "${#files[@]}" -gt 0 ] || files=(tests/unit/*.cpp tests/sweep/*.cpp examples/*.cpp bench/*.cpp)
mpi_include=$(mpicxx --showme:incdirs 2>/dev/null | awk '{print $1}')
flags=(-std=c++20 -fsyntax-only -fopenmp -Wall -Wextra -Iinclude -Itests -I/usr/include/eigen3
       "-DLOOM_TEST_DATA_DIR=\"$PWD/tests/data\"")
[ -n "$mpi_include" ] && flags+=("-I$mpi_include")

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
echo "clang_check.sh: $(clang++ --version | head -n 1), ${#files[@]} files on $(nproc) cores"
# Each file's messages go to a log named after its path; the names of those that fail are printed.
failed=$(printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -I{} sh -c \
  'f=$1; shift; clang++ "$@" "$f" >/dev/null 2>"$0/$(echo "$f" | tr / _).log" || echo "$f"' "$logs" {} "${flags[@]}")
status=0
for f in $failed; do
  echo "== clang_check.sh: $f failed:"
  grep -E "error|Stack dump|^[0-9]+\." "$logs/$(echo "$f" | tr / _).log" | head -n 20
  status=1
done
[ "$status" -eq 0 ] && echo "clang_check.sh: all ${#files[@]} files compile"
exit "$status"
