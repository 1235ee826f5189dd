#include "bench/contexts_bench.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>

#include <nlohmann/json.hpp>

#include "base/thread_pool.h"
#include "bench/bench_util.h"
#include "engine/contexts.h"
#include "kv/log_device.h"
#include "model/cpu_backend.h"
#include "model/fingerprint.h"
#include "model/model.h"

namespace duet {

namespace {

using bench::median;
using bench::now_s;

// Evicts a directory's files from the page cache (a cold read after a restart).
void drop_dir_cache(const std::string& dir) {
    for (const auto& e : std::filesystem::directory_iterator(dir))
        if (e.is_regular_file()) bench::drop_cache(e.path().string());
}

std::vector<int32_t> ids(std::mt19937& rng, int n) {
    std::uniform_int_distribution<int32_t> d(100, 40000);
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng);
    return v;
}

struct Bench {
    const Model& model;
    ThreadPool threads;
    std::unique_ptr<KvPool> pool;
    std::unique_ptr<CpuBackend> backend;
    std::unique_ptr<KvCacheManager> kv;
    std::unique_ptr<BackendCompute> compute;
    std::unique_ptr<LogDevice> dev;
    std::unique_ptr<KvLogSync> sync;
    ContextStoreOptions opts;

    Bench(const Model& m, int n_threads, int32_t n_blocks, const std::string& dir) : model(m), threads(n_threads) {
        pool = std::move(KvPool::create(kv_layout(m, KvDtype::F16), n_blocks)).value();
        backend = std::make_unique<CpuBackend>(m, *pool, threads, cpu::isa_best());
        kv = std::make_unique<KvCacheManager>(*pool);
        compute = std::make_unique<BackendCompute>(*backend, *kv, 512);
        opts.dir = dir;
        opts.id = {model_fingerprint(m.file()), tokenizer_fingerprint(m.file()), m.config().n_vocab};
    }
    Result<std::unique_ptr<ContextStore>> open() { return ContextStore::open(*pool, *sync, *compute, opts); }
    // The reference: one fresh prefill of `tokens` (passes of 512), its seconds.
    double prefill_s(const std::vector<int32_t>& tokens) {
        KvSeq seq;
        std::vector<float> last;
        const double t0 = now_s();
        Status st = compute->extend(seq, tokens, last);
        const double t = now_s() - t0;
        seq.release(*pool);
        if (!st) std::fprintf(stderr, "duet bench contexts: prefill: %s\n", st.error().message.c_str());
        return t;
    }
};

Status bench_edit(Bench& b, ContextStore& s, const ContextBenchArgs& a, nlohmann::json& out) {
    std::mt19937 rng(1);
    const std::vector<int32_t> base = ids(rng, a.tokens);
    if (auto r = s.create("edit", base, true); !r) return r.error();
    std::vector<double> edit, redo;
    ContextUsage u;
    for (int i = 0; i < a.reps; ++i) {
        const std::vector<int32_t> fresh = ids(rng, 16);
        u = {};
        const double t0 = now_s();
        if (auto r = s.edit("edit", a.tokens - 16, fresh, &u); !r) return r.error();
        if (auto l = s.next_logits("edit", &u); !l) return l.error();
        edit.push_back(now_s() - t0);
        std::vector<int32_t> all = *s.tokens("edit");
        all.insert(all.end(), fresh.begin(), fresh.end());  // the reference re-prefills tokens + 16
        redo.push_back(b.prefill_s(all));
    }
    out["edit_s"] = median(edit);
    out["edit_reprefill_s"] = median(redo);
    out["edit_speedup"] = median(redo) / median(edit);
    out["edit_prefilled_tokens"] = u.prefilled;
    return s.remove("edit");
}

Status bench_restore(Bench& b, const ContextBenchArgs& a, nlohmann::json& out) {
    std::mt19937 rng(2);
    const std::vector<int32_t> t = ids(rng, a.restore_tokens);
    {
        auto s = b.open();
        if (!s) return s.error();
        if (auto r = (*s)->create("restore", t, true); !r) return r.error();
    }
    std::vector<double> restore, cold;
    ContextUsage u;
    for (int i = 0; i < a.reps; ++i) {
        drop_dir_cache(b.opts.dir);
        u = {};
        const double t0 = now_s();
        auto s = b.open();  // the restart: the store lists the log; the KV is read on first use
        if (!s) return s.error();
        if (auto l = (*s)->next_logits("restore", &u); !l) return l.error();
        restore.push_back(now_s() - t0);
        cold.push_back(b.prefill_s(t));
    }
    out["restore_s"] = median(restore);
    out["restore_cold_prefill_s"] = median(cold);
    out["restore_speedup"] = median(cold) / median(restore);
    out["restore_restored_tokens"] = u.restored;
    out["restore_prefilled_tokens"] = u.prefilled;
    auto s = b.open();
    if (!s) return s.error();
    out["restore_disk_bytes"] = (*s)->info("restore")->disk_bytes;
    return (*s)->remove("restore");
}

Status bench_turns(Bench& b, ContextStore& s, const ContextBenchArgs& a, nlohmann::json& out) {
    std::mt19937 rng(3);
    std::vector<int32_t> history;
    if (auto r = s.create("chat", {}, true); !r) return r.error();
    double ctx_s = 0, resend_s = 0;
    int64_t ctx_tokens = 0, resend_tokens = 0;
    for (int turn = 0; turn < a.turns; ++turn) {
        const std::vector<int32_t> user = ids(rng, a.user_tokens);
        history.insert(history.end(), user.begin(), user.end());
        ContextUsage u;
        const double t0 = now_s();
        if (auto r = s.append("chat", user, &u); !r) return r.error();
        if (auto l = s.next_logits("chat", &u); !l) return l.error();
        ctx_s += now_s() - t0;
        ctx_tokens += u.prefilled;
        resend_s += b.prefill_s(history);
        resend_tokens += static_cast<int64_t>(history.size());
        // The reply (as a server would have generated it) joins both.
        const std::vector<int32_t> reply = ids(rng, a.reply_tokens);
        history.insert(history.end(), reply.begin(), reply.end());
        ContextUsage ur;
        if (auto r = s.append("chat", reply, &ur); !r) return r.error();
        ctx_tokens += ur.prefilled;  // a server's decode computes these; counted here all the same
    }
    out["turns"] = a.turns;
    out["turns_context_ttft_total_s"] = ctx_s;
    out["turns_resend_ttft_total_s"] = resend_s;
    out["turns_context_prefilled_tokens"] = ctx_tokens;
    out["turns_resend_prefilled_tokens"] = resend_tokens;
    return s.remove("chat");
}

void print_markdown(const nlohmann::json& o) {
    std::printf("| figure | contexts | reference | ratio |\n|---|---:|---:|---:|\n");
    std::printf("| edit %d tokens: last 16 replaced + next token, ms (vs re-prefill %d) | %.1f | %.1f | %.1fx |\n",
                o["tokens"].get<int>(), o["tokens"].get<int>() + 16, o["edit_s"].get<double>() * 1e3,
                o["edit_reprefill_s"].get<double>() * 1e3, o["edit_speedup"].get<double>());
    std::printf("| restart restore %d tokens + next token, ms (vs cold prefill) | %.1f | %.1f | %.1fx |\n",
                o["restore_tokens"].get<int>(), o["restore_s"].get<double>() * 1e3,
                o["restore_cold_prefill_s"].get<double>() * 1e3, o["restore_speedup"].get<double>());
    std::printf("| %d turns: total time to first tokens, s (vs resending the history) | %.2f | %.2f | %.1fx |\n",
                o["turns"].get<int>(), o["turns_context_ttft_total_s"].get<double>(),
                o["turns_resend_ttft_total_s"].get<double>(),
                o["turns_resend_ttft_total_s"].get<double>() / o["turns_context_ttft_total_s"].get<double>());
    std::printf("| %d turns: tokens computed (vs resending the history) | %lld | %lld | %.1fx |\n",
                o["turns"].get<int>(), static_cast<long long>(o["turns_context_prefilled_tokens"].get<int64_t>()),
                static_cast<long long>(o["turns_resend_prefilled_tokens"].get<int64_t>()),
                static_cast<double>(o["turns_resend_prefilled_tokens"].get<int64_t>()) /
                    static_cast<double>(o["turns_context_prefilled_tokens"].get<int64_t>()));
    std::printf("\nedit: %lld tokens computed; restore: %lld read from the log, %lld computed; log %.1f MB\n",
                static_cast<long long>(o["edit_prefilled_tokens"].get<int64_t>()),
                static_cast<long long>(o["restore_restored_tokens"].get<int64_t>()),
                static_cast<long long>(o["restore_prefilled_tokens"].get<int64_t>()),
                static_cast<double>(o["restore_disk_bytes"].get<uint64_t>()) / 1e6);
}

}  // namespace

int cmd_bench_contexts(const ContextBenchArgs& a) {
    auto fail = [](const std::string& m) {
        std::fprintf(stderr, "duet bench contexts: %s\n", m.c_str());
        return 1;
    };
    auto model = Model::load(a.model);
    if (!model) return fail(model.error().message);
    if (a.restore_tokens + 64 > (*model)->config().n_ctx_train || a.tokens + 16 > (*model)->config().n_ctx_train)
        return fail(
            fmt::format("--tokens / --restore-tokens: at most the model's {} tokens", (*model)->config().n_ctx_train));
    std::string dir = a.dir;
    if (dir.empty()) {
        char t[] = "/var/tmp/duet-bench-contexts-XXXXXX";
        if (!::mkdtemp(t)) return fail("cannot make a directory under /var/tmp");
        dir = t;
    }
    const int64_t longest = std::max<int64_t>(
        {a.tokens + 16, a.restore_tokens, static_cast<int64_t>(a.turns) * (a.user_tokens + a.reply_tokens)});
    const auto blocks = static_cast<int32_t>(3 * (longest / 16 + 2));
    Bench b(**model, a.threads, blocks, dir);
    auto dev = UringLogDevice::create();
    if (!dev) return fail(dev.error().message);
    b.dev = std::move(dev).value();
    b.sync = std::make_unique<KvLogSync>(*b.dev);
    nlohmann::json out = {{"model", a.model},
                          {"threads", a.threads},
                          {"tokens", a.tokens},
                          {"restore_tokens", a.restore_tokens},
                          {"dir", dir}};
    {
        auto s = b.open();
        if (!s) return fail(s.error().message);
        if (Status st = bench_edit(b, **s, a, out); !st) return fail(st.error().message);
        if (Status st = bench_turns(b, **s, a, out); !st) return fail(st.error().message);
    }
    if (Status st = bench_restore(b, a, out); !st) return fail(st.error().message);
    if (a.dir.empty()) std::filesystem::remove_all(dir);
    if (a.json)
        std::printf("%s\n", out.dump(2).c_str());
    else
        print_markdown(out);
    return 0;
}

}  // namespace duet
