// Request table: fixed slots, one per request in flight. The slot is the truth about
// a request (rings only carry events that point at it as (slot, generation)).
//
// State and generation share one atomic word; every transition is a CAS naming the
// generation and the state it expects, so a stale message (older generation) or a
// second actor racing for the same transition loses cleanly. The generation is
// bumped when a FREE slot is taken.
//
//   FREE -> QUEUED -> PREFILLING -> DECODING -> FINISHED -> FREE
//   QUEUED | PREFILLING | DECODING -> FAILED | CANCELLED -> FREE
//   PREFILLING | DECODING -> QUEUED   (re-driven after its worker died)
//   PREFILLING -> FINISHED            (a request that ends at its first token)
//
// Output tokens are appended by the one process that owns the request, then the
// count is published with a release store; readers load the count with acquire
// and read that many tokens.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/result.h"
#include "shm/registry.h"

namespace duet::shm {

enum class ReqState : uint32_t { Free = 0, Queued, Prefilling, Decoding, Finished, Failed, Cancelled };
const char* req_state_name(ReqState s);
bool req_transition_allowed(ReqState from, ReqState to);

inline constexpr uint32_t kReqParamBytes = 256;  // sampling parameters, opaque to shm

// Log-probabilities of output tokens, for requests that ask for them: per output
// token a row of 1 + kMaxTopLogprobs entries, the sampled token first, then the most
// likely ones (id -1 past those asked for). Written by the owner before it publishes
// the token's count, like the token itself.
inline constexpr uint32_t kMaxTopLogprobs = 20;
struct TokenLogprob {
    int32_t id;
    float logprob;
};
inline constexpr uint32_t kLogprobRow = 1 + kMaxTopLogprobs;

struct ReqRef {
    uint32_t slot = 0;
    uint32_t gen = 0;
    friend bool operator==(ReqRef a, ReqRef b) { return a.slot == b.slot && a.gen == b.gen; }
};

// The front's record of a request (per slot, after the log-probability rows): what a
// restarted front needs to answer the request's client when it comes back (its
// parameters, its response id), opaque to shm. Valid for the request (slot,
// generation) it was written for; a reused slot's old record is not. `orphaned_ns`:
// when a sweeper first saw the request's client dead (0: not yet), so requests wait
// for their client to come back a while before they are cancelled.
inline constexpr uint32_t kReqFrontBytes = 2048;
struct ReqFrontRecord {
    std::atomic<uint64_t> ref;  // (gen << 32) | slot of the request it describes, +1 (0: none)
    std::atomic<uint64_t> orphaned_ns;
    uint32_t len;
    uint32_t pad_;
    uint8_t data[kReqFrontBytes - 24];
};
static_assert(sizeof(ReqFrontRecord) == kReqFrontBytes);

// A request's own data of variable size (per slot, after the front records): bytes
// opaque to shm that its client writes once, before the request is sent anywhere,
// and every process that takes the request reads (the serving layer keeps what does
// not fit the fixed parameters there). Valid for the request (slot, generation) it
// was written for, like the front record: a reused slot's old data is not, so it
// needs no freeing. At most RequestTableConfig::ext_bytes per request.
struct ReqExtHeader {
    std::atomic<uint64_t> ref;  // (gen << 32) | slot of the request it belongs to, +1 (0: none)
    uint32_t len;
    uint32_t pad_[13];
};
static_assert(sizeof(ReqExtHeader) == 64);

struct alignas(64) ReqSlot {
    // (attempt << 56) | (generation << 24) | (owner registry slot + 1) << 8 | ReqState. The owner is in
    // the state word so that taking a request and naming its owner is one CAS: no
    // crash can leave a request that nobody owns. (A registry slot is reused only
    // after its dead process's requests were recovered, so the slot index alone
    // names the process.)
    std::atomic<uint64_t> state_gen;
    std::atomic<uint32_t> cancel;     // the generation whose cancellation was asked for (0: none)
    std::atomic<uint32_t> n_cached;   // prompt tokens whose KV came from the prefix cache
    std::atomic<uint32_t> n_prompt;
    std::atomic<uint32_t> n_output;   // published count of output tokens
    std::atomic<uint32_t> n_blocks;   // published count of block-table entries
    std::atomic<int32_t> error_code;
    // Positions of its KV that decode swapped out when it preempted the request (a
    // blob in the workers' swap directory, named by slot and generation; 0: none, it
    // is computed again). Written before the transition back to QUEUED; prefill
    // reads the blob instead of computing them and sets it to 0.
    std::atomic<uint32_t> n_swapped;
    // Why it ended, as the process that ended it says: a code the serving layer
    // defines (roles: engine/token_step.h's Finish), opaque here. Written before the
    // transition that publishes the end; 0 until then.
    std::atomic<uint32_t> end_code;
    // Tokens decode drafted for it and checked in verify rows, and those of them it
    // kept (they are among its output tokens): its usage, next to the table's totals.
    // Added by the owner as it emits (a re-drive's new owner adds on).
    std::atomic<uint32_t> n_drafted;
    std::atomic<uint32_t> n_draft_kept;
    // Phase times (monotonic_ns), written by whoever runs the phase before its
    // state transition publishes them; 0 until then. For latency metrics only.
    uint64_t submit_ns;      // queued by the front
    std::atomic<uint64_t> prefill_ns;     // taken by prefill (the latest attempt)
    std::atomic<uint64_t> handoff_ns;     // hand-off sent by prefill
    std::atomic<uint64_t> first_step_ns;  // decode's first step with it began
    // ProcRef::pack() of the front that submitted it and answers its client (0:
    // none): when that process is gone, nobody will read the request, and the
    // launcher cancels and frees it.
    std::atomic<uint64_t> client;
    // ProcRef::pack() of the process a finished request's KV blocks were moved to
    // (RequestParams keep_kv / return_kv: the client when the worker ended it; 0:
    // none). Written before the transition that publishes the end. A front that
    // adopted the request from a dead one takes the blocks only if it is named here:
    // the dead front may have been named instead (its recovery drops them).
    std::atomic<uint64_t> kv_to;
    uint8_t params[kReqParamBytes];
    // Followed by int32 tokens[max_tokens] (prompt, then output) and int32
    // blocks[max_blocks], at offsets given by the table header.
};

struct RequestTableConfig {
    uint32_t n_slots = 64;
    uint32_t max_tokens = 4096;  // prompt + output per request
    uint32_t block_tokens = 16;
    // Bytes of a request's own data (ReqExtHeader) at most. Pages are touched only
    // where a request writes data, so the bound costs address space, not memory.
    uint32_t ext_bytes = 64 * 1024;
};

struct RequestTableHeader {
    uint32_t magic;
    uint32_t n_slots;
    uint32_t max_tokens;
    uint32_t max_blocks;
    uint64_t slot_bytes;
    std::atomic<uint32_t> hint;  // where the next reserve() starts looking (relaxed: a hint)
    // Serving statistics, here because every role maps this table: the launcher
    // counts, the front reports them in /metrics.
    std::atomic<uint32_t> worker_restarts;
    std::atomic<uint64_t> redriven;
    // Preemptions by swap (ReqSlot::n_swapped), and the bytes of KV they wrote.
    std::atomic<uint64_t> swaps;
    std::atomic<uint64_t> swapped_bytes;
    // Workers that changed role (`duet serve --rebalance`): to prefill, to decode.
    std::atomic<uint32_t> role_changes[2];
    // Prefill passes stopped for a critical request (WorkerOptions::pass_interrupt).
    std::atomic<uint64_t> passes_interrupted;
    // Drafted tokens decode checked in verify rows, and those the draws kept, by
    // where the drafts came from (a number the serving layer gives its drafters).
    static constexpr int kDraftSources = 2;
    std::atomic<uint64_t> drafted[kDraftSources];
    std::atomic<uint64_t> drafts_accepted[kDraftSources];
    uint32_t ext_bytes;  // RequestTableConfig::ext_bytes
    uint8_t pad[4];
    // Verify rows decode ran (a row of the newest token and its drafts), by where
    // the drafts came from.
    std::atomic<uint64_t> verify_rows[kDraftSources];
};
static_assert(sizeof(RequestTableHeader) == 128);

class RequestTable {
public:
    static size_t bytes(const RequestTableConfig& c);
    static Status init(void* mem, const RequestTableConfig& c);
    static Result<RequestTable> attach(void* mem);

    uint32_t n_slots() const { return h_->n_slots; }
    uint32_t max_tokens() const { return h_->max_tokens; }
    uint32_t max_blocks() const { return h_->max_blocks; }
    uint32_t ext_bytes() const { return h_->ext_bytes; }
    std::atomic<uint32_t>& worker_restarts() const { return h_->worker_restarts; }
    // [0]: a decode worker became a prefill worker; [1]: the other way.
    std::atomic<uint32_t>& role_changes(bool to_decode) const { return h_->role_changes[to_decode ? 1 : 0]; }
    std::atomic<uint64_t>& redriven() const { return h_->redriven; }
    std::atomic<uint64_t>& swaps() const { return h_->swaps; }
    std::atomic<uint64_t>& swapped_bytes() const { return h_->swapped_bytes; }
    std::atomic<uint64_t>& passes_interrupted() const { return h_->passes_interrupted; }
    // source < RequestTableHeader::kDraftSources.
    std::atomic<uint64_t>& drafted(int source) const { return h_->drafted[source]; }
    std::atomic<uint64_t>& drafts_accepted(int source) const { return h_->drafts_accepted[source]; }
    std::atomic<uint64_t>& verify_rows(int source) const { return h_->verify_rows[source]; }
    ReqSlot& slot(uint32_t i) const {
        return *reinterpret_cast<ReqSlot*>(reinterpret_cast<uint8_t*>(h_ + 1) + i * h_->slot_bytes);
    }
    int32_t* tokens(uint32_t i) const { return reinterpret_cast<int32_t*>(&slot(i) + 1); }
    int32_t* blocks(uint32_t i) const { return tokens(i) + h_->max_tokens; }
    // The log-probability row of output token `out_index` of slot i (kLogprobRow entries).
    TokenLogprob* logprobs(uint32_t i, uint32_t out_index) const {
        auto* base = reinterpret_cast<TokenLogprob*>(reinterpret_cast<uint8_t*>(h_ + 1) + h_->n_slots * h_->slot_bytes);
        return base + (static_cast<size_t>(i) * h_->max_tokens + out_index) * kLogprobRow;
    }
    ReqFrontRecord& front_record(uint32_t i) const {
        auto* base = reinterpret_cast<uint8_t*>(logprobs(0, 0)) +
                     sizeof(TokenLogprob) * kLogprobRow * static_cast<size_t>(h_->max_tokens) * h_->n_slots;
        return *reinterpret_cast<ReqFrontRecord*>(base + static_cast<size_t>(i) * kReqFrontBytes);
    }
    // The client, after submit() and before it sends the request anywhere: its record
    // of r (at most kReqFrontBytes - 24 bytes). Errors: too long, r not in the slot.
    Status set_front_data(ReqRef r, const void* data, uint32_t len);
    // r's record, if one was written for it (and r still holds the slot).
    std::optional<std::string> front_data(ReqRef r) const;
    // The client, after submit() and before it sends the request anywhere: r's own
    // data (at most ext_bytes()). Errors: too long (naming the bound), r not in the slot.
    Status set_ext_data(ReqRef r, const void* data, uint32_t len);
    // r's data, if some was written for it (and r still holds the slot).
    std::optional<std::vector<uint8_t>> ext_data(ReqRef r) const;
    // Makes `client` the process that answers r's client (a restarted front adopting
    // the request); false if the slot no longer holds r.
    bool set_client(ReqRef r, ProcRef client);

    // reserve() + queue(): the usual way in. Errors: table full, prompt too long or
    // empty, params too big.
    Result<ReqRef> submit(ProcRef owner, const int32_t* prompt, uint32_t n_prompt, const void* params,
                          uint32_t params_bytes);
    // Takes a FREE slot for owner in one CAS: still FREE, but with a new generation
    // and the owner set, so no other submitter takes it and nobody acts on it.
    Result<ReqRef> reserve(ProcRef owner);
    // Fills a reserved slot (prompt, parameters) and publishes it QUEUED with a
    // release store.
    // client: the process that will read the request (see ReqSlot::client).
    Status queue(ReqRef r, const int32_t* prompt, uint32_t n_prompt, const void* params, uint32_t params_bytes,
                 ProcRef client = {});
    // CAS from `from` to `to` at r's generation; false if the slot is elsewhere (or
    // the transition is not allowed). Every request that is not FREE has an owner:
    // new_owner, when valid, becomes it; otherwise the owner stays.
    [[nodiscard]] bool transition(ReqRef r, ReqState from, ReqState to, ProcRef new_owner = {});
    // Makes new_owner the owner without changing the state or the attempt, only
    // while `from` owns r (a recoverer taking a dead worker's requests: one that a
    // live process took meanwhile, as a hand-off's commit does, is left alone).
    bool adopt(ReqRef r, ProcRef from, ProcRef new_owner);
    ReqState state(uint32_t slot) const;
    // The attempt (0-255, wrapping): bumped whenever a running request goes back to
    // QUEUED, so messages about an earlier attempt are recognisably stale.
    uint32_t attempt(uint32_t slot) const;
    // Whether r is exactly (attempt, state, owner) now.
    bool is_with(ReqRef r, uint32_t attempt, ReqState s, ProcRef owner) const;
    // One exact CAS from (r.gen, attempt, from, from_owner) to (to, to_owner): what a
    // hand-off commits with, so it cannot act on a later attempt of the request.
    bool commit(ReqRef r, uint32_t attempt, ReqState from, ProcRef from_owner, ReqState to, ProcRef to_owner);
    // The owner's registry slot, or -1.
    int32_t owner_slot(uint32_t slot) const;
    ReqRef current(uint32_t slot) const;
    bool is(ReqRef r, ReqState s) const;

    // Owner only, while PREFILLING or DECODING: appends output tokens and publishes
    // the new count.
    Status append_output(ReqRef r, const int32_t* toks, uint32_t n);
    // Output tokens [from, published) appended to out; returns the published count.
    // An error if the slot no longer holds request r (reused: its tokens are another
    // request's), checked after the copy.
    Result<uint32_t> read_output(ReqRef r, uint32_t from, std::vector<int32_t>& out) const;
    // Owner only, while PREFILLING or DECODING: appends block-table entries (entries
    // already published are never rewritten, so readers need no lock) and publishes
    // the new count. reset_blocks() empties the table (before a re-drive).
    Status append_blocks(ReqRef r, const int32_t* b, uint32_t n);
    Status reset_blocks(ReqRef r);
    // The submitter, while QUEUED and before the request is sent: the block table
    // names blocks whose KV the request's first positions already have (its
    // client holds references on them until the request ends; the worker that
    // takes the request reads them, takes its own references, and empties the
    // table with reset_blocks()). Replaces what the table held.
    Status offer_blocks(ReqRef r, const int32_t* b, uint32_t n);

    void cancel(ReqRef r);
    bool cancelled(ReqRef r) const;

    // A FREE slot still reserved by a submitter that died while filling it: makes
    // it available again.
    bool unreserve(ReqRef r);
    // Requests (and reservations) owned by registry slot `slot` (for re-driving or failing them after
    // its process died).
    std::vector<ReqRef> owned_by(uint32_t registry_slot) const;

private:
    Status check_running(ReqRef r) const;
    ReqExtHeader& ext(uint32_t i) const;
    RequestTableHeader* h_ = nullptr;
};

}  // namespace duet::shm
