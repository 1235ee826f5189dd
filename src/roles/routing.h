// Routing: which prefill worker a request goes to (the least work, counting what
// each worker already caches of its prompt), which decode worker a prefill worker
// hands it off to, and the queue depths and liveness both decisions read.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "roles/wire.h"
#include "shm/instance.h"

namespace duet {

// What the router knows of one prefill worker for one request.
struct PrefillView {
    bool running = false;      // a live process holds this index (else it is being restarted)
    uint64_t ahead = 0;        // tokens it has to prefill before this request's
    uint64_t to_compute = 0;   // this request's tokens it would compute (less what it has cached)
    bool eligible = true;      // it may take the request (RequestParams::bind_arena: that arena's workers only)
};
// Least (ahead + 2 x to_compute): when this request would be done there (ahead +
// to_compute) plus the compute it takes from every later request (to_compute again).
// So the longest cached prefix wins unless its worker is busier by more than twice
// the work the prefix saves, and with nothing cached the shortest queue wins. Running
// workers before restarting ones; lowest index on ties. Only eligible workers (all
// when none is).
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
// Whether a process runs for at least one worker of each role (the front's
// readiness: requests are routed around a worker being restarted, and past spare
// indices). Whether every worker it started runs is the launcher's own question
// (it knows which indices it started: Launcher::all_running).
bool workers_running(shm::Instance& inst);

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

// How many leading blocks of a prompt (its chain of block hashes) arena a caches now.
uint32_t cached_prefix_blocks(const shm::KvArena& a, std::span<const shm::BlockHash> chain);

// Sends QUEUED requests to the prefill workers, one router per producing process
// (the front, or the launcher for re-driven requests): it owns the producer end of
// its ring to every prefill worker. Thread-safe.
class PrefillRouter {
public:
    // redrive: the launcher's rings; else the front's.
    PrefillRouter(shm::Instance& inst, bool redrive);
    // Picks a worker (pick_prefill), pushes the request on its ring and wakes it. If
    // the ring stays full for 2 s (the worker gone for good), fails the request
    // (ReqError::NotSent) and returns false; one bound to an arena no prefill worker
    // computes in (RequestParams::bind_arena) fails at once (ReqError::NoWorker).
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
        bool eligible = true;  // false: bound to an arena none of the workers computes in
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

}  // namespace duet
