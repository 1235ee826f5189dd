// What the serving roles (front, prefill, decode) agree on: the instance layout they
// share, the ring each message kind travels on, the message record, and the request
// parameters stored in a request slot.
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "kv/kv_pool.h"
#include "model/model.h"
#include "model/sampler.h"
#include "shm/instance.h"

namespace duet {

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
};

// The shm instance for serving `model` with this layout.
shm::InstanceConfig serve_instance_config(const ServeLayout& l, const Model& model);

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
    Prefill = 1,      // prefill could not run it (out of KV blocks, say)
    Decode = 2,       // decode ran out of KV blocks
    NoWorker = 3,     // a worker role died and could not be restarted
    NotSent = 4,      // the queue to prefill stayed full
};

// Stored in a request slot's params bytes.
struct RequestParams {
    SamplingParams sampling;
    uint32_t max_tokens = 128;
    uint32_t stop_at_eog = 1;
    int32_t logprobs = -1;  // -1: none; else the sampled token's and this many top ones (<= kMaxTopLogprobs)
};

// ---------------------------------------------------------------- routing

// What the router knows of one prefill worker for one request.
struct PrefillView {
    bool running = false;      // a live process holds this index (else it is being restarted)
    uint64_t ahead = 0;        // tokens it has to prefill before this request's
    uint64_t to_compute = 0;   // this request's tokens it would compute (less what it has cached)
};
// Least (ahead + 2 x to_compute): when this request would be done there (ahead +
// to_compute) plus the compute it takes from every later request (to_compute again).
// So the longest cached prefix wins unless its worker is busier by more than twice
// the work the prefix saves, and with nothing cached the shortest queue wins. Running
// workers before restarting ones; lowest index on ties.
uint32_t pick_prefill(const std::vector<PrefillView>& v);

// What a prefill worker knows of one decode worker when handing a request off.
struct DecodeView {
    bool running = false;
    uint64_t items = 0;      // sequences it holds plus hand-offs waiting in its rings
    uint64_t max_items = 0;  // its batch size (0: not known yet)
    uint64_t tokens = 0;     // tokens in the sequences it holds
    bool near = true;        // on the prefill worker's NUMA node (or either is not known)
};
// A running worker with room in its batch, on the prefill worker's NUMA node (the KV
// pages prefill wrote are local there), with the fewest sequences, then the fewest
// tokens (the shortest steps). All KV blocks of a device's decode workers come from
// one arena, so free blocks do not tell them apart on one device.
uint32_t pick_decode(const std::vector<DecodeView>& v);
// Decode worker d as seen from a prefill worker on NUMA node `numa` (-1: unknown).
DecodeView decode_view(shm::Instance& inst, uint32_t d, int numa);

// Messages waiting for prefill worker p (from the front and the launcher), and for
// decode worker d (from every prefill worker).
uint64_t queued_for_prefill(shm::Instance& inst, uint32_t p);
uint64_t queued_for_decode(shm::Instance& inst, uint32_t d);
// Whether a process runs for every worker index of both roles (all: the launcher's
// "started"), or for at least one of each (the front's readiness: requests are
// routed around a worker being restarted).
bool workers_running(shm::Instance& inst, bool all);
// At least one prefill and one decode worker, at most kMaxServeWorkers in all.
Status check_worker_counts(int n_prefill, int n_decode);
// GPUs one instance serves on: 1 to kMaxServeGpus.
inline constexpr uint32_t kMaxServeGpus = 8;
Status check_gpu_count(int n_gpus);
// The workers of an instance, as its config says: CPU counts, or GPU pairs.
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
// The decode worker prefill worker p may hand off to: on GPU pairs only its own
// (d == p: the KV is in their GPU's arena); -1: any.
inline int32_t handoff_partner(const shm::InstanceConfig& c, uint32_t p) {
    return ServeRings::of(c).paired ? static_cast<int32_t>(p) : -1;
}
// Whether prefill and decode workers write different arenas (a hand-off copies KV).
inline bool handoff_copies(const shm::InstanceConfig& c) { return c.kv_split; }

// Which prefill worker is computing a prompt with the same leading full blocks: a
// request that shares a prefix with one still being prefilled waits there for its
// blocks instead of computing them again elsewhere (n choices, the same system
// prompt arriving in a burst). Once prefilled, the blocks are in the arena's prefix
// index, which every worker of the device uses alike: no worker is favoured then.
// Keys are chained 64-bit hashes of the token blocks (a routing hint only: the
// prefix cache itself uses SHA-256 block hashes).
class PrefixAffinity {
public:
    static std::vector<uint64_t> block_keys(const int32_t* tokens, size_t n, size_t block_tokens);
    struct Match {
        int32_t worker = -1;
        size_t blocks = 0;  // leading blocks in common
    };
    // The longest match whose request `live` says is still being prefilled.
    template <typename Live>
    Match find(const std::vector<uint64_t>& keys, Live&& live) const {
        for (size_t i = keys.size(); i-- > 0;) {
            auto it = map_.find(keys[i]);
            if (it != map_.end() && live(it->second.req)) return {static_cast<int32_t>(it->second.worker), i + 1};
        }
        return {};
    }
    // Records that `req`, on `worker`, computes these blocks; past kMaxKeys, the
    // entries whose requests `live` no longer holds go first, then all.
    template <typename Live>
    void note(const std::vector<uint64_t>& keys, uint32_t worker, shm::ReqRef req, Live&& live) {
        if (map_.size() + keys.size() > kMaxKeys) {
            std::erase_if(map_, [&](const auto& e) { return !live(e.second.req); });
            if (map_.size() + keys.size() > kMaxKeys) map_.clear();
        }
        for (uint64_t k : keys) map_[k] = Entry{worker, req};
    }
    size_t size() const { return map_.size(); }

    static constexpr size_t kMaxKeys = 1u << 16;

private:
    struct Entry {
        uint32_t worker;
        shm::ReqRef req;
    };
    std::unordered_map<uint64_t, Entry> map_;
};

// Sends QUEUED requests to the prefill workers, one router per producing process
// (the front, or the launcher for re-driven requests): it owns the producer end of
// its ring to every prefill worker. Thread-safe.
// How many leading blocks of a prompt (its chain of block hashes) arena a caches now.
uint32_t cached_prefix_blocks(const shm::KvArena& a, std::span<const shm::BlockHash> chain);

class PrefillRouter {
public:
    // redrive: the launcher's rings; else the front's.
    PrefillRouter(shm::Instance& inst, bool redrive);
    // Picks a worker (pick_prefill), pushes the request on its ring and wakes it. If
    // the ring stays full for 2 s (the worker gone for good), fails the request
    // (ReqError::NotSent) and returns false.
    bool send(shm::ReqRef r);
    // Requests sent to a worker that is no longer running and not taken yet: sends
    // them to a running one (instead of waiting for the restart). Returns how many.
    // Called now and then by the front and the launcher.
    uint32_t resend_stranded();
    // Requests sent to each worker so far (for tests and /metrics).
    std::vector<uint64_t> sent_counts();

private:
    struct Choice {
        uint32_t worker = 0;
        bool running = false;
        uint64_t to_compute = 0;
        std::vector<uint64_t> keys;  // of the prompt's full blocks (with_affinity)
    };
    // pick_prefill over every worker for request r (caller holds mu_).
    Choice choose(shm::ReqRef r, bool with_affinity);
    bool being_prefilled(shm::ReqRef q) const;
    struct Sent {
        shm::ReqRef req;
        uint32_t attempt;
        uint64_t tokens;  // what the worker would compute of it
    };
    shm::Instance& inst_;
    ServeRings rings_;
    std::mutex mu_;
    std::vector<shm::SpscProducer<WireMsg>> out_;
    std::vector<std::deque<Sent>> queued_;  // per worker: sent, maybe not taken yet
    std::vector<uint64_t> sent_;
    PrefixAffinity affinity_;
    // GPU pairs (an arena per pair): what each pair's arena caches of the prompt
    // counts as that worker's cached prefix, so a shared prompt returns to the GPU
    // that holds it. (One arena: every worker sees the same cache; not consulted.)
    shm::BlockHasher hasher_;
    std::vector<shm::BlockHash> chain_;
};

// Fails every request in flight (QUEUED, PREFILLING, DECODING) with `why`, and
// wakes the front to answer their clients.
void fail_in_flight(shm::Instance& inst, ReqError why);

// Requests whose client (the front that submitted them) is gone: running ones are
// cancelled, finished ones freed. The launcher calls this after a front died, and
// now and then for those that ended later. Returns how many it touched.
uint32_t sweep_orphans(shm::Instance& inst);

// Fills a log-probability row (shm::kLogprobRow entries) from a token's logits: the
// model's distribution (log-softmax of the raw logits, before any sampling
// parameter), the sampled token first, then the `top` most likely, most likely first.
void fill_logprobs(const float* logits, int64_t n_vocab, int32_t sampled, int top, shm::TokenLogprob* row);
static_assert(std::is_trivially_copyable_v<RequestParams> && sizeof(RequestParams) <= shm::kReqParamBytes);

inline RequestParams request_params(const shm::RequestTable& t, uint32_t slot) {
    RequestParams p;
    std::memcpy(&p, t.slot(slot).params, sizeof p);
    return p;
}

}  // namespace duet
