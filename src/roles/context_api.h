// Contexts in serving: the front's context store over the instance's shared CPU KV
// arena, its KV computed by the prefill workers, and the /v1/contexts JSON API.
//
// ServingCompute is the store's ContextCompute: each extend is a request with
// RequestParams::keep_kv. The prompt is the context's tokens; prefill finds the
// context's full blocks in the prefix index (the store publishes them and holds a
// reference to each, so they are never evicted), computes the rest (the partial
// last block and the new tokens: exact, by the batch/chunking invariance), and moves
// its references to the request's blocks to the front's arena user instead of
// handing off. The store then holds the new sequence and logs it.
//
// ContextService answers the routes below with JSON (OpenAI error JSON for failures;
// ErrorKind -> status: NotFound 404, Exists 409, Invalid 400, Limit 429, NoKvBlocks
// 503). It blocks (disk I/O, waiting for prefill): the front calls it on a thread of
// its own, never on an HTTP thread.
//   POST   /v1/contexts                {"id"?, NEW?, "durable"?, "pin_prefix"?}  -> 201
//   GET    /v1/contexts                (and "refused": the logs recovery refused, with why)
//   GET    /v1/contexts/{id}[?tokens=true]
//   DELETE /v1/contexts/{id}
//   POST   /v1/contexts/{id}/append    {NEW}
//   POST   /v1/contexts/{id}/truncate  {"n_tokens"}
//   POST   /v1/contexts/{id}/edit      {"at", NEW}
//   POST   /v1/contexts/{id}/fork      {"id"?, "at"?, "durable"?}             -> 201
// NEW is "prompt" (text), "tokens" (ids) or "messages" (chat messages rendered with
// the chat template, ChatTurns: a whole conversation at position 0, else added to
// the one before; "add_generation_prompt": true opens the assistant's turn).
// With the front: POST /v1/contexts/{id}/completions, /v1/chat/completions with
// "context", GET /v1/contexts/{id}/export (export_file) and POST
// /v1/contexts/import?id=ID[&durable=false] (import_file; the body spooled to a file).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "engine/contexts.h"
#include "kv/log_device.h"
#include "model/chat_turns.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "roles/routing.h"
#include "shm/instance.h"

namespace duet {

// The KV arena the front's context store keeps every context's blocks in: the one
// host arena on CPU, GPU 0's on GPU pairs. Every request of a context is bound to it
// (RequestParams::bind_arena). Spreading contexts over every GPU's arena (a home arena per
// context, a mirror and stage each) is not built: context work runs on GPU 0's pair.
inline constexpr uint32_t kContextArena = 0;
// How long a context's computation waits while no prefill worker of that arena runs
// (a restart takes seconds; a pair down for good must not hold the store).
inline constexpr std::chrono::seconds kNoWorkerWait{60};

class ServingCompute final : public ContextCompute {
public:
    ServingCompute(shm::Instance& inst, shm::ProcRef self, PrefillRouter& router, KvPool& pool, KvCacheManager& kv,
                   uint64_t model_fingerprint);
    // Sends a keep_kv request for `tokens` and waits for it; the new sequence
    // replaces seq. `last` is left empty (the logits stay with prefill).
    Status extend(KvSeq& seq, std::span<const int32_t> tokens, std::vector<float>& last) override;
    // Publishes seq's full blocks in the prefix index (a context restored from disk).
    void resident(const KvSeq& seq, std::span<const int32_t> tokens) override;
    int64_t recomputed() const override { return recomputed_; }
    // Called when no request slot is free, then the submit is tried again while it
    // returns true (the front's Front::release_ended_orphan).
    void set_make_room(std::function<bool()> f) { make_room_ = std::move(f); }

private:
    std::vector<shm::BlockHash> hashes(std::span<const int32_t> tokens) const;
    shm::Instance& inst_;
    shm::ProcRef self_;
    PrefillRouter& router_;
    KvPool& pool_;
    KvCacheManager& kv_;
    uint64_t fingerprint_;
    mutable shm::BlockHasher hasher_;
    int64_t recomputed_ = 0;  // a SHA-256 context, reused
    std::function<bool()> make_room_;
};

struct ApiReply {
    int status = 200;
    std::string body;  // JSON
};

// Everything the front needs for contexts: the arena user, the pool over the shared
// arena, the log device, the store.
class ContextService {
public:
    // Joins kContextArena as `self` and opens the store in dir.
    static Result<std::unique_ptr<ContextService>> open(shm::Instance& inst, shm::ProcRef self, PrefillRouter& router,
                                                        const Model& model, const Tokenizer& tok,
                                                        const ChatTemplate& tmpl, const std::string& dir,
                                                        size_t max_contexts, uint64_t max_disk_bytes = 0);
    ~ContextService();
    // What its computations call when they find no free request slot
    // (ServingCompute::set_make_room).
    void set_make_room(std::function<bool()> f) { compute_->set_make_room(std::move(f)); }
    // A /v1/contexts route (method, path without the query, the query, the body).
    ApiReply handle(const std::string& method, const std::string& path, const std::string& query,
                    const std::string& body);
    // /v1/contexts/{id}/completions: the context's tokens to put before the prompt,
    // and its blocks leased (ContextStore::lease; release() them when the request
    // has ended); an error reply when there is no such context.
    std::variant<ContextKv, ApiReply> lease(const std::string& id);
    // Drops leased references (any thread: atomic operations on the arena).
    void release(std::span<const int32_t> blocks);
    // After such a completion: its prompt and output join the context. With
    // kv_blocks (the completion's blocks, returned by its worker: positions [0,
    // kv_valid), a reference each that the context takes over or that is dropped),
    // only what they lack is computed. maybe_done (a completion adopted from a front
    // that died, which may have committed it already): a context that already ends
    // with `added` at that length is left as it is, and the answer is OK.
    ApiReply commit(const std::string& id, size_t context_tokens, std::span<const int32_t> added,
                    std::vector<int32_t> kv_blocks = {}, int64_t kv_valid = 0, bool maybe_done = false);
    // Before a request that needs `blocks` KV blocks is admitted: when the arena has
    // fewer free or cached, idle contexts (not `keep`, the one the request
    // continues) are evicted, least recently used first, until it has them
    // (ContextStore::evict_idle; their KV is on disk). Blocking: the store thread.
    void make_room(uint64_t blocks, const std::string& keep);
    // The arena has `blocks` free or cached (no wait, any thread).
    bool has_room(uint64_t blocks) const;
    // Export: a blob of the context in the spool directory, for the front to send
    // and remove; or the error reply.
    std::variant<std::string, ApiReply> export_file(const std::string& id);
    // A file in the spool directory for an import's body (the front writes it).
    std::string spool_path();
    // Import: the query's id (and durable), the blob spooled at `path` (removed here,
    // whatever the outcome) -> 201 with the context, or the reason it was refused.
    ApiReply import_file(const std::string& query, const std::string& path);
    // The largest blob an import takes: a request slot's tokens of this KV layout.
    uint64_t max_blob_bytes() const { return max_blob_bytes_; }
    const ChatTurns& turns() const { return *turns_; }
    ContextStore& store() { return *store_; }
    int32_t arena_user() const { return joined_ ? static_cast<int32_t>(user_) : -1; }  // in kContextArena

private:
    ContextService() = default;
    ApiReply create(const std::string& body);
    ApiReply route_one(const std::string& method, const std::string& id, const std::string& op,
                       const std::string& query, const std::string& body);
    std::optional<ApiReply> refused_reply(const std::string& id) const;

    shm::Instance* inst_ = nullptr;
    shm::ContextTable* table_ = nullptr;  // claimed by self_
    shm::ProcRef self_;
    uint32_t user_ = 0;
    bool joined_ = false;
    const Tokenizer* tok_ = nullptr;
    std::unique_ptr<ChatTurns> turns_;
    std::string spool_dir_;
    std::string store_dir_;  // its paths are not shown to clients (public_message)
    uint64_t max_blob_bytes_ = 0;
    ShmBlockAllocator* alloc_ = nullptr;
    // CPU: a pool over the shared host arena. GPU: the arena's host mirror and the
    // stage that copies blocks to and from the device (kv/kv_stage.h).
    std::unique_ptr<KvPool> own_pool_;
    std::unique_ptr<ShmBlockAllocator> gpu_alloc_;
    std::unique_ptr<KvMirror> mirror_;
    std::unique_ptr<KvStage> stage_;
    KvPool* pool_ = nullptr;
    std::unique_ptr<KvCacheManager> kv_;
    std::unique_ptr<ServingCompute> compute_;
    std::unique_ptr<LogDevice> dev_;
    std::unique_ptr<KvLogSync> sync_;
    std::unique_ptr<ContextStore> store_;
};

}  // namespace duet
