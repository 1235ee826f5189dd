// The front: the HTTP server speaking the OpenAI API (Boost.Beast on Asio, one
// coroutine per connection on a few threads). It tokenizes, puts each request in a
// request slot, sends it to prefill, and streams the output tokens it finds in the
// slot (detokenized incrementally, never splitting a UTF-8 character; stop strings
// checked on the text). A client that goes away cancels its request.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/histogram.h"
#include "base/result.h"
#include "engine/scheduling.h"
#include "model/chat_template.h"
#include "model/tokenizer.h"
#include "roles/api_key.h"
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
    uint16_t port() const { return port_; }
    // New requests get 503 from now on; running ones continue.
    void drain() { draining_.store(true, std::memory_order_relaxed); }  // a flag: orders nothing
    // Cancels every running request (after a drain's grace period).
    void cancel_all();
    void stop();
    size_t in_flight() const { return in_flight_.load(std::memory_order_relaxed); }
    // When a timer on the event loop last ran (shm::monotonic_ns; every 100 ms while the
    // loop turns): what the systemd watchdog ping is conditioned on, so a wedged
    // event loop, not a side thread, decides it.
    uint64_t loop_alive_ns() const { return loop_alive_ns_.load(std::memory_order_relaxed); }
    // Sends a QUEUED request to a prefill worker (PrefillRouter::send: routed,
    // thread-safe). If its ring stays full for 2 s, fails the request instead and
    // returns false.
    bool send(shm::ReqRef r);
    FrontCounters& counters() { return counters_; }
    // The router of this process's rings (one producer: every sender in the front
    // shares it), for the context service; and the service, set before start().
    PrefillRouter& router() { return router_; }
    void set_contexts(ContextService* c) { opts_.contexts = c; }

    // Frees the slots of the stream kept longest for a resume whose choices have all
    // ended (resume.cpp); false: there was none. Whoever found no free request slot
    // calls it and tries again while it returns true.
    bool release_ended_orphan();

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
    shm::Instance& inst_;
    shm::ProcRef self_;
    const Tokenizer& tok_;
    ChatTemplate tmpl_;
    FrontOptions opts_;
    ApiKey key_;
    uint16_t port_ = 0;
    std::atomic<bool> draining_{false};
    std::atomic<size_t> in_flight_{0};
    PrefillRouter router_;
    FrontCounters counters_;
    std::unique_ptr<ResponseStore> responses_;  // opened by start()
    std::vector<std::thread> threads_;
    std::thread notifier_;
    std::atomic<bool> quit_{false};
    std::atomic<uint64_t> loop_alive_ns_{0};
    // Admission (engine/scheduling.h) over the prompt tokens this front has admitted
    // and prefill has not finished, per class, and prefill's measured rate.
    std::mutex sched_mu_;
    AdmissionControl admission_{AdmissionOptions{}};
    PrefillRateMeter prefill_rate_;       // passes on prefill's own cores
    PrefillRateMeter prefill_wide_rate_;  // passes with the partner's cores too (admission_rate)
    QueueView queue_;
    KvView kv_;  // A3's view of the arenas (sample_kv)
    uint32_t prefill_workers_ = 1;  // running: the queue drains at their summed rate
    // Each registry slot's work counters as last read: (generation, busy ns, tokens,
    // wide busy ns, wide tokens).
    std::vector<std::array<uint64_t, 5>> work_seen_;
    RetryMemory retries_;  // prompts A1 refused (engine/scheduling.h)
    // Decides; an admitted request's tokens (if any) join the queue, `at` its place
    // in it (QueueView::prompts, by prefill's order key for a prompt of
    // `prompt_length` tokens). `key`: the prompt's RetryMemory key.
    using QueueAt = std::multimap<uint64_t, int64_t>::iterator;
    AdmissionDecision admit_tokens(SloClass c, int64_t tokens, int64_t prompt_length, uint64_t key, QueueAt& at);
    // They leave it: prefill is done with them (the first token came) or the request
    // ended without one.
    void queue_left(SloClass c, int64_t tokens, QueueAt at);
    // Reads the running prefill workers' work counters into prefill_rate_ and
    // prefill_wide_rate_ (the notifier thread, every 50 ms).
    void sample_prefill_work();
    // Reads the arenas' census and the running requests into kv_ (the notifier
    // thread, every 50 ms): blocks held by requests (not the contexts', which give
    // way), and each running request's blocks and time left at itl_s_ per token.
    void sample_kv();
    std::atomic<double> itl_s_{0};  // decode's time per token, an average over recent gaps (0: none seen)
    // Sends a request decode preempted (QUEUED again, at an attempt other than
    // `sent_attempt`, which it updates) back to prefill.
    void resend_if_preempted(shm::ReqRef r, uint32_t& sent_attempt);
    void notify_loop();
    void adopt_orphans();
    void expire_orphans(uint64_t now_ns);
    void forget_orphan(const std::string& id);  // answered: nothing more to do for it

    friend struct FrontSession;
};

}  // namespace duet
