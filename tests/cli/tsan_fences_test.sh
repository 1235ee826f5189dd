#!/usr/bin/env bash
# GCC refuses std::atomic_thread_fence under -fsanitize=thread (-Wtsan, an error with
# -Werror), and ThreadSanitizer does not model fences anyway. So in our own code a
# fence stands only in the non-TSan branch of '#ifdef DUET_TSAN ... #else ... #endif',
# next to an atomic read-modify-write that TSan does understand. This catches a bare
# fence in the main build, minutes before the TSan build of `make test` would.
#   tsan_fences_test.sh SOURCE_DIR
set -euo pipefail
cd "$1"
# grep exits 1 when nothing matches, 2 on an error: only 0 lets the test go on (the
# substrate has fences, so no match means the search itself is wrong).
files=$(grep -rl --include='*.h' --include='*.cpp' --include='*.cu' --include='*.cuh' 'atomic_thread_fence' \
        shm kernels src bench tests) || { echo "FAIL: grep for fences exited $?"; exit 1; }
fails=0
while IFS= read -r f; do
  out=$(awk '
    /^[ \t]*#[ \t]*if/    { depth++; tsan[depth] = ($0 ~ /DUET_TSAN/); branch[depth] = "if" }
    /^[ \t]*#[ \t]*else/  { branch[depth] = "else" }
    /^[ \t]*#[ \t]*endif/ { depth-- }
    /atomic_thread_fence\(/ && $0 !~ /^[ \t]*\/\// {
      ok = 0
      for (d = depth; d >= 1; d--) if (tsan[d] && branch[d] == "else") ok = 1
      if (!ok) printf "%s:%d: %s\n", FILENAME, FNR, $0
    }' "$f")
  if [ -n "$out" ]; then echo "FAIL: a fence outside '#ifdef DUET_TSAN ... #else':"; echo "$out"; fails=$((fails + 1)); fi
done <<<"$files"
echo "tsan fences: $fails of $(wc -l <<<"$files") files with a fence have a bare one"
[ "$fails" -eq 0 ]
