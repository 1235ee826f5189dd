// The bounce stage (kv/kv_stage.h, BounceKvStage: what a GPU arena's contexts go
// through): every block arrives whole, in chunks through two halves that overlap,
// and rules B1-B3 hold with device copies that run only when waited on.
#include "kv/kv_stage.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include <gtest/gtest.h>

#include "deferred_stage.h"

using namespace duet;
using duet::test::DeferredBounceStage;

namespace {

KvLayout layout(KvDtype dt = KvDtype::F16) {
    KvLayout l;
    l.n_layer = 3;
    l.n_head_kv = 2;
    l.head_dim = 4;
    l.block_tokens = 4;
    l.dtype = dt;
    return l;
}

constexpr int32_t kBlocks = 40;

void fill(KvPool& p, uint32_t seed) {
    std::mt19937 rng(seed);
    auto* b = static_cast<uint8_t*>(p.data());
    const size_t n = p.layout().block_bytes() * static_cast<size_t>(kBlocks);
    for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(rng());
}

// What `to` holds after every layer of `blocks` is copied from `from` (same ids),
// computed from the layout (data[layer][block] tiles), not by the code under test.
std::vector<uint8_t> expected(const KvPool& from, const KvPool& to, std::span<const int32_t> blocks) {
    const KvLayout& l = from.layout();
    const size_t tile = l.tile_bytes(), all = l.block_bytes() * static_cast<size_t>(kBlocks);
    std::vector<uint8_t> out(static_cast<const uint8_t*>(to.data()), static_cast<const uint8_t*>(to.data()) + all);
    for (int32_t layer = 0; layer < l.n_layer; ++layer)
        for (int32_t b : blocks) {
            const size_t off = (static_cast<size_t>(layer) * kBlocks + static_cast<size_t>(b)) * tile;
            std::memcpy(out.data() + off, static_cast<const uint8_t*>(from.data()) + off, tile);
        }
    return out;
}

bool same(const KvPool& p, const std::vector<uint8_t>& want) {
    return std::memcmp(p.data(), want.data(), want.size()) == 0;
}

std::vector<std::vector<int32_t>> block_lists() {
    std::mt19937 rng(7);
    std::vector<int32_t> all(kBlocks);
    std::iota(all.begin(), all.end(), 0);
    std::vector<int32_t> shuffled = all;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    std::vector<int32_t> reversed(all.rbegin(), all.rend());
    return {{},
            {5},
            {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
            {std::vector<int32_t>(shuffled.begin(), shuffled.begin() + 17)},
            reversed,
            {3, 4, 9, 10, 11, 30, 2, 39}};
}

struct Pools {
    std::unique_ptr<KvPool> arena, mirror;
    explicit Pools(KvDtype dt = KvDtype::F16) {
        arena = std::move(KvPool::create(layout(dt), kBlocks)).value();
        mirror = std::move(KvPool::create(layout(dt), kBlocks)).value();
        fill(*arena, 1);
        fill(*mirror, 2);
    }
};

}  // namespace

TEST(BounceStage, PullBringsEveryLayerOfEachBlockAndNothingElse) {
    for (KvDtype dt : {KvDtype::F16, KvDtype::Int8})
        for (int32_t chunk : {1, 2, 3, 5, 64})
            for (const auto& blocks : block_lists()) {
                Pools p(dt);
                const auto want = expected(*p.arena, *p.mirror, blocks);
                auto st = DeferredBounceStage::make(*p.arena, *p.mirror, chunk);
                ASSERT_TRUE(st->pull(blocks).ok());
                EXPECT_TRUE(same(*p.mirror, want)) << "chunk " << chunk << ", " << blocks.size() << " blocks";
                EXPECT_TRUE(st->violations.empty()) << st->violations.front();
                EXPECT_EQ(st->pending(), 0);
                EXPECT_EQ(st->starts, static_cast<int>((blocks.size() + chunk - 1) / chunk));
            }
}

TEST(BounceStage, PushWritesEveryLayerOfEachBlockAndNothingElse) {
    for (KvDtype dt : {KvDtype::F16, KvDtype::Int8})
        for (int32_t chunk : {1, 2, 3, 5, 64})
            for (const auto& blocks : block_lists()) {
                Pools p(dt);
                const auto want = expected(*p.mirror, *p.arena, blocks);
                auto st = DeferredBounceStage::make(*p.arena, *p.mirror, chunk);
                ASSERT_TRUE(st->push(blocks).ok());
                EXPECT_TRUE(same(*p.arena, want)) << "chunk " << chunk << ", " << blocks.size() << " blocks";
                EXPECT_TRUE(st->violations.empty()) << st->violations.front();
                EXPECT_EQ(st->pending(), 0);
            }
}

// The device copy of the next chunk is started before the previous one is waited on
// (and copied on the host): the two halves overlap.
TEST(BounceStage, TheNextChunksCopyStartsBeforeThePreviousIsWaitedOn) {
    Pools p;
    const std::vector<int32_t> blocks = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    auto a = DeferredBounceStage::make(*p.arena, *p.mirror, 3);
    ASSERT_TRUE(a->pull(blocks).ok());
    EXPECT_EQ(a->log, "s0 s1 w0 s0 w1 w0 ");
    auto b = DeferredBounceStage::make(*p.arena, *p.mirror, 3);
    ASSERT_TRUE(b->push(blocks).ok());
    EXPECT_EQ(b->log, "s0 s1 w0 s0 w0 w1 ");  // the last two are waited on together
}

// B3: whichever start or wait fails, the error comes back and no copy is left
// running; B2 holds on the way out.
TEST(BounceStage, AFailedCopyIsTheErrorAndLeavesNothingRunning) {
    const std::vector<int32_t> blocks = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 4 chunks of 3
    for (bool push : {false, true})
        for (bool fail_wait : {false, true})
            for (int at = 0; at < 4; ++at) {
                Pools p;
                auto st = DeferredBounceStage::make(*p.arena, *p.mirror, 3);
                (fail_wait ? st->fail_wait_at : st->fail_start_at) = at;
                const Status s = push ? st->push(blocks) : st->pull(blocks);
                EXPECT_FALSE(s.ok()) << (push ? "push" : "pull") << (fail_wait ? ", wait " : ", start ") << at;
                EXPECT_NE(s.error().message.find("injected"), std::string::npos) << s.error().message;
                EXPECT_EQ(st->pending(), 0) << st->log;
                EXPECT_TRUE(st->violations.empty()) << st->log;
            }
}

TEST(BounceStage, ChunksAreAboutTheHalfsBytesAndAtLeastOneBlock) {
    const KvLayout l = layout();
    const size_t b = l.block_bytes();  // 3 layers x 2 x 2 heads x 4 tokens x 4 dims x 2 bytes = 384
    EXPECT_EQ(b, 384u);
    EXPECT_EQ(bounce_chunk_blocks(l, 384 * 10), 10);
    EXPECT_EQ(bounce_chunk_blocks(l, 384 * 10 + 383), 10);
    EXPECT_EQ(bounce_chunk_blocks(l, 100), 1);
    EXPECT_EQ(bounce_chunk_blocks(l), (16 << 20) / 384);
}

// A preempted request's swap through a stage (staged_blob_write /
// staged_blob_import: what a GPU worker's goes through, device -> pinned host ->
// disk and back). The arena is unreadable (PROT_NONE) except inside the stage's
// copies: a helper that read or wrote it directly would fault, one that skipped a
// pull would write the mirror's zeros to the blob, one that skipped a push would
// leave the read blocks holding what they held before. Expected rows come from
// the pools' accessors (k/v of a block, layer and head), not from the blob code.
namespace {

struct FencedArena {
    KvLayout l = layout();
    size_t bytes = 0;
    void* mem = nullptr;
    std::unique_ptr<KvPool> arena;
    std::unique_ptr<KvMirror> mirror;
    FencedArena() {
        bytes = l.block_bytes() * kBlocks;
        mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        EXPECT_NE(mem, MAP_FAILED);
        arena = std::make_unique<KvPool>(l, mem, std::make_unique<LocalBlockAllocator>(kBlocks));
        fill(*arena, 11);
        lock();
        mirror = std::move(KvMirror::create(l, arena->allocator())).value();
    }
    ~FencedArena() {
        mirror.reset();
        arena.reset();
        ::munmap(mem, bytes);
    }
    void lock() { ASSERT_EQ(::mprotect(mem, bytes, PROT_NONE), 0); }
    void unlock() { ASSERT_EQ(::mprotect(mem, bytes, PROT_READ | PROT_WRITE), 0); }
};

struct GuardedStage final : KvStage {
    FencedArena& f;
    std::unique_ptr<DeferredBounceStage> inner;
    int pulls = 0, pushes = 0;
    explicit GuardedStage(FencedArena& fa) : f(fa), inner(DeferredBounceStage::make(*fa.arena, fa.mirror->pool(), 2)) {}
    Status pull(std::span<const int32_t> blocks) override {
        ++pulls;
        f.unlock();
        Status st = inner->pull(blocks);
        f.lock();
        return st;
    }
    Status push(std::span<const int32_t> blocks) override {
        ++pushes;
        f.unlock();
        Status st = inner->push(blocks);
        f.lock();
        return st;
    }
};

// The K and V rows of positions [0, n) of a sequence over `blocks`, every layer and head.
std::vector<uint8_t> rows_of(KvPool& p, std::span<const int32_t> blocks, int64_t n) {
    const KvLayout& l = p.layout();
    const size_t row = static_cast<size_t>(l.head_dim) * l.elem_bytes();
    std::vector<uint8_t> out;
    for (int32_t layer = 0; layer < l.n_layer; ++layer)
        for (int64_t t = 0; t < n; ++t)
            for (int32_t h = 0; h < l.n_head_kv; ++h) {
                const int32_t b = blocks[static_cast<size_t>(t / l.block_tokens)];
                const size_t at = static_cast<size_t>(t % l.block_tokens) * row;
                out.insert(out.end(), p.k(b, layer, h) + at, p.k(b, layer, h) + at + row);
                out.insert(out.end(), p.v(b, layer, h) + at, p.v(b, layer, h) + at + row);
            }
    return out;
}

std::string swap_file(const char* name) {
    return (std::filesystem::temp_directory_path() / fmt::format("duet-staged-{}-{}.kvblob", name, getpid())).string();
}

const KvIdentity kId{{1, 2}, {3, 4}, 50000};  // any fixed identity: written and checked alike

}  // namespace

TEST(StagedSwap, KvGoesThroughTheMirrorBothWaysAndTheMirrorIsReleased) {
    FencedArena f;
    GuardedStage stage(f);
    const StagedKvIo io{&f.mirror->pool(), &stage, f.mirror.get()};
    const int64_t n = 7 * f.l.block_tokens - 2;  // a partial last block
    std::vector<int32_t> blocks(7);
    ASSERT_TRUE(f.arena->allocator().alloc(7, blocks.data()));
    std::swap(blocks[1], blocks[5]);  // not one run of ids
    KvSeq seq = KvSeq::adopt(blocks, n);
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    std::iota(tokens.begin(), tokens.end(), 100);
    const std::string path = swap_file("round");
    auto h = staged_blob_write(io, path, kId, seq, tokens, 0, static_cast<uint64_t>(n), false);
    ASSERT_TRUE(h.ok()) << h.error().message;
    EXPECT_EQ(stage.pulls, 1);
    // Released: the mirror's staged pages read back as zeros.
    const uint8_t* m = f.mirror->pool().k(blocks[0], 0, 0);
    EXPECT_TRUE(std::all_of(m, m + f.l.tile_bytes(), [](uint8_t b) { return b == 0; }));
    KvSeq back;
    auto im = staged_blob_import(io, path, kId, back);
    ASSERT_TRUE(im.ok()) << im.error().message;
    EXPECT_EQ(stage.pushes, 1);
    EXPECT_EQ(im->tokens, tokens);
    ASSERT_EQ(back.n_tokens(), n);
    const uint8_t* mb = f.mirror->pool().k(back.blocks()[0], 0, 0);  // a tile the read wrote in the mirror
    EXPECT_TRUE(std::all_of(mb, mb + f.l.tile_bytes(), [](uint8_t b) { return b == 0; })) << "released after the read";
    f.unlock();
    EXPECT_EQ(rows_of(*f.arena, back.blocks(), n), rows_of(*f.arena, seq.blocks(), n))
        << "the blocks read hold the swapped rows, in the arena";
    f.lock();
    for (int32_t b : back.blocks()) EXPECT_EQ(std::count(blocks.begin(), blocks.end(), b), 0) << "new blocks";
    back.release(*f.arena);
    seq.release(*f.arena);
    EXPECT_EQ(f.arena->allocator().n_free(), kBlocks);
    std::filesystem::remove(path);
}

TEST(StagedSwap, AFailedCopyIsTheErrorAndHoldsNothing) {
    FencedArena f;
    GuardedStage stage(f);
    const StagedKvIo io{&f.mirror->pool(), &stage, f.mirror.get()};
    const int64_t n = 5 * f.l.block_tokens;
    std::vector<int32_t> blocks(5);
    ASSERT_TRUE(f.arena->allocator().alloc(5, blocks.data()));
    KvSeq seq = KvSeq::adopt(blocks, n);
    std::vector<int32_t> tokens(static_cast<size_t>(n), 7);
    // A failed pull: no file.
    const std::string path = swap_file("fail");
    std::filesystem::remove(path);
    stage.inner->fail_start_at = stage.inner->starts;
    auto h = staged_blob_write(io, path, kId, seq, tokens, 0, static_cast<uint64_t>(n), false);
    ASSERT_FALSE(h.ok());
    EXPECT_NE(h.error().message.find("KV from the arena"), std::string::npos) << h.error().message;
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_EQ(stage.inner->pending(), 0);
    // Written; then a failed push: the blocks read are freed, the sequence empty.
    stage.inner->fail_start_at = -1;
    ASSERT_TRUE(staged_blob_write(io, path, kId, seq, tokens, 0, static_cast<uint64_t>(n), false).ok());
    const int32_t free_before = f.arena->allocator().n_free();
    stage.inner->fail_wait_at = stage.inner->waits;
    KvSeq back;
    auto im = staged_blob_import(io, path, kId, back);
    ASSERT_FALSE(im.ok());
    EXPECT_NE(im.error().message.find("KV into the arena"), std::string::npos) << im.error().message;
    EXPECT_EQ(back.n_tokens(), 0);
    EXPECT_TRUE(back.blocks().empty());
    EXPECT_EQ(f.arena->allocator().n_free(), free_before);
    EXPECT_EQ(stage.inner->pending(), 0);
    // Staged, a read starts from an empty sequence (a partial block would be copied
    // from a mirror tile nobody pulled).
    stage.inner->fail_wait_at = -1;
    KvSeq part = seq.fork(*f.arena);
    auto refused = staged_blob_import(io, path, kId, part);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.error().kind, ErrorKind::Invalid);
    part.release(*f.arena);
    seq.release(*f.arena);
    EXPECT_EQ(f.arena->allocator().n_free(), kBlocks);
    std::filesystem::remove(path);
}

// CPU KV (no stage): the arena's own pool, read and written directly.
TEST(StagedSwap, WithoutAStageTheArenaIsUsedDirectly) {
    Pools p;
    const StagedKvIo io{p.arena.get()};
    const int64_t n = 9;
    std::vector<int32_t> blocks(3);
    ASSERT_TRUE(p.arena->allocator().alloc(3, blocks.data()));
    KvSeq seq = KvSeq::adopt(blocks, n);
    std::vector<int32_t> tokens(static_cast<size_t>(n), 3);
    const std::string path = swap_file("direct");
    ASSERT_TRUE(staged_blob_write(io, path, kId, seq, tokens, 0, static_cast<uint64_t>(n), false).ok());
    KvSeq back;
    auto im = staged_blob_import(io, path, kId, back);
    ASSERT_TRUE(im.ok()) << im.error().message;
    EXPECT_EQ(rows_of(*p.arena, back.blocks(), n), rows_of(*p.arena, seq.blocks(), n));
    back.release(*p.arena);
    seq.release(*p.arena);
    std::filesystem::remove(path);
}
