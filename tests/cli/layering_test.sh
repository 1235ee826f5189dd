#!/usr/bin/env bash
# The layers are a build fact (cmake/layers.cmake): in each layer's include view a
# header of a layer above it is not found, and the layer's own headers are.
#   layering_test.sh CXX VIEWS_DIR
set -euo pipefail
cxx=$1
views=$2
fails=0
compile() {  # view, header: exit status of compiling '#include "header"' in that view
  echo "#include \"$2\"" | "$cxx" -std=c++20 -fsyntax-only -I "$views/$1" -x c++ - 2>"$tmp"
}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
# layer : a header of a layer above it
for pair in base:shm/segment.h shm:kv/kv_pool.h kv:model/model.h kv:roles/front.h model:engine/engine.h \
            model:roles/workers.h engine:roles/serving.h roles:cli/serve.h roles:bench/kv_bench.h bench:cli/serve.h \
            kernels_cpu:base/result.h; do
  layer=${pair%%:*}
  header=${pair#*:}
  if compile "$layer" "$header"; then
    echo "FAIL: $header compiles in the $layer view (an upward include)"
    fails=$((fails + 1))
  elif ! grep -q "No such file" "$tmp"; then
    echo "FAIL: $header in the $layer view failed for another reason:"; cat "$tmp"
    fails=$((fails + 1))
  fi
done
# layer : its own header (and one from below), which must compile
for pair in base:base/result.h shm:shm/instance.h kv:kv/kv_log.h kv:shm/kv_arena.h model:model/model.h \
            engine:engine/prefill_scheduler.h roles:roles/serving.h bench:bench/shm_bench.h bench:roles/serving.h; do
  layer=${pair%%:*}
  header=${pair#*:}
  if ! compile "$layer" "$header"; then
    echo "FAIL: $header does not compile in the $layer view:"; head -5 "$tmp"
    fails=$((fails + 1))
  fi
done
echo "layering: $fails failures"
[ "$fails" -eq 0 ]
