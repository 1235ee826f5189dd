// kv_gen: writes small, valid KV blobs and logs with the contents of kv_gen.h.
//   kv_gen fuzz-seeds DIR   DIR/seeds-kv-blob/*.kvblob and DIR/seeds-kv-log/*.kvlog
//                           (the fuzz seeds: build/tests/kv_gen fuzz-seeds tests/fuzz)
//   kv_gen sample DIR       DIR/demo.kvlog with its checkpoint DIR/demo.1.kvblob, and
//                           DIR/export.kvblob (tests/cli/kv_cli_test.sh)
// The log seeds are made by KvLog itself (create, append, truncate, compact), so
// they are what the engine writes; their salts are random, so a regenerated seed
// differs in its checksums but not in its records.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "kv/kv_log.h"
#include "kv_gen.h"

using namespace duet;
namespace fs = std::filesystem;

namespace {

struct Step {
    char op;     // 'a' append n, 't' truncate to n, 'c' compact
    uint64_t n;
};

// Runs a script against a new log of `context` in dir, mirroring every step in a
// sequence of the pure function. Returns the log's path.
Result<std::string> write_log(const std::string& dir, const std::string& context, const KvLayout& l,
                              const std::vector<Step>& script) {
    SyncLogDevice dev;
    KvLogSync sync(dev);
    auto log = KvLog::create(sync, dir, context, kvgen::identity(), l);
    if (!log) return log.error();
    auto pool = KvPool::create(l, 64);
    if (!pool) return pool.error();
    KvSeq seq;
    std::vector<int32_t> tokens;
    Status s;
    for (const Step& st : script) {
        if (st.op == 'a') {
            const uint64_t from = static_cast<uint64_t>(seq.n_tokens());
            s = kvgen::append(**pool, seq, tokens, st.n);
            if (s) s = (*log)->append(**pool, seq, tokens, from, st.n);
        } else if (st.op == 't') {
            seq.truncate(**pool, static_cast<int64_t>(st.n));
            tokens.resize(st.n);
            s = (*log)->truncate(st.n);
        } else {
            s = (*log)->compact(**pool, seq, tokens);
        }
        if (!s) break;
    }
    seq.release(**pool);
    if (!s) return s.error();
    return (*log)->path();
}

Result<BlobHeader> write_blob(const std::string& path, const KvLayout& l, uint64_t first, uint64_t n) {
    auto pool = KvPool::create(l, 64);
    if (!pool) return pool.error();
    KvSeq seq;
    std::vector<int32_t> tokens;
    Status s = kvgen::append(**pool, seq, tokens, first + n);
    Result<BlobHeader> h = s ? blob_write(path, kvgen::identity(), **pool, seq, tokens, first, n) : s.error();
    seq.release(**pool);
    return h;
}

int fail(const Error& e) {
    std::fprintf(stderr, "kv_gen: %s\n", e.message.c_str());
    return 1;
}

int fuzz_seeds(const std::string& out) {
    const std::string blobs = out + "/seeds-kv-blob", logs = out + "/seeds-kv-log";
    fs::create_directories(blobs);
    fs::create_directories(logs);
    struct BlobSeed {
        const char* name;
        KvLayout l;
        uint64_t first, n;
    };
    const BlobSeed bs[] = {
        {"f16-whole", kvgen::layout(), 0, 5},
        {"f16-tail", kvgen::layout(), 3, 6},  // continues a partial block
        {"f16-empty", kvgen::layout(), 0, 0},
        {"int8-whole", kvgen::layout(KvDtype::Int8), 0, 6},
        {"fp8-tail", kvgen::layout(KvDtype::Fp8), 2, 5},
        {"odd-int8", kvgen::odd_layout(KvDtype::Int8), 0, 7},
        {"odd-f16-tail", kvgen::odd_layout(KvDtype::F16), 4, 3},
    };
    for (const BlobSeed& b : bs)
        if (auto h = write_blob(blobs + "/" + b.name + ".kvblob", b.l, b.first, b.n); !h) return fail(h.error());

    char tmpl[] = "/tmp/kv_gen.XXXXXX";
    if (!::mkdtemp(tmpl)) return fail(make_error("mkdtemp: {}", std::strerror(errno)));
    const std::string tmp = tmpl;
    struct LogSeed {
        const char* name;
        const char* context;
        KvLayout l;
        std::vector<Step> script;
        uint64_t cut = 0;  // bytes cut off the end: a torn tail
    };
    const std::vector<LogSeed> ls = {
        {"empty", "e", kvgen::layout(), {}},
        {"appends", "a", kvgen::layout(), {{'a', 1}, {'a', 3}, {'a', 2}}},
        {"truncate", "t", kvgen::layout(), {{'a', 4}, {'t', 1}, {'a', 2}, {'t', 0}, {'a', 1}}},
        // The checkpoint is positions [0, kCheckpointTokens): 3 + 2 at the compaction.
        {"checkpoint", kvgen::kCheckpointContext, kvgen::layout(),
         {{'a', 3}, {'a', 2}, {'c', 0}, {'a', 3}, {'t', 6}, {'a', 1}}},
        {"torn", "a", kvgen::layout(), {{'a', 1}, {'a', 3}, {'a', 2}}, 37},
        {"int8", "q8", kvgen::layout(KvDtype::Int8), {{'a', 2}, {'a', 3}, {'t', 4}}},
        {"odd-fp8", "o", kvgen::odd_layout(KvDtype::Fp8), {{'a', 4}, {'a', 1}}},
    };
    static_assert(kvgen::kCheckpointTokens == 5, "the checkpoint seed's script compacts at 5 positions");
    int rc = 0;
    for (const LogSeed& s : ls) {
        auto path = write_log(tmp, s.context, s.l, s.script);
        if (!path) {
            rc = fail(path.error());
            break;
        }
        const std::string dst = logs + "/" + s.name + ".kvlog";
        fs::copy_file(*path, dst, fs::copy_options::overwrite_existing);
        if (s.cut) fs::resize_file(dst, fs::file_size(dst) - s.cut);
        fs::remove(*path);
    }
    fs::remove_all(tmp);
    return rc;
}

int sample(const std::string& dir) {
    fs::create_directories(dir);
    auto path = write_log(dir, "demo", kvgen::layout(), {{'a', 3}, {'a', 2}, {'c', 0}, {'a', 3}, {'t', 6}, {'a', 1}});
    if (!path) return fail(path.error());
    if (auto h = write_blob(dir + "/export.kvblob", kvgen::layout(), 0, 5); !h) return fail(h.error());
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    const std::string mode = argc == 3 ? argv[1] : "";
    if (mode == "fuzz-seeds") return fuzz_seeds(argv[2]);
    if (mode == "sample") return sample(argv[2]);
    std::fprintf(stderr, "usage: kv_gen fuzz-seeds DIR | kv_gen sample DIR\n");
    return 2;
}
