#include "bench/kv_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/thread_pool.h"
#include "bench/bench_util.h"
#include "kv/blob.h"
#include "kv/crc32c.h"
#include "kv/kv_log.h"
#include "model/cpu_backend.h"
#include "model/fingerprint.h"
#include "model/model.h"

namespace duet {

namespace {

using bench::drop_cache;
using bench::median;
using bench::now_s;

// Sequential read MB/s of a file of `bytes` (4 MiB reads), after dropping its pages
// (cold) or right after reading it once (warm).
std::pair<double, double> disk_read_rate(const std::string& dir, uint64_t bytes) {
    const std::string path = dir + "/seqread.bin";
    std::vector<uint8_t> buf(4 << 20);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131);
    const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) return {0, 0};
    for (uint64_t off = 0; off < bytes; off += buf.size())
        if (::pwrite(fd, buf.data(), buf.size(), static_cast<off_t>(off)) < 0) break;
    ::fdatasync(fd);
    // Into a destination as large as the file (a restore's arena is not cache-hot).
    std::vector<uint8_t> dst(bytes);
    const auto read_all = [&] {
        const double t0 = now_s();
        for (uint64_t off = 0; off < bytes; off += buf.size())
            if (::pread(fd, dst.data() + off, std::min<uint64_t>(buf.size(), bytes - off), static_cast<off_t>(off)) <= 0)
                break;
        return static_cast<double>(bytes) / 1e6 / (now_s() - t0);
    };
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    const double cold = read_all();
    const double warm = read_all();
    ::close(fd);
    ::unlink(path.c_str());
    return {cold, warm};
}

std::vector<int32_t> prompt_ids(int n) {
    std::vector<int32_t> v(n);
    for (int i = 0; i < n; ++i) v[i] = (i * 7919 + 104729 + 17) % 49152;
    return v;
}

struct AppendFigure {
    std::string mode;
    int writers = 0, tokens_per_append = 0;
    double appends_per_s = 0, mb_per_s = 0, bytes_per_token = 0;
};

// What the measurements of one run share: the KV pool and backend the context was
// prefilled with, that context (the source of every record written) and where the
// logs go. Every figure goes into `out`.
struct KvBenchRun {
    const KvBenchArgs& a;
    const std::string& dir;
    const KvIdentity& id;
    const KvLayout& layout;
    KvPool& pool;
    CpuBackend& be;
    const std::vector<int32_t> toks;
    KvSeq& seq;
    nlohmann::json& out;
};

// Fingerprints: what every start pays.
KvIdentity measure_fingerprints(const Model& m, nlohmann::json& out) {
    const double t0 = now_s();
    KvIdentity id{model_fingerprint(m.file()), tokenizer_fingerprint(m.file()), m.config().n_vocab};
    out["fingerprint_ms"] = (now_s() - t0) * 1e3;
    out["model_file_bytes"] = m.file().file_size();
    return id;
}

// CRC32C against memcpy over 64 MiB.
void measure_crc(nlohmann::json& out) {
    std::vector<uint8_t> src(64 << 20, 1), dst(64 << 20);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7);
    double best_crc = 1e9, best_cpy = 1e9;
    uint32_t sink = 0;
    for (int r = 0; r < 5; ++r) {
        double s = now_s();
        sink ^= crc32c(src.data(), src.size());
        best_crc = std::min(best_crc, now_s() - s);
        s = now_s();
        std::memcpy(dst.data(), src.data(), src.size());
        best_cpy = std::min(best_cpy, now_s() - s);
        sink ^= dst[r];
    }
    out["crc32c_gb_s"] = src.size() / best_crc / 1e9;
    out["memcpy_gb_s"] = src.size() / best_cpy / 1e9;
    out["crc_sink"] = sink;
}

// The reference: prefilling the context (and its first token) on these threads.
Status measure_prefill(KvBenchRun& r) {
    std::vector<float> logits;
    const double t0 = now_s();
    for (int at = 0; at < r.a.tokens; at += r.a.chunk) {
        SeqBatch b{&r.seq, r.toks.data() + at, std::min(r.a.chunk, r.a.tokens - at), false};
        if (Status s = r.be.forward({&b, 1}, logits); !s) return make_error("prefill: {}", s.error().message);
    }
    const double prefill_s = now_s() - t0;
    r.out["prefill_s"] = prefill_s;
    r.out["prefill_tokens_per_s"] = r.a.tokens / prefill_s;
    return {};
}

// The context's log, in records of `chunk` tokens; its size in bytes.
Result<uint64_t> write_restore_log(KvBenchRun& r, LogDevice& dev) {
    double log_write_s = 0;
    uint64_t log_bytes = 0;
    {
        KvLogSync sync(dev);
        auto log = KvLog::create(sync, r.dir, "restore", r.id, r.layout);
        if (!log) return log.error();
        const double t0 = now_s();
        for (int at = 0; at < r.a.tokens; at += r.a.chunk)
            if (Status s = (*log)->append(r.pool, r.seq, r.toks, at, std::min(r.a.chunk, r.a.tokens - at)); !s)
                return s.error();
        log_write_s = now_s() - t0;
        log_bytes = (*log)->file_bytes();
    }
    r.out["log_bytes"] = log_bytes;
    r.out["log_bytes_per_token"] = static_cast<double>(log_bytes) / r.a.tokens;
    r.out["log_write_mb_s"] = log_bytes / 1e6 / log_write_s;
    r.out["kv_bytes_per_token"] = r.layout.bytes_per_token();
    return log_bytes;
}

// Replays the log into fresh blocks, then the first token's logits: seconds to the
// replay's end (-1 when it failed), and in first_token_s to the first token's.
double restore_once(KvBenchRun& r, LogDevice& dev, bool cold, double* first_token_s) {
    const int32_t probe = r.toks.back();
    if (cold) drop_cache(r.dir + "/restore.kvlog");
    KvLogSync sync(dev);
    KvSeq seq;
    const double s = now_s();
    auto log = KvLog::open(sync, r.dir, "restore", r.id, &r.pool, &seq);
    const double done = now_s() - s;
    if (!log) {
        std::fprintf(stderr, "duet: restore: %s\n", log.error().message.c_str());
        return -1;
    }
    SeqBatch b{&seq, &probe, 1, false};
    std::vector<float> l;
    (void)r.be.forward({&b, 1}, l);
    *first_token_s = now_s() - s;
    seq.release(r.pool);
    return done;
}

// Restores, page cache warm and cold (the median of reps each), against the disk's
// sequential read rate.
void measure_restore(KvBenchRun& r, LogDevice& dev, uint64_t log_bytes) {
    std::vector<double> warm, cold, warm_ft, cold_ft;
    {
        double ft = 0;
        restore_once(r, dev, false, &ft);  // warms the page cache
    }
    for (int i = 0; i < r.a.reps; ++i) {
        double ft = 0;
        warm.push_back(restore_once(r, dev, false, &ft));
        warm_ft.push_back(ft);
        cold.push_back(restore_once(r, dev, true, &ft));
        cold_ft.push_back(ft);
    }
    const auto [disk_cold, disk_warm] = disk_read_rate(r.dir, (std::max<uint64_t>(log_bytes, 256u << 20) + (4u << 20) - 1) / (4u << 20) * (4u << 20));
    r.out["restore_warm_s"] = median(warm);
    r.out["restore_cold_s"] = median(cold);
    r.out["restore_warm_first_token_s"] = median(warm_ft);
    r.out["restore_cold_first_token_s"] = median(cold_ft);
    r.out["restore_warm_mb_s"] = log_bytes / 1e6 / median(warm);
    r.out["restore_cold_mb_s"] = log_bytes / 1e6 / median(cold);
    r.out["disk_seq_read_cold_mb_s"] = disk_cold;
    r.out["disk_seq_read_warm_mb_s"] = disk_warm;
}

// One writer's appends to its own log until `seconds` after start: runs of `per`
// tokens of the prefilled context, from its start again when they reach its end.
uint64_t append_until(KvBenchRun& r, KvLog& log, int per, double start) {
    uint64_t at = 0, k = 0;
    while (now_s() - start < r.a.seconds) {
        if (at + per > static_cast<uint64_t>(r.a.tokens)) {
            if (!log.truncate(0).ok()) break;
            at = 0;
        }
        if (!log.append(r.pool, r.seq, r.toks, at, per).ok()) break;
        at += per;
        ++k;
    }
    return k;
}

// Durable appends: `writers` writers, each its own log (a context), for `seconds`;
// no figure when a log cannot be created.
void append_figure(KvBenchRun& r, bool group, int writers, int per, LogDevice& device, const std::string& label,
                   std::vector<AppendFigure>& figs) {
    KvLogSync sync(device, group);
    std::vector<std::unique_ptr<KvLog>> logs;
    for (int w = 0; w < writers; ++w) {
        const std::string name = fmt::format("app-{}-{}-{}-{}", label, group ? "g" : "s", writers, w);
        ::unlink((r.dir + "/" + name + ".kvlog").c_str());
        auto log = KvLog::create(sync, r.dir, name, r.id, r.layout);
        if (!log) {
            std::fprintf(stderr, "duet: %s\n", log.error().message.c_str());
            return;
        }
        logs.push_back(std::move(*log));
    }
    std::atomic<uint64_t> total{0};
    std::vector<std::thread> ts;
    const double start = now_s();
    for (int w = 0; w < writers; ++w)
        ts.emplace_back([&, w] {
            total.fetch_add(append_until(r, *logs[w], per, start), std::memory_order_relaxed);  // read after join()
        });
    for (auto& t : ts) t.join();
    const double el = now_s() - start;
    AppendFigure f;
    f.mode = group ? "group commit" : "fdatasync per append";
    if (!label.empty() && label != "uring") f.mode += " (" + label + ")";
    f.writers = writers;
    f.tokens_per_append = per;
    f.appends_per_s = total.load(std::memory_order_relaxed) / el;
    const double rec = 48 + 16 + per * (4.0 + r.layout.bytes_per_token());
    f.mb_per_s = f.appends_per_s * rec / 1e6;
    f.bytes_per_token = rec / per;
    figs.push_back(f);
    for (auto& l : logs) ::unlink(l->path().c_str());
}

// Per append and group commit over io_uring at 1 / 4 / 16 writers, then the
// pwritev + fdatasync reference.
std::vector<AppendFigure> measure_appends(KvBenchRun& r, LogDevice& uring) {
    std::vector<AppendFigure> figs;
    SyncLogDevice sync_dev;
    for (int per : {1, 16})
        for (int writers : {1, 4, 16}) {
            append_figure(r, false, writers, per, uring, "uring", figs);
            append_figure(r, true, writers, per, uring, "uring", figs);
        }
    append_figure(r, false, 1, 16, sync_dev, "pwritev", figs);
    return figs;
}

// O_DIRECT for the same 16-token records: staged into an aligned buffer, padded
// to 4 KiB, then pwrite + fdatasync (what the log would have to do).
void measure_direct(KvBenchRun& r) {
    double direct_aps = 0;
    const std::string path = r.dir + "/direct.bin";
    const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_DIRECT | O_CLOEXEC, 0600);
    if (fd >= 0) {
        auto rows = kv_rows_iov(r.pool, r.seq.blocks(), 0, 16);
        size_t bytes = 64 + 16 * 4;
        for (const iovec& v : *rows) bytes += v.iov_len;
        const size_t padded = (bytes + 4095) / 4096 * 4096;
        void* buf = std::aligned_alloc(4096, padded);
        std::memset(buf, 0, padded);
        uint64_t k = 0, off = 0;
        const double s = now_s();
        while (now_s() - s < r.a.seconds) {
            uint8_t* p = static_cast<uint8_t*>(buf) + 64 + 64;
            for (const iovec& v : *rows) {
                std::memcpy(p, v.iov_base, v.iov_len);
                p += v.iov_len;
            }
            if (::pwrite(fd, buf, padded, static_cast<off_t>(off)) != static_cast<ssize_t>(padded)) break;
            if (::fdatasync(fd) != 0) break;
            off += padded;
            ++k;
        }
        direct_aps = k / (now_s() - s);
        std::free(buf);
        ::close(fd);
        r.out["direct_record_bytes"] = padded;
    }
    ::unlink(path.c_str());
    r.out["direct_appends_per_s"] = direct_aps;
}

// Everything measured on the prefilled context, in order: the prefill itself, its
// log, restores, appends.
Result<std::vector<AppendFigure>> measure_on_context(KvBenchRun& r) {
    if (Status s = measure_prefill(r); !s) return s.error();
    auto dev = UringLogDevice::create();
    if (!dev) return dev.error();
    auto log_bytes = write_restore_log(r, **dev);
    if (!log_bytes) return log_bytes.error();
    measure_restore(r, **dev, *log_bytes);
    std::vector<AppendFigure> figs = measure_appends(r, **dev);
    measure_direct(r);
    return figs;
}

nlohmann::json appends_json(const std::vector<AppendFigure>& figs) {
    nlohmann::json ja = nlohmann::json::array();
    for (const AppendFigure& f : figs)
        ja.push_back({{"mode", f.mode}, {"writers", f.writers}, {"tokens_per_append", f.tokens_per_append},
                      {"appends_per_s", f.appends_per_s}, {"mb_per_s", f.mb_per_s}, {"bytes_per_token", f.bytes_per_token}});
    return ja;
}

// The Markdown tables, from the figures in `out`.
void print_kv_tables(const KvBenchArgs& a, const Model& m, const nlohmann::json& out,
                     const std::vector<AppendFigure>& figs) {
    const auto fig = [&](const char* key) { return out[key].get<double>(); };
    const uint64_t log_bytes = out["log_bytes"].get<uint64_t>();
    const double prefill_s = fig("prefill_s"), warm = fig("restore_warm_s"), cold = fig("restore_cold_s");
    const double warm_ft = fig("restore_warm_first_token_s"), cold_ft = fig("restore_cold_first_token_s");
    const double kv_mb = static_cast<double>(log_bytes) / 1e6;
    std::printf("## duet bench kv: %s, %d threads, %d-token context (%.1f MB of %s KV in its log)\n\n",
                m.config().name.c_str(), a.threads, a.tokens, kv_mb, a.kv_dtype.c_str());
    std::printf("| restore | seconds | vs re-prefill (%.3f s) | MB/s | floor |\n|---|---|---|---|---|\n", prefill_s);
    std::printf("| warm (page cache) | %.4f | %.0fx | %.0f | page-cache read %.0f MB/s |\n", warm,
                prefill_s / warm, log_bytes / 1e6 / warm, fig("disk_seq_read_warm_mb_s"));
    std::printf("| cold (fadvise DONTNEED) | %.4f | %.0fx | %.0f | disk sequential read %.0f MB/s |\n", cold,
                prefill_s / cold, log_bytes / 1e6 / cold, fig("disk_seq_read_cold_mb_s"));
    std::printf("| warm + first token | %.4f | %.0fx | | |\n", warm_ft, prefill_s / warm_ft);
    std::printf("| cold + first token | %.4f | %.0fx | | |\n\n", cold_ft, prefill_s / cold_ft);
    std::printf("| durable appends | writers | tokens/append | appends/s | MB/s | bytes/token on disk |\n|---|---|---|---|---|---|\n");
    for (const AppendFigure& f : figs)
        std::printf("| %s | %d | %d | %.0f | %.1f | %.0f |\n", f.mode.c_str(), f.writers, f.tokens_per_append,
                    f.appends_per_s, f.mb_per_s, f.bytes_per_token);
    std::printf("| O_DIRECT, staged + padded to 4 KiB, fdatasync | 1 | 16 | %.0f | | |\n\n", fig("direct_appends_per_s"));
    std::printf("CRC32C %.1f GB/s, memcpy %.1f GB/s; fingerprints of the %.0f MB model %.1f ms; log writes %.0f MB/s\n",
                fig("crc32c_gb_s"), fig("memcpy_gb_s"), m.file().file_size() / 1e6, fig("fingerprint_ms"),
                fig("log_write_mb_s"));
}

}  // namespace

int cmd_bench_kv(const KvBenchArgs& a) {
    auto model = Model::load(a.model);
    if (!model) {
        std::fprintf(stderr, "duet: %s\n", model.error().message.c_str());
        return 1;
    }
    const Model& m = **model;
    auto dt = parse_kv_dtype(a.kv_dtype);
    if (!dt) {
        std::fprintf(stderr, "duet: --kv-dtype: %s\n", dt.error().message.c_str());
        return 2;
    }
    std::string dir = a.dir;
    if (dir.empty()) {
        char t[] = "/var/tmp/duet-bench-kv-XXXXXX";
        if (!::mkdtemp(t)) {
            std::perror("duet: mkdtemp");
            return 1;
        }
        dir = t;
    }
    nlohmann::json out;
    out["model"] = m.config().name;
    out["threads"] = a.threads;
    out["dir"] = dir;
    const KvIdentity id = measure_fingerprints(m, out);
    measure_crc(out);

    const KvLayout layout = kv_layout(m, *dt);
    const int32_t bt = layout.block_tokens;
    const int32_t n_blocks = 2 * ((a.tokens + bt - 1) / bt) + 64;
    auto pool = KvPool::create(layout, n_blocks);
    if (!pool) {
        std::fprintf(stderr, "duet: %s\n", pool.error().message.c_str());
        return 1;
    }
    ThreadPool threads(a.threads);
    CpuBackend be(m, **pool, threads, cpu::isa_best());
    KvSeq seq;
    KvBenchRun run{a, dir, id, layout, **pool, be, prompt_ids(a.tokens), seq, out};
    auto figs = measure_on_context(run);
    if (!figs) {
        std::fprintf(stderr, "duet: %s\n", figs.error().message.c_str());
        return 1;
    }
    seq.release(**pool);
    ::unlink((dir + "/restore.kvlog").c_str());
    if (a.dir.empty()) ::rmdir(dir.c_str());

    out["appends"] = appends_json(*figs);
    if (a.json) {
        std::printf("%s\n", out.dump(2).c_str());
        return 0;
    }
    print_kv_tables(a, m, out, *figs);
    return 0;
}

}  // namespace duet
