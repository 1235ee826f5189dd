// Contexts: named token sequences whose KV the engine keeps, editable and durable
// (DESIGN.md "Contexts"; the HTTP API /v1/contexts builds on this store).
//
// A context is its tokens and, while resident, their KV in the pool (a KvSeq).
// Operations: create, append (only the new tokens are computed), truncate (O(1) on
// the KV: blocks past the end are dropped), edit (truncate + append, one durable
// step: one log record), fork
// (copy-on-write: the fork shares its parent's blocks), remove, and next_logits (the
// logits that continue the context, for generation). A durable context also has a
// KV append log (src/kv/kv_log.h, rules in src/kv/KVLOG.md): an operation returns
// only after its records are written and fdatasynced, so a context survives SIGKILL
// of every process with exactly its acknowledged tokens, and is restored from the
// log, not computed again. A context that is not durable lives in memory only.
//
// Rules (tests/contexts_test.cpp breaks each):
// C1. Exact: after any sequence of operations, a context's next-token logits equal,
//     bitwise, those of one fresh computation of its tokens (the backend's
//     batch/chunking invariance: computing only new tokens, or recomputing the last
//     position, gives the same bits).
// C2. Durable when acknowledged: when create / append / truncate / edit / fork of a
//     durable context returns OK, the log holds its tokens and KV; after a crash
//     open() lists it with those tokens (a torn tail is cut to the last valid
//     record; a corrupted log is refused with its reason and its files are kept,
//     the other contexts serve).
// C3. A failed operation changes nothing: the context keeps the tokens and KV it
//     had (the log keeps its last durable state, or is poisoned by a failed
//     fdatasync: then the context refuses every later operation, KVLOG.md W6).
// C4. Idle contexts never starve the pool: when an operation needs blocks the pool
//     lacks, resident contexts other than the one operated on are evicted, least
//     recently used first (durable ones are dropped, their KV being on disk; the
//     others are spilled to a blob first), and restored on their next use.
// C5. Ids are 1..64 of [A-Za-z0-9_.-] (the log header's name field), so an id never
//     names a path outside the directory.
// C6. A context that is not durable outlives the process that keeps the store when
//     the store has a table (serving: the instance's shm::ContextTable, held by the
//     instance's long-lived processes): every operation that returns OK has put the
//     context's record there (its tokens, its pin, when it was made), and open()
//     lists every record it finds, not resident: its KV comes back from its spill
//     blob or is computed again from its tokens (exact, C1). A put is part of the
//     operation, like a durable context's log record: when it fails, nothing changes.
//
// The store serializes its operations (one mutex): an operation on a context is
// never interleaved with another. Disk I/O runs on the caller's thread: in serving,
// a thread that is not a compute worker's. KV in an arena the store's process cannot
// address (a GPU's) passes through a host mirror (ContextStoreOptions::stage).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "base/histogram.h"
#include "base/result.h"
#include "engine/kv_cache_manager.h"
#include "kv/blob.h"
#include "kv/kv_log.h"
#include "kv/kv_pool.h"
#include "kv/kv_stage.h"
#include "model/backend.h"
#include "shm/context_table.h"

namespace duet {

// Who computes a context's KV. extend() computes positions [seq.n_tokens(),
// tokens.size()) of seq (its earlier positions are valid) and leaves the logits of
// the last position in `last` (n_vocab floats). Errors of kind NoKvBlocks change
// nothing (the store then evicts and tries again); others may leave seq shorter
// than asked but never with invalid positions counted.
// `last` may be left empty when the logits stay where they were computed (serving:
// in the prefill worker); next_logits then computes them here. resident() is told
// of every sequence restored from disk (serving publishes its blocks).
class ContextCompute {
public:
    virtual ~ContextCompute() = default;
    virtual Status extend(KvSeq& seq, std::span<const int32_t> tokens, std::vector<float>& last) = 0;
    virtual void resident(const KvSeq& seq, std::span<const int32_t> tokens) {
        (void)seq;
        (void)tokens;
    }
    // Positions before seq.n_tokens() the last extend() computed again (serving:
    // the partial last block, which the prefix index does not hold): the usage
    // counts them as computed, not reused.
    virtual int64_t recomputed() const { return 0; }
};

// In one process: passes of up to `budget` tokens through a backend, each pass's
// blocks reserved first (KvCacheManager).
class BackendCompute final : public ContextCompute {
public:
    BackendCompute(Backend& backend, KvCacheManager& kv, int64_t budget = 512)
        : backend_(backend), kv_(kv), budget_(budget) {}
    Status extend(KvSeq& seq, std::span<const int32_t> tokens, std::vector<float>& last) override;

private:
    Backend& backend_;
    KvCacheManager& kv_;
    int64_t budget_;
};

// Where an operation's KV came from (the API's usage says it).
struct ContextUsage {
    int64_t restored = 0;   // positions read back from disk (a log or a spill blob)
    int64_t reused = 0;     // positions whose KV was already in memory
    int64_t prefilled = 0;  // positions computed
};

struct ContextInfo {
    std::string id;
    int64_t n_tokens = 0;
    bool durable = false;
    bool resident = false;                 // KV in the pool now (else on disk)
    bool pinned = false;                   // kept resident (create's pin)
    uint64_t disk_bytes = 0;               // the log (and checkpoint) or the spill blob
    uint64_t created_ns = 0, used_ns = 0;  // CLOCK_REALTIME
};

// What /metrics reports of a store (read without its lock: relaxed counters).
struct ContextStats {
    std::atomic<uint64_t> contexts{0}, resident{0};
    std::atomic<uint64_t> restored_tokens{0}, reused_tokens{0}, prefilled_tokens{0};
    std::atomic<uint64_t> evictions{0};
    Histogram restore;  // an evicted (or not yet read) context's KV read back
    Histogram persist;  // a durable operation's log records written and synced
};

// A context's tokens and, leased, the blocks holding positions [0, valid) of them.
struct ContextKv {
    std::vector<int32_t> tokens;
    std::vector<int32_t> blocks;
    int64_t valid = 0;
};

struct ContextStoreOptions {
    std::string dir;             // logs (<id>.kvlog) and spills (spill/<id>.kvblob); created 0700 if missing
    KvIdentity id;               // the model and tokenizer the KV belongs to
    size_t max_contexts = 1024;  // create / fork past it: ErrorKind::Limit
    // The durable contexts' files at most (bytes; 0: no limit): an operation that
    // would write past it is refused with ErrorKind::Limit and changes nothing.
    uint64_t max_disk_bytes = 0;
    KvLogOptions log;
    // The longest context import_blob takes (serving: a request slot's tokens); 0: any.
    int64_t max_tokens = 0;
    // C6: the records of the contexts that are not durable (claimed by the caller);
    // null: they live in this process only.
    shm::ContextTable* table = nullptr;
    // An arena this process cannot address (a GPU's): the pool given to open() is
    // the arena's host mirror (kv/kv_stage.h), `stage` copies blocks between the two
    // and the mirror's pages are released after each operation. Null: the pool is
    // the arena itself.
    KvStage* stage = nullptr;
    KvMirror* mirror = nullptr;
};

class ContextStore {
public:
    // Opens the directory and lists every context whose log it holds (recovering
    // each by KVLOG.md: torn tails cut, leftovers removed), and every record of the
    // table (C6), not resident: the KV is read on first use. Logs that recovery
    // refuses are listed by refused(), their files untouched. Spill blobs of no
    // listed context are removed (their contexts were not durable and are gone).
    static Result<std::unique_ptr<ContextStore>> open(KvPool& pool, KvLogSync& sync, ContextCompute& compute,
                                                      const ContextStoreOptions& o);
    ~ContextStore();  // releases every resident context's blocks; files stay
    ContextStore(const ContextStore&) = delete;
    ContextStore& operator=(const ContextStore&) = delete;

    // pin: the context stays resident (never evicted for room) and, durable, is made
    // resident again when the store is opened: its full blocks serve every prompt
    // that starts with its tokens (serving: through the prefix index), across
    // restarts. The pin is kept in <dir>/<id>.pin.
    Result<ContextInfo> create(const std::string& id, std::span<const int32_t> tokens, bool durable,
                               ContextUsage* usage = nullptr, bool pin = false);
    Result<ContextInfo> append(const std::string& id, std::span<const int32_t> tokens, ContextUsage* usage = nullptr);
    // append() when the new tokens' KV was computed elsewhere (serving: a context
    // completion's blocks, returned by the worker that ended it): `blocks` hold
    // positions [0, valid) of the context's tokens followed by `tokens`, with a
    // reference each that the store takes over (dropped on any failure). Only
    // positions from `valid` on are computed. Refused (Exists, nothing changed) when
    // the context no longer has `expect_len` tokens (edited meanwhile).
    Result<ContextInfo> append_with_kv(const std::string& id, size_t expect_len, std::span<const int32_t> tokens,
                                       std::vector<int32_t> blocks, int64_t valid, ContextUsage* usage = nullptr);
    Result<ContextInfo> truncate(const std::string& id, int64_t n_tokens);
    Result<ContextInfo> edit(const std::string& id, int64_t at, std::span<const int32_t> tokens,
                             ContextUsage* usage = nullptr);
    // A new context `new_id` holding the first `at` tokens of `id` (-1: all), sharing
    // its blocks; durable like its parent unless `durable` says otherwise (0 / 1).
    Result<ContextInfo> fork(const std::string& id, const std::string& new_id, int64_t at = -1, int durable = -1,
                             ContextUsage* usage = nullptr);
    // Drops its blocks and removes its files.
    Status remove(const std::string& id);
    // The logits of the position after the context's last (n_vocab floats): restores
    // it if evicted, recomputing the last position when its logits are not at hand.
    Result<std::vector<float>> next_logits(const std::string& id, ContextUsage* usage = nullptr);
    // Gives its blocks back to the pool (durable: they are in the log; else spilled
    // to a blob first). Restored on next use. A pinned context is refused (Invalid).
    Status evict(const std::string& id);

    // Export: the context's KV as a blob at `path` (src/kv/blob.h; written to a
    // temporary file and renamed), made resident first and computed where it was
    // not. The context is not changed.
    Result<ContextInfo> export_blob(const std::string& id, const std::string& path);
    // Import: a new context `id` from the blob at `path`, durable or not, its KV
    // read into the pool. Everything is checked before the context exists (the
    // header against this model, tokenizer and arena layout, the data CRC, the token
    // ids, the length against max_tokens): a refused blob is an Invalid error naming
    // what differs, and nothing stays allocated or written.
    Result<ContextInfo> import_blob(const std::string& id, const std::string& path, bool durable,
                                    ContextUsage* usage = nullptr);

    // The context's tokens, its KV made resident first (restored if evicted), and the
    // blocks that hold it (positions [0, valid)), each with one more reference for
    // the caller, who drops them with the pool's allocator (unref) when done: the KV
    // stays valid for it even if the context is edited, evicted or removed meanwhile
    // (serving: a completion whose prefill starts from these blocks).
    Result<ContextKv> lease(const std::string& id, ContextUsage* usage = nullptr);

    // Room for others (serving: a request about to be admitted): evicts resident
    // contexts, least recently used first, never a pinned one nor `keep`, until
    // enough() says so or none is left. Returns how many were evicted.
    size_t evict_idle(const std::string& keep, const std::function<bool()>& enough);

    Result<ContextInfo> info(const std::string& id);
    Result<std::vector<int32_t>> tokens(const std::string& id);
    std::vector<ContextInfo> list();
    // Logs open() refused: (file name, reason).
    const std::vector<std::pair<std::string, std::string>>& refused() const { return refused_; }
    uint64_t evictions() const { return stats_.evictions.load(std::memory_order_relaxed); }
    const ContextStats& stats() const { return stats_; }

private:
    struct Context {
        std::string id;
        std::vector<int32_t> tokens;
        KvSeq seq;              // resident: positions [0, seq.n_tokens()) valid, seq.n_tokens() <= tokens.size()
        bool resident = false;  // else its KV is on disk (log or spill)
        bool durable = false;
        bool pinned = false;
        std::unique_ptr<KvLog> log;
        std::vector<float> logits;  // of position tokens.size() - 1, when logits_valid
        bool logits_valid = false;
        uint64_t created_ns = 0, used_ns = 0, lru = 0;
    };
    ContextStore(KvPool& pool, KvLogSync& sync, ContextCompute& compute, const ContextStoreOptions& o)
        : pool_(pool), sync_(sync), compute_(compute), o_(o) {}
    Status recover();
    // A new resident context, empty, not yet in the table; its log created when durable.
    Result<std::unique_ptr<Context>> new_context(const std::string& id, bool durable, bool pin);
    Result<Context*> find(const std::string& id);
    Status check_new_id(const std::string& id);
    // ErrorKind::Limit when writing `positions` more positions' KV to a log would take
    // the directory past max_disk_bytes.
    Status check_disk(int64_t positions) const;
    ContextInfo info_of(const Context& c) const;
    std::string spill_path(const std::string& id) const;
    void touch(Context& c);
    // Reads an evicted context's KV back (its log, or its spill blob; a context from
    // the table without a spill is made resident empty and computed on use).
    Status make_resident(Context& c, ContextUsage* usage);
    // C6: c's record in the table, with `tokens` (c's own when null); nothing to do for
    // a durable context or without a table.
    Status record(const Context& c, const std::vector<int32_t>* tokens = nullptr);
    // Invalid when a context that is not durable would hold more tokens than a table
    // record does (checked before anything changes).
    Status check_record(bool durable, size_t n_tokens) const;
    Status evict_one(Context& c);
    // A staged arena (o_.stage; nothing to do otherwise): the mirror's blocks of
    // positions [first, first + n) of seq pulled before they are read (kv_stage.h S1),
    // seq's blocks from position `first` on pushed after they were written (S2), the
    // mirror's pages released once the operation's KV has moved.
    Status stage_in(const KvSeq& seq, uint64_t first, uint64_t n);
    Status stage_out(const KvSeq& seq, uint64_t first);
    void stage_done();
    // C4's victim: the least recently used resident context that is not pinned, not
    // empty and not `keep`; null when there is none.
    Context* lru_victim(const Context* keep);
    // Evicts resident contexts other than `keep`, least recently used first, until
    // the pool has `blocks` free. False when it cannot (nothing left to evict, or an
    // eviction failed).
    bool make_room(const Context& keep, int64_t blocks);
    // Computes c's KV up to c.tokens.size(), evicting other contexts while the pool
    // lacks blocks; on an error c.seq is cut back to what it had.
    Status compute(Context& c, ContextUsage* usage);
    Status append_locked(Context& c, std::span<const int32_t> tokens, ContextUsage* usage);
    // c cut to n_tokens (at most its length): the log's record first, then memory.
    Status truncate_locked(Context& c, int64_t n_tokens);
    void remove_files(const std::string& id);

    KvPool& pool_;
    KvLogSync& sync_;
    ContextCompute& compute_;
    ContextStoreOptions o_;
    std::mutex mu_;
    std::map<std::string, std::unique_ptr<Context>> contexts_;
    std::vector<std::pair<std::string, std::string>> refused_;
    uint64_t clock_ = 0;
    ContextStats stats_;
    struct Tally;
    void count(const ContextUsage& u);
    void count_contexts();
};

}  // namespace duet
