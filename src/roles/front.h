// The front: the HTTP server speaking the OpenAI API (Boost.Beast on Asio, one
// coroutine per connection on a few threads). It tokenizes, puts each request in a
// request slot, sends it to prefill, and streams the output tokens it finds in the
// slot (detokenized incrementally, never splitting a UTF-8 character; stop strings
// checked on the text). A client that goes away cancels its request.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "base/histogram.h"
#include "base/result.h"
#include "engine/scheduling.h"
#include "model/chat_template.h"
#include "model/tokenizer.h"
#include "roles/recovery.h"
#include "roles/routing.h"

namespace duet {

class ContextService;
class ResponseStore;

struct FrontOptions {
    std::string host = "127.0.0.1";
    uint16_t port = 8080;  // 0: any free port
    int io_threads = 2;
    std::string model_id;
    size_t max_body_bytes = 1 << 20;
    int request_timeout_s = 600;  // a request running longer is cancelled
    // /v1/contexts (roles/context_api.h), null: off (404 that says how to turn it on).
    // Its calls block: they run on a thread of the front's own, never an HTTP one.
    ContextService* contexts = nullptr;
    std::string api_key;          // "": none (roles/api_key.h)
    bool public_metrics = false;  // /metrics without the key
    // A dead front's requests this front adopted wait this long for their clients
    // (GET /v1/requests/{id}/events, an X-Request-Id retry) before they are cancelled.
    uint64_t resume_window_ns = kResumeWindowNs;
    // A stream whose client disconnected keeps running this long for the client to
    // come back the same way (an SSE client reconnects after any lost connection: it
    // cannot tell a dead front from a dropped one); then it is cancelled and freed.
    // 0: cancelled at once.
    uint64_t resume_grace_ns = kResumeGraceNs;
    // Classes, their targets and admission (engine/scheduling.h: --slo,
    // --admit-queue-tokens, --admit-slack).
    AdmissionOptions admission;
    // /v1/responses' stored responses (roles/responses.h): their directory (""): in
    // memory; with contexts, <contexts dir>/responses), and how many at most.
    std::string responses_dir;
    size_t responses_max = 256;
};

struct FrontCounters {
    std::atomic<uint64_t> requests{0}, errors{0}, finished{0}, cancelled{0}, failed{0}, tokens{0}, rejected_busy{0};
    std::atomic<uint64_t> prompt_tokens{0};
    // Seen by the front: from the request's arrival (body read) to its first token,
    // between tokens, to its end.
    Histogram ttft, itl, e2e;
    // From the slot's phase times: queued -> taken by prefill, prefill's work,
    // hand-off sent -> decode's first step with it.
    Histogram queue, prefill, handoff;
    // The front's own work: parse + template + tokenize + enqueue per request, and
    // read + detokenize + write per streamed event.
    Histogram admit, stream_event;
    // Scheduling: refusals by reason (A1 "ttft", A2 "queue"), requests ended by their
    // timeout, and per class the TTFT, the completions that ended and those that met
    // both targets (TTFT and mean ITL): SLO attainment and goodput.
    std::atomic<uint64_t> rejected_ttft{0}, rejected_queue{0}, rejected_kv{0}, timeouts{0};
    // Requests decode preempted that this front sent again: by recompute, and by swap
    // (ReqSlot::n_swapped: their KV is read back, not computed).
    std::atomic<uint64_t> preempted{0}, preempted_swap{0};
    std::array<Histogram, kSloClasses> class_ttft, class_itl;
    std::array<std::atomic<uint64_t>, kSloClasses> class_done{}, class_met{};
};

class Front {
public:
    Front(shm::Instance& inst, shm::ProcRef self, const Tokenizer& tok, ChatTemplate tmpl, FrontOptions o);
    ~Front();
    // Binds and starts the I/O threads.
    Status start();
    uint16_t port() const;
    // New requests get 503 from now on; running ones continue.
    void drain();
    // Cancels every running request (after a drain's grace period).
    void cancel_all();
    void stop();
    size_t in_flight() const;
    // When a timer on the event loop last ran (shm::monotonic_ns; every 100 ms while the
    // loop turns): what the systemd watchdog ping is conditioned on, so a wedged
    // event loop, not a side thread, decides it.
    uint64_t loop_alive_ns() const;
    // Sends a QUEUED request to a prefill worker (PrefillRouter::send: routed,
    // thread-safe). If its ring stays full for 2 s, fails the request instead and
    // returns false.
    bool send(shm::ReqRef r);
    FrontCounters& counters();
    // The router of this process's rings (one producer: every sender in the front
    // shares it), for the context service; and the service, set before start().
    PrefillRouter& router();
    void set_contexts(ContextService* c);

    // Frees the slots of the stream kept longest for a resume whose choices have all
    // ended (resume.cpp); false: there was none. Whoever found no free request slot
    // calls it and tries again while it returns true.
    bool release_ended_orphan();

    // The front's state and its parts (roles/front_impl.h), which only the front's
    // own files see.
    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace duet
