// Micro-benchmarks of the shared-memory substrate's single-thread costs, with Boost
// doing the same work as the reference. Cross-core and cross-process figures are
// `duet bench shm` (bench/shm_bench.cpp).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include <boost/lockfree/spsc_queue.hpp>
#include <boost/lockfree/stack.hpp>

#include "shm/kv_arena.h"
#include "shm/spsc_ring.h"

namespace {

using namespace duet;

constexpr uint64_t kCap = 1024;
constexpr uint32_t kBlocks = 32768;

struct alignas(64) Record64 {
    uint64_t seq;
    uint8_t payload[56];
};

using BoostRing = boost::lockfree::spsc_queue<Record64, boost::lockfree::capacity<kCap>>;
using BoostStack = boost::lockfree::stack<int32_t, boost::lockfree::capacity<kBlocks>>;

struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
};
using Mem = std::unique_ptr<void, FreeDeleter>;

Mem aligned(size_t bytes) { return Mem(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)); }

// Push then pop, one record (batch 1) or `batch` at a time, in one thread: the
// ring's own instruction cost, no cache-line transfer.
void BM_RingDuet(benchmark::State& st) {
    const size_t batch = static_cast<size_t>(st.range(0));
    Mem mem = aligned(shm::ring_bytes(sizeof(Record64), kCap));
    if (!shm::ring_init(mem.get(), sizeof(Record64), kCap)) st.SkipWithError("ring_init failed");
    auto* h = static_cast<shm::RingHeader*>(mem.get());
    shm::SpscProducer<Record64> p(h);
    shm::SpscConsumer<Record64> c(h);
    std::vector<Record64> in(batch), out(batch);
    uint64_t seq = 0;
    for (auto _ : st) {
        for (auto& r : in) r.seq = seq++;
        if (batch == 1) {
            p.try_push(in[0]);
            c.try_pop(out[0]);
        } else {
            p.push(in.data(), batch);
            c.pop(out.data(), batch);
        }
        benchmark::DoNotOptimize(out[batch - 1].seq);
    }
    if (out[batch - 1].seq != seq - 1) st.SkipWithError("ring lost a record");
    st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * batch));
}
BENCHMARK(BM_RingDuet)->Arg(1)->Arg(32);

void BM_RingBoost(benchmark::State& st) {
    const size_t batch = static_cast<size_t>(st.range(0));
    Mem mem = aligned(sizeof(BoostRing));
    auto* q = new (mem.get()) BoostRing();
    std::vector<Record64> in(batch), out(batch);
    uint64_t seq = 0;
    for (auto _ : st) {
        for (auto& r : in) r.seq = seq++;
        if (batch == 1) {
            q->push(in[0]);
            q->pop(out[0]);
        } else {
            q->push(in.data(), batch);
            q->pop(out.data(), batch);
        }
        benchmark::DoNotOptimize(out[batch - 1].seq);
    }
    if (out[batch - 1].seq != seq - 1) st.SkipWithError("queue lost a record");
    st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * batch));
    q->~BoostRing();
}
BENCHMARK(BM_RingBoost)->Arg(1)->Arg(32);

// alloc(n) then free of those n blocks, one thread; items are blocks.
void BM_ArenaAllocFree(benchmark::State& st) {
    const uint32_t n = static_cast<uint32_t>(st.range(0));
    shm::ArenaConfig cfg;
    cfg.n_blocks = kBlocks;
    cfg.n_users = 4;
    Mem mem = aligned(shm::KvArena::bytes(cfg));
    if (!shm::KvArena::init(mem.get(), cfg)) st.SkipWithError("arena init failed");
    auto arena = shm::KvArena::attach(mem.get());
    auto user = arena->join(shm::ProcRef{0, 1});
    std::vector<int32_t> ids(n);
    for (auto _ : st) {
        if (!arena->alloc(*user, n, ids.data())) st.SkipWithError("alloc failed");
        arena->unref(*user, ids.data(), n);
        benchmark::DoNotOptimize(ids[0]);
    }
    st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * n));
}
BENCHMARK(BM_ArenaAllocFree)->Arg(1)->Arg(16);

// The reference: a lock-free stack of free block ids, pop n then push n.
void BM_BoostStackPopPush(benchmark::State& st) {
    const uint32_t n = static_cast<uint32_t>(st.range(0));
    Mem mem = aligned(sizeof(BoostStack));
    auto* s = new (mem.get()) BoostStack();
    for (uint32_t b = 0; b < kBlocks; ++b) s->bounded_push(static_cast<int32_t>(b));
    std::vector<int32_t> ids(n);
    for (auto _ : st) {
        for (auto& id : ids) s->pop(id);
        for (int32_t id : ids) s->bounded_push(id);
        benchmark::DoNotOptimize(ids[0]);
    }
    st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * n));
    s->~BoostStack();
}
BENCHMARK(BM_BoostStackPopPush)->Arg(1)->Arg(16);

// The prefix-cache key of one 16-token block (SHA-256 over parent, tokens, model, salt).
void BM_BlockHash(benchmark::State& st) {
    int32_t tokens[16];
    for (int i = 0; i < 16; ++i) tokens[i] = 1000 + i * 37;
    shm::BlockHash h{};
    shm::BlockHasher hasher;
    for (auto _ : st) {
        h = hasher.hash(h, tokens, 16, 0x1234, "");
        benchmark::DoNotOptimize(h);
    }
    st.SetItemsProcessed(static_cast<int64_t>(st.iterations()));
}
BENCHMARK(BM_BlockHash);

}  // namespace

BENCHMARK_MAIN();
