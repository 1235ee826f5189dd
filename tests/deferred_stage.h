// A BounceKvStage (kv/kv_stage.h) between two host pools whose "device" copies
// happen only when they are waited on, as a GPU's asynchronous copies may: a stage
// that reads a half before wait() (B1) sees what was there before, one that refills
// a half before wait() (B2) is caught at the second start, and a copy left pending
// when pull or push returns (B3) is counted. Failures are injected per start or wait.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kv/kv_stage.h"

namespace duet::test {

class DeferredBounceStage final : public BounceKvStage {
public:
    // arena and mirror: one layout and block count; `chunk` blocks per half.
    static std::unique_ptr<DeferredBounceStage> make(KvPool& arena, KvPool& mirror, int32_t chunk) {
        auto bounce = std::move(KvPool::create(mirror.layout(), chunk * 2)).value();
        return std::unique_ptr<DeferredBounceStage>(new DeferredBounceStage(arena, mirror, std::move(bounce)));
    }

    int starts = 0, waits = 0;
    int fail_start_at = -1, fail_wait_at = -1;  // the n-th (0-based) start or wait fails
    std::vector<std::string> violations;        // B2 broken: a half started twice without a wait
    std::string log;                            // "s0 s1 w0 ...": starts and waits by half

    // Copies started and not waited on (B3: zero whenever pull or push has returned).
    int pending() const { return (pending_[0] ? 1 : 0) + (pending_[1] ? 1 : 0); }
    KvPool& bounce() { return *bounce_; }

protected:
    Status start_pull(std::span<const int32_t> arena, std::span<const int32_t> bounce, int half) override {
        return start(Copy{true, {arena.begin(), arena.end()}, {bounce.begin(), bounce.end()}}, half);
    }
    Status start_push(std::span<const int32_t> bounce, std::span<const int32_t> arena, int half) override {
        return start(Copy{false, {bounce.begin(), bounce.end()}, {arena.begin(), arena.end()}}, half);
    }
    Status wait(int half) override {
        const int n = waits++;
        note('w', half);
        std::optional<Copy> c = std::move(pending_[half]);
        pending_[half].reset();
        if (!c) return {};
        // The copy runs (a failed wait still leaves nothing running: B3 is about that).
        Status st = c->to_bounce ? copy_host_blocks(arena_, c->src, *bounce_, c->dst)
                                 : copy_host_blocks(*bounce_, c->src, arena_, c->dst);
        if (n == fail_wait_at) return make_error("injected: wait {} fails", n);
        return st;
    }

private:
    struct Copy {
        bool to_bounce = true;
        std::vector<int32_t> src, dst;
    };
    DeferredBounceStage(KvPool& arena, KvPool& mirror, std::unique_ptr<KvPool> bounce)
        : BounceKvStage(mirror, *bounce), arena_(arena), bounce_(std::move(bounce)) {}
    Status start(Copy c, int half) {
        const int n = starts++;
        note('s', half);
        if (n == fail_start_at) return make_error("injected: start {} fails", n);
        if (pending_[half]) violations.emplace_back(half == 0 ? "half 0 restarted before its wait" : "half 1 restarted before its wait");
        pending_[half] = std::move(c);
        return {};
    }
    void note(char what, int half) {
        log.push_back(what);
        log.push_back(static_cast<char>('0' + half));
        log.push_back(' ');
    }
    KvPool& arena_;
    std::unique_ptr<KvPool> bounce_;
    std::optional<Copy> pending_[2];
};

}  // namespace duet::test
