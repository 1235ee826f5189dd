#include "engine/contexts.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>

namespace duet {

namespace {

uint64_t wall_ns() {
    timespec ts{};
    clock_gettime(CLOCK_REALTIME, &ts);
    return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

uint64_t file_size_of(const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

bool ends_with(const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::vector<std::string> dir_entries(const std::string& dir) {
    std::vector<std::string> out;
    if (DIR* d = ::opendir(dir.c_str())) {
        while (dirent* e = ::readdir(d)) out.emplace_back(e->d_name);
        ::closedir(d);
    }
    std::sort(out.begin(), out.end());
    return out;
}

Status make_dir(const std::string& dir) {
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
        return make_error("{}: cannot create: {}", dir, std::strerror(errno));
    return {};
}

}  // namespace

// ---------------------------------------------------------------- BackendCompute

Status BackendCompute::extend(KvSeq& seq, std::span<const int32_t> tokens, std::vector<float>& last) {
    const auto n = static_cast<int64_t>(tokens.size());
    if (seq.n_tokens() >= n)
        return make_error(ErrorKind::Invalid, "nothing to compute: the KV already holds {} of {} positions",
                          seq.n_tokens(), n);
    std::vector<float> logits;
    while (seq.n_tokens() < n) {
        const int64_t from = seq.n_tokens();
        SeqBatch b{&seq, tokens.data() + from, static_cast<int32_t>(std::min(budget_, n - from)), false};
        std::span<SeqBatch> pass(&b, 1);
        if (Status st = kv_.reserve(pass); !st) return st;
        if (Status st = backend_.forward(pass, logits); !st) {
            kv_.unreserve(pass);
            return st;
        }
    }
    last = std::move(logits);
    return {};
}

// ---------------------------------------------------------------- the store

Result<std::unique_ptr<ContextStore>> ContextStore::open(KvPool& pool, KvLogSync& sync, ContextCompute& compute,
                                                         const ContextStoreOptions& o) {
    if (o.dir.empty()) return make_error("contexts: no directory");
    if (Status st = make_dir(o.dir); !st) return st.error();
    if (Status st = make_dir(o.dir + "/spill"); !st) return st.error();
    std::unique_ptr<ContextStore> s(new ContextStore(pool, sync, compute, o));
    if (Status st = s->recover(); !st) return st.error();
    // Pinned contexts are resident from the start (their blocks published in serving).
    for (auto& [id, c] : s->contexts_)
        if (c->pinned)
            if (Status st = s->make_resident(*c, nullptr); !st)
                std::fprintf(stderr, "duet: pinned context '%s' not restored: %s\n", id.c_str(),
                             st.error().message.c_str());
    s->count_contexts();
    return s;
}

ContextStore::~ContextStore() {
    for (auto& [id, c] : contexts_) c->seq.release(pool_);
}

Status ContextStore::recover() {
    // C6: the contexts that are not durable, from the table (a front that died left
    // them there), not resident.
    if (o_.table)
        for (shm::ContextRecord& r : o_.table->records()) {
            if (!check_context_name(r.id)) {  // not something a put writes
                o_.table->erase(r.id);
                continue;
            }
            auto c = std::make_unique<Context>();
            c->id = r.id;
            c->tokens = std::move(r.tokens);
            c->pinned = r.pinned;
            c->created_ns = r.created_ns;
            c->used_ns = wall_ns();
            contexts_.emplace(c->id, std::move(c));
        }
    // Spills of the last run whose context is gone (it was not durable), and
    // half-written ones.
    for (const std::string& f : dir_entries(o_.dir + "/spill"))
        if ((ends_with(f, ".kvblob") && !contexts_.count(f.substr(0, f.size() - 7))) ||
            f.find(".kvblob.tmp") != std::string::npos)
            ::unlink((o_.dir + "/spill/" + f).c_str());
    const std::vector<std::string> files = dir_entries(o_.dir);
    for (const std::string& f : files) {
        if (!ends_with(f, ".kvlog")) continue;
        const std::string id = f.substr(0, f.size() - 6);
        if (!check_context_name(id)) {
            refused_.emplace_back(f, "not a context's log name");
            continue;
        }
        LogScan scan;
        auto log = KvLog::open(sync_, o_.dir, id, o_.id, nullptr, nullptr, &scan, o_.log);
        if (!log) {
            refused_.emplace_back(f, log.error().message);
            continue;
        }
        auto c = std::make_unique<Context>();
        c->id = id;
        c->tokens = scan.tokens;
        c->durable = true;
        c->pinned = std::find(files.begin(), files.end(), id + ".pin") != files.end();
        c->log = std::move(log).value();
        c->created_ns = c->used_ns = wall_ns();
        if (contexts_.count(id)) {  // a record too (a durable context never has one): the log wins
            if (o_.table) o_.table->erase(id);
            contexts_.erase(id);
        }
        contexts_.emplace(id, std::move(c));
    }
    // Checkpoint blobs and pins whose log is gone (a remove interrupted between unlinks).
    for (const std::string& f : files) {
        if (!ends_with(f, ".kvblob") && !ends_with(f, ".pin")) continue;
        const std::string stem = context_of_file(f);
        if (stem.empty()) continue;  // not a context's file: left alone
        if (!contexts_.count(stem) && std::find(files.begin(), files.end(), stem + ".kvlog") == files.end())
            ::unlink((o_.dir + "/" + f).c_str());
    }
    return {};
}

// Counters for /metrics: relaxed, nothing is published with them.
void ContextStore::count(const ContextUsage& u) {
    stats_.restored_tokens.fetch_add(static_cast<uint64_t>(u.restored), std::memory_order_relaxed);
    stats_.reused_tokens.fetch_add(static_cast<uint64_t>(u.reused), std::memory_order_relaxed);
    stats_.prefilled_tokens.fetch_add(static_cast<uint64_t>(u.prefilled), std::memory_order_relaxed);
}

void ContextStore::count_contexts() {
    uint64_t resident = 0;
    for (const auto& [id, c] : contexts_) resident += c->resident ? 1 : 0;
    stats_.contexts.store(contexts_.size(), std::memory_order_relaxed);
    stats_.resident.store(resident, std::memory_order_relaxed);
}

// An operation's usage: counted for /metrics and added to the caller's when it ends
// (under the store's lock).
struct ContextStore::Tally {
    ContextStore& s;
    ContextUsage* out;
    ContextUsage u;
    Tally(ContextStore& store, ContextUsage* caller) : s(store), out(caller) {}
    ~Tally() {
        s.count(u);
        s.count_contexts();
        if (out) {
            out->restored += u.restored;
            out->reused += u.reused;
            out->prefilled += u.prefilled;
        }
    }
};

Result<ContextStore::Context*> ContextStore::find(const std::string& id) {
    auto it = contexts_.find(id);
    if (it == contexts_.end()) return make_error(ErrorKind::NotFound, "no context '{}'", id);
    return it->second.get();
}

Status ContextStore::check_new_id(const std::string& id) {
    if (Status st = check_context_name(id); !st) return make_error(ErrorKind::Invalid, "{}", st.error().message);
    if (contexts_.count(id)) return make_error(ErrorKind::Exists, "context '{}' exists", id);
    for (const auto& [f, why] : refused_)
        if (f == id + ".kvlog")
            return make_error(ErrorKind::Exists, "context '{}' has a log on disk that was refused: {}", id, why);
    if (contexts_.size() >= o_.max_contexts)
        return make_error(ErrorKind::Limit, "{} contexts, the most this server keeps (--contexts-max)",
                          contexts_.size());
    return {};
}

Status ContextStore::check_disk(int64_t positions) const {
    if (o_.max_disk_bytes == 0 || positions <= 0) return {};
    uint64_t used = 0;
    for (const auto& [id, c] : contexts_)
        if (c->durable) used += info_of(*c).disk_bytes;
    const uint64_t more = static_cast<uint64_t>(positions) * (pool_.layout().bytes_per_token() + 4) + 64;
    if (used + more > o_.max_disk_bytes)
        return make_error(ErrorKind::Limit,
                          "the contexts' logs take {} bytes; {} more would pass --contexts-disk-max {}", used, more,
                          o_.max_disk_bytes);
    return {};
}

std::string ContextStore::spill_path(const std::string& id) const { return o_.dir + "/spill/" + id + ".kvblob"; }

Status ContextStore::record(const Context& c, const std::vector<int32_t>* tokens) {
    if (c.durable || !o_.table) return {};
    shm::ContextRecord r;
    r.id = c.id;
    r.tokens = tokens ? *tokens : c.tokens;
    r.pinned = c.pinned;
    r.created_ns = c.created_ns;
    return o_.table->put(r);
}

Status ContextStore::check_record(bool durable, size_t n_tokens) const {
    if (durable || !o_.table || n_tokens <= o_.table->max_tokens()) return {};
    return make_error(ErrorKind::Invalid, "a context of {} tokens: this server's contexts hold at most {} (--ctx)",
                      n_tokens, o_.table->max_tokens());
}

ContextInfo ContextStore::info_of(const Context& c) const {
    ContextInfo i;
    i.id = c.id;
    i.n_tokens = static_cast<int64_t>(c.tokens.size());
    i.durable = c.durable;
    i.resident = c.resident;
    i.pinned = c.pinned;
    if (c.log) {
        i.disk_bytes = c.log->file_bytes();
        if (c.log->header().generation > 0)
            i.disk_bytes += file_size_of(fmt::format("{}/{}.{}.kvblob", o_.dir, c.id, c.log->header().generation));
    } else if (!c.resident) {
        i.disk_bytes = file_size_of(spill_path(c.id));
    }
    i.created_ns = c.created_ns;
    i.used_ns = c.used_ns;
    return i;
}

void ContextStore::touch(Context& c) {
    c.lru = ++clock_;
    c.used_ns = wall_ns();
}

ContextStore::Context* ContextStore::lru_victim(const Context* keep) {
    Context* victim = nullptr;
    for (auto& [id, o] : contexts_)
        if (o.get() != keep && o->resident && !o->pinned && o->seq.n_tokens() > 0 && (!victim || o->lru < victim->lru))
            victim = o.get();
    return victim;
}

bool ContextStore::make_room(const Context& keep, int64_t blocks) {
    while (pool_.allocator().n_available() < blocks) {
        Context* victim = lru_victim(&keep);  // C4
        if (!victim || !evict_one(*victim)) return false;
    }
    return true;
}

size_t ContextStore::evict_idle(const std::string& keep, const std::function<bool()>& enough) {
    std::lock_guard<std::mutex> lock(mu_);
    auto kept = contexts_.find(keep);
    const Context* k = kept == contexts_.end() ? nullptr : kept->second.get();
    size_t n = 0;
    while (!enough()) {
        Context* victim = lru_victim(k);
        if (!victim || !evict_one(*victim)) break;
        ++n;
    }
    count_contexts();
    return n;
}

Status ContextStore::make_resident(Context& c, ContextUsage* usage) {
    if (c.resident) return {};
    const int64_t bt = pool_.layout().block_tokens;
    const auto need = (static_cast<int64_t>(c.tokens.size()) + bt - 1) / bt;
    if (!make_room(c, need))
        return make_error(ErrorKind::NoKvBlocks, "context '{}' needs {} KV blocks to be restored, {} of {} are free",
                          c.id, need, pool_.allocator().n_available(), pool_.allocator().n_blocks());
    const auto t0 = std::chrono::steady_clock::now();
    KvSeq seq;
    if (c.durable) {
        auto scan = kv_log_scan(c.log->path(), &o_.id, &pool_, &seq);
        if (!scan) {
            stage_done();
            return scan.error();
        }
        if (scan->tokens != c.tokens) {
            seq.release(pool_);
            stage_done();
            return make_error("context '{}': its log holds {} tokens, not the {} acknowledged", c.id,
                              scan->tokens.size(), c.tokens.size());
        }
    } else if (!c.tokens.empty() && ::access(spill_path(c.id).c_str(), F_OK) == 0) {
        auto im = blob_import(spill_path(c.id), o_.id, pool_, seq);
        if (!im) {
            stage_done();
            return im.error();
        }
        // Truncated while spilled: the blob holds more than the context now has (and,
        // after a crash of the store's process, maybe other tokens past those its
        // record has: only the positions both agree on are kept).
        const size_t n = std::min(im->tokens.size(), c.tokens.size());
        const size_t same =
            static_cast<size_t>(std::mismatch(im->tokens.begin(), im->tokens.begin() + static_cast<std::ptrdiff_t>(n),
                                              c.tokens.begin())
                                    .first -
                                im->tokens.begin());
        seq.truncate(pool_, std::min(seq.n_tokens(), static_cast<int64_t>(same)));
    }
    // Read into the mirror: into the arena before anyone reads them (S2, S3).
    Status out = stage_out(seq, 0);
    stage_done();
    if (!out) {
        seq.release(pool_);
        return out;
    }
    if (!c.durable && !c.tokens.empty()) ::unlink(spill_path(c.id).c_str());
    // else: a context from the table (C6) with no spill: resident with no KV, every
    // position computed on use.
    if (usage) usage->restored += seq.n_tokens();
    stats_.restore.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    c.seq = std::move(seq);
    c.resident = true;
    compute_.resident(c.seq, c.tokens);
    return {};
}

Status ContextStore::stage_in(const KvSeq& seq, uint64_t first, uint64_t n) {
    if (!o_.stage) return {};
    return o_.stage->pull(blocks_of_positions(seq.blocks(), pool_.layout().block_tokens, first, n));
}

Status ContextStore::stage_out(const KvSeq& seq, uint64_t first) {
    if (!o_.stage || seq.n_tokens() <= static_cast<int64_t>(first)) return {};
    return o_.stage->push(blocks_of_positions(seq.blocks(), pool_.layout().block_tokens, first,
                                              static_cast<uint64_t>(seq.n_tokens()) - first));
}

void ContextStore::stage_done() {
    if (o_.mirror) o_.mirror->release();
}

Status ContextStore::evict_one(Context& c) {
    if (!c.resident) return {};
    if (!c.durable && c.seq.n_tokens() > 0) {
        // Spilled whole: the KV of every position (positions past seq.n_tokens()
        // were never computed and are computed again on restore).
        Status in = stage_in(c.seq, 0, static_cast<uint64_t>(c.seq.n_tokens()));
        auto w = in ? blob_write(spill_path(c.id), o_.id, pool_, c.seq, c.tokens, 0,
                                 static_cast<uint64_t>(c.seq.n_tokens()))
                    : Result<BlobHeader>(in.error());
        stage_done();
        if (!w) return w.error();
    }
    c.seq.release(pool_);
    c.resident = false;
    stats_.evictions.fetch_add(1, std::memory_order_relaxed);
    return {};
}

Status ContextStore::compute(Context& c, ContextUsage* usage) {
    const int64_t had = c.seq.n_tokens();
    for (;;) {
        Status st = compute_.extend(c.seq, c.tokens, c.logits);
        if (st) break;
        if (st.kind() != ErrorKind::NoKvBlocks) {
            c.seq.truncate(pool_, had);
            c.logits_valid = false;
            return st;
        }
        // C4: other contexts give way, one block more each time (the pass needs at
        // least one more than is free).
        if (!make_room(c, pool_.allocator().n_available() + 1)) {
            c.seq.truncate(pool_, had);
            c.logits_valid = false;
            return st;
        }
    }
    if (usage) {
        const int64_t again = std::min(had, compute_.recomputed());
        usage->prefilled += c.seq.n_tokens() - had + again;
        usage->reused += had - again;
    }
    c.logits_valid = !c.logits.empty();
    return {};
}

// c resident; tokens appended to c.tokens, computed and logged, or nothing changes.
Status ContextStore::append_locked(Context& c, std::span<const int32_t> tokens, ContextUsage* usage) {
    if (tokens.empty()) return {};
    if (Status st = check_record(c.durable, c.tokens.size() + tokens.size()); !st) return st;
    const size_t old = c.tokens.size();
    c.tokens.insert(c.tokens.end(), tokens.begin(), tokens.end());
    ContextUsage u;
    Status st = compute(c, &u);
    if (st && c.log) {
        const auto t0 = std::chrono::steady_clock::now();
        st = stage_in(c.seq, old, tokens.size());
        if (st) st = c.log->append(pool_, c.seq, c.tokens, old, tokens.size());
        stage_done();
        stats_.persist.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    if (st) st = record(c);
    if (!st) {
        c.tokens.resize(old);
        c.seq.truncate(pool_, std::min<int64_t>(c.seq.n_tokens(), static_cast<int64_t>(old)));
        c.logits_valid = false;
        return st;
    }
    if (c.log && c.log->should_compact()) {
        Status cs = stage_in(c.seq, 0, c.tokens.size());
        if (cs) cs = c.log->compact(pool_, c.seq, c.tokens);
        stage_done();
        if (!cs)
            std::fprintf(stderr, "duet: context '%s': compaction failed (the log stays as it was): %s\n", c.id.c_str(),
                         cs.error().message.c_str());
    }
    if (usage) {
        usage->prefilled += u.prefilled;
        usage->reused += u.reused;
    }
    return {};
}

Result<std::unique_ptr<ContextStore::Context>> ContextStore::new_context(const std::string& id, bool durable,
                                                                         bool pin) {
    auto c = std::make_unique<Context>();
    c->id = id;
    c->durable = durable;
    c->pinned = pin;
    c->resident = true;
    c->created_ns = wall_ns();
    touch(*c);
    if (durable) {
        auto log = KvLog::create(sync_, o_.dir, id, o_.id, pool_.layout(), o_.log);
        if (!log) return log.error();
        c->log = std::move(log).value();
    }
    return c;
}

Result<ContextInfo> ContextStore::create(const std::string& id, std::span<const int32_t> tokens, bool durable,
                                         ContextUsage* caller_usage, bool pin) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, caller_usage);
    ContextUsage* usage = &tally.u;
    if (Status st = check_new_id(id); !st) return st.error();
    if (durable)
        if (Status st = check_disk(static_cast<int64_t>(tokens.size())); !st) return st.error();
    auto made = new_context(id, durable, pin);
    if (!made) return made.error();
    std::unique_ptr<Context> c = std::move(made).value();
    Status st = append_locked(*c, tokens, usage);
    if (st && tokens.empty()) st = record(*c);  // else append_locked put it
    if (!st) {
        c->seq.release(pool_);
        c->log.reset();
        remove_files(id);
        return st.error();
    }
    if (pin && durable) {
        // The pin, durable too: an empty file next to the log, on disk before the OK.
        const std::string pin_path = o_.dir + "/" + id + ".pin";
        const int fd = ::open(pin_path.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0 || ::fsync(fd) != 0 || !fsync_dir_of(pin_path)) {
            const std::string why = std::strerror(errno);
            if (fd >= 0) ::close(fd);
            c->seq.release(pool_);
            c->log.reset();
            remove_files(id);
            return make_error("{}: {}", pin_path, why);
        }
        ::close(fd);
    }
    Context& ref = *c;
    contexts_.emplace(id, std::move(c));
    return info_of(ref);
}

Result<ContextInfo> ContextStore::export_blob(const std::string& id, const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, nullptr);
    auto c = find(id);
    if (!c) return c.error();
    Context& ctx = **c;
    touch(ctx);
    if (Status st = make_resident(ctx, &tally.u); !st) return st.error();
    // A spilled context restores the positions it had computed; the rest are computed now.
    if (ctx.seq.n_tokens() < static_cast<int64_t>(ctx.tokens.size()))
        if (Status st = compute(ctx, &tally.u); !st) return st.error();
    Status in = stage_in(ctx.seq, 0, ctx.tokens.size());
    auto w = in ? blob_write(path, o_.id, pool_, ctx.seq, ctx.tokens, 0, ctx.tokens.size())
                : Result<BlobHeader>(in.error());
    stage_done();
    if (!w) return w.error();
    return info_of(ctx);
}

Result<ContextInfo> ContextStore::import_blob(const std::string& id, const std::string& path, bool durable,
                                              ContextUsage* caller_usage) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, caller_usage);
    if (Status st = check_new_id(id); !st) return st.error();
    // The header first: how many blocks the import needs, and whether it fits at all.
    uint8_t head[kBlobHeaderBytes];
    {
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) return make_error("{}: {}", path, std::strerror(errno));
        const ssize_t got = ::pread(fd, head, sizeof head, 0);
        ::close(fd);
        if (got != static_cast<ssize_t>(sizeof head))
            return make_error(ErrorKind::Invalid, "the blob is {} bytes, shorter than its {}-byte header",
                              got < 0 ? 0 : got, sizeof head);
    }
    auto h = blob_header_decode(head, sizeof head);
    if (!h) return make_error(ErrorKind::Invalid, "{}", h.error().message);
    if (h->first_pos != 0)
        return make_error(ErrorKind::Invalid, "the blob starts at position {}; a context's blob starts at 0",
                          h->first_pos);
    if (o_.max_tokens > 0 && h->n_tokens >= static_cast<uint64_t>(o_.max_tokens))
        return make_error(ErrorKind::Invalid, "the blob holds {} tokens; this server's contexts hold fewer than {} (--ctx)",
                          h->n_tokens, o_.max_tokens);
    if (durable)
        if (Status st = check_disk(static_cast<int64_t>(h->n_tokens)); !st) return st.error();
    Context probe;  // keeps nothing: every resident context may give way
    const int64_t bt = pool_.layout().block_tokens;
    if (!make_room(probe, (static_cast<int64_t>(h->n_tokens) + bt - 1) / bt))
        return make_error(ErrorKind::NoKvBlocks, "the blob's {} tokens need more KV blocks than are free ({} of {})",
                          h->n_tokens, pool_.allocator().n_available(), pool_.allocator().n_blocks());
    const auto t0 = std::chrono::steady_clock::now();
    KvSeq seq;
    auto im = blob_import(path, o_.id, pool_, seq);
    if (!im) {
        stage_done();
        return make_error(ErrorKind::Invalid, "{}", im.error().message);
    }
    // The mirror keeps the rows until the log has them too (stage_done below).
    if (Status st = stage_out(seq, 0); !st) {
        seq.release(pool_);
        stage_done();
        return st.error();
    }
    stats_.restore.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (Status st = check_record(durable, im->tokens.size()); !st) {
        seq.release(pool_);
        stage_done();
        return st.error();
    }
    auto made = new_context(id, durable, false);
    if (!made) {
        seq.release(pool_);
        stage_done();
        return made.error();
    }
    std::unique_ptr<Context> c = std::move(made).value();
    c->tokens = std::move(im->tokens);
    c->seq = std::move(seq);
    if (c->log && !c->tokens.empty()) {
        const auto t1 = std::chrono::steady_clock::now();
        Status st = c->log->append(pool_, c->seq, c->tokens, 0, c->tokens.size());  // the mirror still has them
        stats_.persist.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count());
        stage_done();
        if (!st) {
            c->seq.release(pool_);
            c->log.reset();
            remove_files(id);
            return st.error();
        }
    }
    stage_done();  // no log to write (or written): the mirror's pages go
    if (Status st = record(*c); !st) {
        c->seq.release(pool_);
        return st.error();
    }
    tally.u.restored += c->seq.n_tokens();
    compute_.resident(c->seq, c->tokens);
    Context& ref = *c;
    contexts_.emplace(id, std::move(c));
    return info_of(ref);
}

Result<ContextInfo> ContextStore::append(const std::string& id, std::span<const int32_t> tokens,
                                         ContextUsage* caller_usage) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, caller_usage);
    ContextUsage* usage = &tally.u;
    auto c = find(id);
    if (!c) return c.error();
    touch(**c);
    if ((*c)->durable)
        if (Status st = check_disk(static_cast<int64_t>(tokens.size())); !st) return st.error();
    if (Status st = make_resident(**c, usage); !st) return st.error();
    if (Status st = append_locked(**c, tokens, usage); !st) return st.error();
    return info_of(**c);
}

Result<ContextInfo> ContextStore::append_with_kv(const std::string& id, size_t expect_len,
                                                 std::span<const int32_t> tokens, std::vector<int32_t> blocks,
                                                 int64_t valid, ContextUsage* caller_usage) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, caller_usage);
    struct Drop {  // the references not taken over
        KvPool& pool;
        std::vector<int32_t>& b;
        ~Drop() {
            for (int32_t x : b) pool.allocator().unref(x);
        }
    } drop{pool_, blocks};
    auto c = find(id);
    if (!c) return c.error();
    Context& ctx = **c;
    if (ctx.tokens.size() != expect_len)
        return make_error(ErrorKind::Exists, "context '{}' changed meanwhile ({} tokens, was {})", id,
                          ctx.tokens.size(), expect_len);
    const int64_t bt = pool_.layout().block_tokens;
    const auto total = static_cast<int64_t>(expect_len + tokens.size());
    if (valid < 0 || valid > total || static_cast<int64_t>(blocks.size()) * bt < valid)
        return make_error(ErrorKind::Invalid, "{} blocks holding {} positions for {} tokens", blocks.size(), valid,
                          total);
    touch(ctx);
    if (ctx.durable)
        if (Status st = check_disk(static_cast<int64_t>(tokens.size())); !st) return st.error();
    // Made resident first: its files then hold what they should, and the spill is gone.
    if (Status st = make_resident(ctx, &tally.u); !st) return st.error();
    const auto need = static_cast<size_t>((valid + bt - 1) / bt);
    for (size_t k = need; k < blocks.size(); ++k) pool_.allocator().unref(blocks[k]);  // past `valid`
    blocks.resize(need);
    KvSeq prev = std::move(ctx.seq);
    ctx.seq = KvSeq::adopt(std::exchange(blocks, {}), valid);
    if (Status st = append_locked(ctx, tokens, &tally.u); !st) {
        ctx.seq.release(pool_);
        ctx.seq = std::move(prev);
        return st.error();
    }
    prev.release(pool_);
    return info_of(ctx);
}

Result<ContextInfo> ContextStore::truncate(const std::string& id, int64_t n_tokens) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, nullptr);
    auto c = find(id);
    if (!c) return c.error();
    Context& x = **c;
    if (n_tokens < 0 || n_tokens > static_cast<int64_t>(x.tokens.size()))
        return make_error(ErrorKind::Invalid, "n_tokens {}: context '{}' has {} tokens", n_tokens, id, x.tokens.size());
    touch(x);
    if (Status st = truncate_locked(x, n_tokens); !st) return st.error();
    return info_of(x);
}

Status ContextStore::truncate_locked(Context& x, int64_t n_tokens) {
    if (n_tokens == static_cast<int64_t>(x.tokens.size())) return {};
    if (x.log)
        if (Status st = x.log->truncate(static_cast<uint64_t>(n_tokens)); !st) return st;
    if (!x.durable && o_.table) {
        const std::vector<int32_t> cut(x.tokens.begin(), x.tokens.begin() + n_tokens);
        if (Status st = record(x, &cut); !st) return st;
    }
    x.tokens.resize(static_cast<size_t>(n_tokens));
    if (x.resident) x.seq.truncate(pool_, std::min(x.seq.n_tokens(), n_tokens));
    x.logits_valid = false;
    return {};
}

Result<ContextInfo> ContextStore::edit(const std::string& id, int64_t at, std::span<const int32_t> tokens,
                                       ContextUsage* caller_usage) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, caller_usage);
    ContextUsage* usage = &tally.u;
    auto c = find(id);
    if (!c) return c.error();
    Context& x = **c;
    if (at < 0 || at > static_cast<int64_t>(x.tokens.size()))
        return make_error(ErrorKind::Invalid, "at {}: context '{}' has {} tokens", at, id, x.tokens.size());
    touch(x);
    if (tokens.empty()) {  // an edit that appends nothing is a truncation
        if (Status st = truncate_locked(x, at); !st) return st.error();
        return info_of(x);
    }
    if (x.durable)
        if (Status st = check_disk(static_cast<int64_t>(tokens.size())); !st) return st.error();
    if (Status st = check_record(x.durable, static_cast<size_t>(at) + tokens.size()); !st) return st.error();
    if (Status st = make_resident(x, usage); !st) return st.error();
    // The state before, kept until the edit is durable (C3): a fork shares every
    // block, so the edit's writes copy the blocks they change.
    KvSeq before = x.seq.fork(pool_);
    const std::vector<int32_t> before_tokens = x.tokens;
    x.tokens.resize(static_cast<size_t>(at));
    x.tokens.insert(x.tokens.end(), tokens.begin(), tokens.end());
    x.seq.truncate(pool_, std::min(x.seq.n_tokens(), at));
    ContextUsage u;
    Status st = compute(x, &u);
    // One record (KVLOG.md, APPEND before the end): the log holds the context before
    // or after the edit, whatever happens to the process.
    if (st && x.log) {
        st = stage_in(x.seq, static_cast<uint64_t>(at), tokens.size());
        if (st) st = x.log->append(pool_, x.seq, x.tokens, static_cast<uint64_t>(at), tokens.size());
        stage_done();
    }
    if (st) st = record(x);
    if (!st) {
        x.seq.release(pool_);
        x.seq = std::move(before);
        x.tokens = before_tokens;
        x.logits_valid = false;  // compute may have left the edit's logits there
        return st.error();
    }
    before.release(pool_);
    if (usage) {
        usage->prefilled += u.prefilled;
        usage->reused += u.reused;
    }
    return info_of(x);
}

Result<ContextInfo> ContextStore::fork(const std::string& id, const std::string& new_id, int64_t at, int durable,
                                       ContextUsage* caller_usage) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, caller_usage);
    ContextUsage* usage = &tally.u;
    auto p = find(id);
    if (!p) return p.error();
    Context& parent = **p;
    if (at < 0) at = static_cast<int64_t>(parent.tokens.size());
    if (at > static_cast<int64_t>(parent.tokens.size()))
        return make_error(ErrorKind::Invalid, "at {}: context '{}' has {} tokens", at, id, parent.tokens.size());
    if (Status st = check_new_id(new_id); !st) return st.error();
    if (durable == 1 || (durable < 0 && parent.durable))
        if (Status st = check_disk(at); !st) return st.error();
    touch(parent);
    if (Status st = make_resident(parent, usage); !st) return st.error();
    auto c = std::make_unique<Context>();
    c->id = new_id;
    c->durable = durable < 0 ? parent.durable : durable == 1;
    c->resident = true;
    c->created_ns = wall_ns();
    touch(*c);
    c->tokens.assign(parent.tokens.begin(), parent.tokens.begin() + at);
    c->seq = parent.seq.fork(pool_);  // copy-on-write: writes past the fork point copy first
    c->seq.truncate(pool_, std::min(c->seq.n_tokens(), at));
    if (usage) usage->reused += c->seq.n_tokens();
    auto fail = [&](const Error& e) -> Result<ContextInfo> {
        c->seq.release(pool_);
        c->log.reset();
        remove_files(new_id);
        return e;
    };
    if (c->durable) {
        auto log = KvLog::create(sync_, o_.dir, new_id, o_.id, pool_.layout(), o_.log);
        if (!log) return log.error();
        c->log = std::move(log).value();
    }
    // Positions of the fork the parent had not computed yet (its last, after a
    // truncate) are computed now, so the fork's log holds every position's KV.
    if (c->seq.n_tokens() < at)
        if (Status st = compute(*c, usage); !st) return fail(st.error());
    if (c->log && at > 0) {
        Status st = stage_in(c->seq, 0, static_cast<uint64_t>(at));
        if (st) st = c->log->append(pool_, c->seq, c->tokens, 0, static_cast<uint64_t>(at));
        stage_done();
        if (!st) return fail(st.error());
    }
    if (Status st = record(*c); !st) return fail(st.error());
    Context& ref = *c;
    contexts_.emplace(new_id, std::move(c));
    return info_of(ref);
}

void ContextStore::remove_files(const std::string& id) {
    const std::string log = o_.dir + "/" + id + ".kvlog";
    ::unlink(log.c_str());  // first: without its log the context is gone
    for (const std::string& f : dir_entries(o_.dir))
        if (context_of_file(f) == id && (ends_with(f, ".kvblob") || f.find(".kvlog.tmp") != std::string::npos ||
                                         f.find(".kvblob.tmp") != std::string::npos))
            ::unlink((o_.dir + "/" + f).c_str());
    ::unlink(spill_path(id).c_str());
    ::unlink((o_.dir + "/" + id + ".pin").c_str());
    (void)fsync_dir_of(log);
}

Status ContextStore::remove(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, nullptr);
    auto c = find(id);
    if (!c) return c.error();
    if (o_.table) o_.table->erase(id);  // first: without its record the context is gone
    (*c)->seq.release(pool_);
    (*c)->log.reset();
    remove_files(id);
    contexts_.erase(id);
    return {};
}

Result<std::vector<float>> ContextStore::next_logits(const std::string& id, ContextUsage* caller_usage) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, caller_usage);
    ContextUsage* usage = &tally.u;
    auto c = find(id);
    if (!c) return c.error();
    Context& x = **c;
    if (x.tokens.empty()) return make_error(ErrorKind::Invalid, "context '{}' is empty: no position to continue", id);
    touch(x);
    if (Status st = make_resident(x, usage); !st) return st.error();
    if (!x.logits_valid) {
        // The logits of the last position are not kept on disk: computed again from
        // the KV before it (exact, C1).
        const int64_t n = static_cast<int64_t>(x.tokens.size());
        if (x.seq.n_tokens() >= n) {
            x.seq.truncate(pool_, n - 1);
            if (usage) usage->restored = std::max<int64_t>(0, usage->restored - 1);
        }
        if (Status st = compute(x, usage); !st) return st.error();
    } else if (usage) {
        usage->reused += static_cast<int64_t>(x.tokens.size());
    }
    return x.logits;
}

Status ContextStore::evict(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, nullptr);
    auto c = find(id);
    if (!c) return c.error();
    if ((*c)->pinned) return make_error(ErrorKind::Invalid, "context '{}' is pinned", id);
    return evict_one(**c);
}

Result<ContextKv> ContextStore::lease(const std::string& id, ContextUsage* caller_usage) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally tally(*this, caller_usage);
    ContextUsage* usage = &tally.u;
    auto c = find(id);
    if (!c) return c.error();
    touch(**c);
    if (Status st = make_resident(**c, usage); !st) return st.error();
    ContextKv kv;
    kv.tokens = (*c)->tokens;
    kv.blocks = (*c)->seq.blocks();
    kv.valid = (*c)->seq.n_tokens();
    for (int32_t b : kv.blocks) pool_.allocator().ref(b);
    return kv;
}

Result<ContextInfo> ContextStore::info(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto c = find(id);
    if (!c) return c.error();
    return info_of(**c);
}

Result<std::vector<int32_t>> ContextStore::tokens(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto c = find(id);
    if (!c) return c.error();
    return (*c)->tokens;
}

std::vector<ContextInfo> ContextStore::list() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<ContextInfo> out;
    for (const auto& [id, c] : contexts_) out.push_back(info_of(*c));
    return out;
}

}  // namespace duet
