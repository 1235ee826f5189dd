// What the serving roles (front, prefill, decode) agree on: the instance layout they
// share, the ring each message kind travels on, the message record, the request
// parameters stored in a request slot, and the log-probability rows workers write.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "base/log.h"
#include "base/result.h"
#include "engine/drafter.h"
#include "engine/scheduling.h"
#include "engine/token_step.h"
#include "kv/kv_pool.h"
#include "model/model.h"
#include "model/sampler.h"
#include "shm/instance.h"

namespace duet {

// The shape of what the serving roles keep in the instance's opaque bytes: request
// parameters (RequestParams) and data (roles/request_data.h) in request slots, and
// the workers' gauges and counters in process slots' role pages
// (roles/worker_stats.h). Bumped whenever one of them changes shape; it is
// shm::InstanceConfig::user_protocol, so processes of different shapes refuse to
// share an instance. 1: RequestParams with data_bytes, WorkerStats. 2: grammars
// of kind StructuralTag (tool calls) in the request data. 3: stop strings in the
// request data (the workers end requests on them). 4: RequestParams::no_draft_pool.
// 5: WorkerStats::pass_fixed_milli. 6: WorkerStats' grammar compile counters.
// 7: WorkerStats' draft pool gauges.
inline constexpr uint32_t kServingProtocol = 7;

// Every process of the CPU device's KV arena is one of its users (shm::kArenaMaxUsers):
// prefill and decode workers together.
inline constexpr uint32_t kMaxServeWorkers = shm::kArenaMaxUsers;

// The rings of a serving instance with P prefill and D decode workers (each ring has
// one producer and one consumer):
//   to_prefill(p)     front -> prefill p: a request is QUEUED
//   redrive(p)        launcher -> prefill p: a re-driven request is QUEUED again
//   to_decode(p, d)   prefill p -> decode d: a hand-off
// GPU pairs (paired: a prefill and a decode worker per GPU, sharing its arena) hand
// off within the pair only: one to_decode ring per pair, to_decode(p, p), not P x D.
struct ServeRings {
    uint32_t n_prefill = 1, n_decode = 1;
    bool paired = false;
    static ServeRings of(const shm::InstanceConfig& c) {
        return {c.prefill_workers, c.decode_workers, c.cpu_kv_bytes == 0 && !c.kv_split && c.prefill_workers > 0};
    }
    uint32_t to_prefill(uint32_t p) const { return p; }
    uint32_t redrive(uint32_t p) const { return n_prefill + p; }
    // paired: d must be p.
    uint32_t to_decode(uint32_t p, uint32_t d) const { return 2 * n_prefill + (paired ? p : p * n_decode + d); }
    uint32_t count() const { return 2 * n_prefill + (paired ? n_prefill : n_prefill * n_decode); }
    // Whether prefill p hands off to decode d through a ring of its own.
    bool linked(uint32_t p, uint32_t d) const { return !paired || p == d; }
};

struct ServeLayout {
    std::string instance;
    uint32_t n_requests = 64;  // request slots
    int64_t n_ctx = 2048;      // tokens per request (prompt + output)
    uint32_t n_blocks = 0;     // KV blocks; 0: enough for every slot at full context, capped at 8 GiB of KV
    uint32_t n_prefill = 1, n_decode = 1;  // CPU workers (P + D <= kMaxServeWorkers)
    // GPU serving: a prefill and a decode worker per GPU (index i on the i-th GPU),
    // each pair with the KV arena of its GPU (arena i, in device memory: no /dev/shm
    // KV segment); n_prefill and n_decode are then n_gpus. 0: CPU serving.
    uint32_t n_gpus = 0;
    // Per-role KV arenas: prefill workers write KV into arenas of their own and each
    // hand-off copies the request's blocks into its decode worker's arena, layer by
    // layer (DESIGN.md, "One request, end to end"). On CPU: one host arena for the
    // prefill workers, one for the decode workers (each bound to its role's NUMA
    // nodes). On GPUs: prefill alone on the first n_prefill GPUs (arena p), decode
    // alone on the other n_decode (arena n_prefill + d); n_prefill + n_decode == n_gpus.
    bool kv_split = false;
    KvDtype kv_dtype = KvDtype::F16;  // how the arenas store KV values
    // The front keeps contexts (roles/context_api.h): it is one more user of the CPU
    // arena (arena 0), which then takes one worker fewer. Their records outlive the
    // front in the instance's context table: contexts_max + 2 records of n_ctx tokens.
    bool contexts = false;
    uint32_t contexts_max = 1024;
    // Workers may change role (`duet serve --rebalance`, roles/rebalance.h; CPU, one
    // shared arena): each role then has rings and indices for n_prefill + n_decode - 1
    // workers, the indices no process holds being spares (routers pass them over as
    // they do a worker being restarted). The arena's users stay n_prefill + n_decode:
    // a worker leaves before its successor joins.
    bool rebalance = false;
};

// The shm instance for serving `model` with this layout.
shm::InstanceConfig serve_instance_config(const ServeLayout& l, const Model& model);

// At least one prefill and one decode worker, at most kMaxServeWorkers in all.
Status check_worker_counts(int n_prefill, int n_decode);
// GPUs one instance serves on: 1 to kMaxServeGpus.
inline constexpr uint32_t kMaxServeGpus = 8;
Status check_gpu_count(int n_gpus);
// The workers of an instance, as its config says: CPU counts (each role's worker
// indices: with ServeLayout::rebalance, some are spares), or GPU pairs.
Status check_instance_workers(const shm::InstanceConfig& c);
// Whether the instance serves on GPUs (its KV in device memory).
inline bool gpu_instance(const shm::InstanceConfig& c) { return c.cpu_kv_bytes == 0; }
// The KV arena worker `index` of `role` (Prefill or Decode) uses: on GPUs its GPU's
// (a pair's, or its own with kv_split); on CPU the one host arena, or its role's
// (prefill 0, decode 1) with kv_split.
inline uint32_t worker_arena(const shm::InstanceConfig& c, shm::Role role, uint32_t index) {
    const bool decode = role == shm::Role::Decode;
    if (!gpu_instance(c)) return c.kv_split && decode ? 1 : 0;
    return c.kv_split && decode ? c.prefill_workers + index : index;
}
// The arenas the decode workers keep their sequences in, each once, in order (A3's
// KV view: a prefill-only arena holds prompts only while they are computed); every
// arena when the config names no decode worker.
inline std::vector<uint32_t> decode_arenas(const shm::InstanceConfig& c) {
    std::vector<uint32_t> v;
    if (c.decode_workers == 0) {
        for (uint32_t a = 0; a < c.arenas.size(); ++a) v.push_back(a);
        return v;
    }
    for (uint32_t d = 0; d < c.decode_workers; ++d) {
        const uint32_t a = worker_arena(c, shm::Role::Decode, d);
        if (std::find(v.begin(), v.end(), a) == v.end()) v.push_back(a);
    }
    return v;
}
// The decode worker prefill worker p may hand off to: on GPU pairs only its own
// (d == p: the KV is in their GPU's arena); -1: any.
inline int32_t handoff_partner(const shm::InstanceConfig& c, uint32_t p) {
    return ServeRings::of(c).paired ? static_cast<int32_t>(p) : -1;
}

// A ring record (one cache line).
struct WireMsg {
    uint32_t slot, gen;
    uint32_t attempt;                        // hand-off: the attempt prefilled
    uint32_t from_slot, from_gen, from_user;  // hand-off: the giver
    uint32_t pad[10];
};
static_assert(sizeof(WireMsg) == 64 && std::is_trivially_copyable_v<WireMsg>);

// Why a request FAILED (its slot's error_code).
enum class ReqError : int32_t {
    None = 0,
    Prefill = 1,    // prefill could not run it (a pass failed)
    Decode = 2,     // decode ran out of KV blocks
    NoWorker = 3,   // a worker role died and could not be restarted
    NotSent = 4,    // the queue to prefill stayed full
    PrefillKv = 5,  // prefill ran out of KV blocks even for this request alone
    Data = 6,       // the request's data (roles/request_data.h) was missing or damaged
    Poison = 7,     // the workers computing it kept dying without progress (roles/restart_policy.h)
};

// Stored in a request slot's params bytes.
struct RequestParams {
    SamplingParams sampling;
    uint32_t max_tokens = 128;
    uint32_t stop_at_eog = 1;
    uint32_t min_tokens = 0;  // no end-of-generation token before this many outputs
    int32_t logprobs = -1;  // -1: none; else the sampled token's and this many top ones (<= kMaxTopLogprobs)
    // A context's KV computation (the front's context store): prefill computes the
    // prompt and, instead of handing off, gives the request's blocks to the client
    // (its references moved to the client's arena user, the block table in the slot)
    // and finishes. max_tokens is 1; the one output token is not part of the KV.
    uint32_t keep_kv = 0;
    // The client offered blocks (RequestTable::offer_blocks) whose KV the prompt's
    // first given_tokens positions have (a context's own blocks, partial last one
    // included): prefill takes references on them and computes from there, instead
    // of the prefix lookup (which finds full blocks only). Ignored when the table no
    // longer holds them (a re-drive empties it).
    uint32_t given_tokens = 0;
    // ProcRef::pack() of the process that offered them (the front, or the context
    // store's process). Prefill shares only that process's references: a front that
    // adopted the request after the offerer died may hold other blocks under the same
    // ids (freed by the recovery, taken again), and while the offerer is not yet
    // recovered its references still hold the offered KV. 0: the client.
    uint64_t given_by = 0;
    // A context completion's KV comes back: when the request finishes (not when it
    // is cancelled or fails), the worker that ends it writes its blocks in the slot's
    // table and moves its references to the client's arena user, which then holds
    // positions [0, prompt + output - 1) (the last output token was never fed). The
    // client adopts them (the context grows without computing them again) or drops
    // them. One shared arena only (no kv_split).
    uint32_t return_kv = 0;
    // The request's class (engine/scheduling.h SloClass) and its TTFT target: prefill
    // serves earliest deadline first, the deadline being the submission time plus
    // the target plus a millisecond per prompt token (a context's computation has no
    // target: the per-token term alone).
    SloClass slo_class = SloClass::Standard;
    uint8_t slo_pad_[3] = {};
    bool critical() const { return slo_class == SloClass::Critical; }
    // Its class as decode's policy ranks it (engine/decode_policy.h: 0 most urgent).
    uint32_t class_rank() const { return static_cast<uint32_t>(slo_class); }
    uint64_t ttft_target_ns = 0;
    // Its class's inter-token target: how far behind its own pace a decode worker
    // may fall to let a prompt at risk compute on its cores (yield_budget_ns). 0: none.
    uint64_t itl_target_ns = 0;
    // The KV arena whose workers must compute it, -1: any (bound_arena). A context's requests (its
    // KV computed, or a completion on it) are bound to the arena the front's context
    // store keeps its blocks in (arena 0): the blocks it offers and the ones that come
    // back are that arena's ids. On one arena every worker qualifies; on GPU pairs
    // the router sends the request to that arena's pair only, even when another
    // pair's queue is shorter or the pair is down (it waits for the restart).
    // Stored as arena + 1, so that zeroed parameters bind nothing.
    uint32_t arena_plus_one = 0;
    void bind_arena(uint32_t a) { arena_plus_one = a + 1; }
    int32_t bound_arena() const { return static_cast<int32_t>(arena_plus_one) - 1; }
    // logit_bias (OpenAI's): its entries, whose table is in the request's data
    // (roles/request_data.h), applied where the token is picked (model/sampler.h
    // TokenConstraints; on a GPU, on the device).
    using Bias = TokenBias;
    uint32_t n_bias = 0;
    // Bytes of the request's data in its slot (shm::RequestTable::set_ext_data), 0:
    // none. A worker that cannot read exactly that much, undamaged, fails the
    // request (ReqError::Data) rather than run it without.
    uint32_t data_bytes = 0;
    // Its "speculative" (engine/drafter.h draft_limit): the server's drafting, none,
    // or paced drafts up to max_draft (0: the server's depth, or kAutoDraftTokens).
    DraftMode draft_mode = DraftMode::Server;
    uint8_t max_draft = 0;
    // Its "speculative.pool": false (1) keeps it out of the decode worker's pool of
    // earlier outputs both ways: none of its drafts come from there, and its output
    // is not added. The pool never changes an output, but it makes one request's
    // speed depend on what others wrote: a client may not want its answers to time
    // another's, or another's to time its own.
    uint8_t no_draft_pool = 0;
    uint8_t draft_pad_[1] = {};
};
static_assert(std::is_trivially_copyable_v<RequestParams> && sizeof(RequestParams) <= shm::kReqParamBytes);

inline RequestParams request_params(const shm::RequestTable& t, uint32_t slot) {
    RequestParams p;
    std::memcpy(&p, t.slot(slot).params, sizeof p);
    return p;
}

// The rules its generation stops by (engine/token_step.h).
inline StopRules stop_rules(const RequestParams& p) { return {p.max_tokens, p.stop_at_eog != 0, p.min_tokens}; }

// Fills a log-probability row (shm::kLogprobRow entries) from a token's logits: the
// model's distribution (log-softmax of the raw logits, before any sampling
// parameter), the sampled token first, then the `top` most likely, most likely first.
// (The workers compute it: src/roles/decode_worker.cpp, prefill_worker.cpp.)
void fill_logprobs(const float* logits, int64_t n_vocab, int32_t sampled, int top, shm::TokenLogprob* row);

// The journal fields of a line about request r (base/log.h): DUET_REQUEST=<slot>.<
// generation>, and DUET_REQUEST_ID=<the id its client was given> (cmpl-..., chatcmpl-...)
// where the front recorded one (its front record; empty, so left out, where not), so
// that `journalctl DUET_REQUEST_ID=cmpl-...` tells one client's request's story.
log::Field request_field(shm::ReqRef r);
log::Field request_id_field(const shm::RequestTable& t, shm::ReqRef r);

}  // namespace duet
