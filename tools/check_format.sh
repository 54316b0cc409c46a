#!/usr/bin/env bash
# The formatter in check mode: every C++ file git knows of must be as
# clang-format (.clang-format at the root; Debian 12's clang-format 14)
# writes it. Exit 1 with the files that are not; format them with
# `clang-format -i <file>`.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.h')
if ! out=$(clang-format --dry-run -Werror "${files[@]}" 2>&1); then
  grep -o '^[^:]*:' <<<"$out" | sort -u | sed 's/:$//; s/^/not formatted: /'
  exit 1
fi
echo "ok: ${#files[@]} files formatted"
