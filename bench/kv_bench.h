// `duet bench kv`: durable KV on disk (src/kv) against its floors and references,
// measured in the same run: durable appends per second (an fdatasync per append vs
// group commit, 1 / 4 / 16 writers; buffered vs O_DIRECT), restoring a context
// from its log (page cache warm and cold) against re-prefilling the same tokens on
// the same threads and against the disk's sequential read rate, CRC32C against
// memcpy, and the model fingerprint's cost. Markdown by default, --json for one object.
#pragma once

#include <string>

namespace duet {

struct KvBenchArgs {
    std::string model;
    int threads = 2;
    int tokens = 4096;         // the restored context's length
    int chunk = 512;           // prefill chunk and log record size of the restore test
    std::string dir;           // where the logs go ("": a new directory under /var/tmp)
    double seconds = 1.5;      // per append measurement
    int reps = 3;              // restore repetitions (median kept)
    std::string kv_dtype = "f16";
    bool json = false;
};

int cmd_bench_kv(const KvBenchArgs& a);

}  // namespace duet
