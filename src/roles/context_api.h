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
// ContextApi answers the routes below with JSON (OpenAI error JSON for failures;
// ErrorKind -> status: NotFound 404, Exists 409, Invalid 400, Limit 429, NoKvBlocks
// 503). It blocks (disk I/O, waiting for prefill): the front calls it on a thread of
// its own, never on an HTTP thread.
//   POST   /v1/contexts                {"id"?, "prompt"? | "tokens"?, "durable"?}  -> 201
//   GET    /v1/contexts
//   GET    /v1/contexts/{id}[?tokens=true]
//   DELETE /v1/contexts/{id}
//   POST   /v1/contexts/{id}/append    {"prompt" | "tokens"}
//   POST   /v1/contexts/{id}/truncate  {"n_tokens"}
//   POST   /v1/contexts/{id}/edit      {"at", "prompt" | "tokens"}
//   POST   /v1/contexts/{id}/fork      {"id"?, "at"?, "durable"?}             -> 201
// and, with the front's completion path, POST /v1/contexts/{id}/completions.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/contexts.h"
#include "kv/log_device.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "roles/routing.h"
#include "shm/instance.h"

namespace duet {

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
};

struct ApiReply {
    int status = 200;
    std::string body;  // JSON
};

// Everything the front needs for contexts: the arena user, the pool over the shared
// arena, the log device, the store.
class ContextService {
public:
    // Joins arena 0 (CPU serving) as `self` and opens the store in dir.
    static Result<std::unique_ptr<ContextService>> open(shm::Instance& inst, shm::ProcRef self, PrefillRouter& router,
                                                        const Model& model, const Tokenizer& tok,
                                                        const std::string& dir, size_t max_contexts,
                                                        uint64_t max_disk_bytes = 0);
    ~ContextService();
    // A /v1/contexts route (method, path without the query, the query, the body).
    ApiReply handle(const std::string& method, const std::string& path, const std::string& query,
                    const std::string& body);
    // /v1/contexts/{id}/completions: the context's tokens to put before the prompt;
    // an error reply when there is no such context.
    std::variant<std::vector<int32_t>, ApiReply> tokens_of(const std::string& id);
    // After such a completion: its prompt and output join the context.
    ApiReply commit(const std::string& id, size_t context_tokens, std::span<const int32_t> added);
    ContextStore& store() { return *store_; }

private:
    ContextService() = default;
    ApiReply create(const std::string& body);
    ApiReply route_one(const std::string& method, const std::string& id, const std::string& op,
                       const std::string& query, const std::string& body);

    shm::Instance* inst_ = nullptr;
    uint32_t user_ = 0;
    bool joined_ = false;
    const Tokenizer* tok_ = nullptr;
    ShmBlockAllocator* alloc_ = nullptr;
    std::unique_ptr<KvPool> pool_;
    std::unique_ptr<KvCacheManager> kv_;
    std::unique_ptr<ServingCompute> compute_;
    std::unique_ptr<LogDevice> dev_;
    std::unique_ptr<KvLogSync> sync_;
    std::unique_ptr<ContextStore> store_;
};

}  // namespace duet
