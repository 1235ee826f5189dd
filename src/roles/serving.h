// What the serving roles (front, prefill, decode) agree on: the instance layout they
// share, the ring each message kind travels on, the message record, and the request
// parameters stored in a request slot.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "model/model.h"
#include "model/sampler.h"
#include "shm/instance.h"

namespace duet {

inline constexpr uint32_t kRingToPrefill = 0;  // front -> prefill: a request is QUEUED
inline constexpr uint32_t kRingToDecode = 1;   // prefill -> decode: a hand-off
inline constexpr uint32_t kRingRedrive = 2;    // launcher -> prefill: a re-driven request is QUEUED again

struct ServeLayout {
    std::string instance;
    uint32_t n_requests = 64;  // request slots
    int64_t n_ctx = 2048;      // tokens per request (prompt + output)
    uint32_t n_blocks = 0;     // KV blocks; 0: enough for every slot at full context, capped at 8 GiB of KV
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

// Sends a QUEUED request to prefill on `ring` (the caller is its one producer) and
// wakes prefill. If the ring stays full for 2 s (prefill gone), fails the request
// instead (ReqError::NotSent) and returns false.
bool send_to_prefill(shm::Instance& inst, shm::SpscProducer<WireMsg>& ring, shm::ReqRef r);

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
