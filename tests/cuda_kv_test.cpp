// KV blobs of a GPU arena (src/cuda/cuda_kv_io.h) on the default model (ctest label
// `gpu`; skipped, not passed, without a GPU): a sequence prefilled on the GPU,
// written through page-locked memory and imported back (whole, and continuing a
// sequence mid-block), decodes with bitwise the original's logits; a corrupt blob
// leaves the device sequence and the arena's free blocks as they were; the blob
// is the same format as a CPU arena's (blob_verify_file, and a CPU import). A
// context store over a GPU arena's host mirror (kv_stage.h, CudaKvStage) keeps every
// context's next logits equal, bitwise, to a fresh computation on the GPU, through
// appends, edits, forks, evictions (restored from the log), export/import and a
// restart of the store.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "cuda/cuda_kv_io.h"
#include "engine/contexts.h"
#include "kv/log_device.h"
#include "kernels/cuda/device.h"
#include "engine/engine.h"
#include "model/fingerprint.h"
#include "cuda_test_util.h"

using namespace duet;

namespace {

using duet::testing::have_gpu;
using duet::testing::in_child;

std::unique_ptr<Engine> make_engine(const std::string& device, const std::string& kv_dtype = "f16") {
    EngineOptions o;
    o.model_path = DUET_MODEL_PATH;
    o.threads = 2;
    o.n_ctx = 2048;
    o.device = device;
    o.kv_dtype = kv_dtype;
    auto r = Engine::create(o);
    if (!r) {
        ADD_FAILURE() << device << ": " << r.error().message;
        return nullptr;
    }
    return std::move(r).value();
}

std::vector<int32_t> prompt_ids(int n) {
    std::vector<int32_t> v(n);
    for (int i = 0; i < n; ++i) v[i] = (i * 7919 + 104729 + 17) % 49152;
    return v;
}

}  // namespace

TEST(CudaKv, DeviceBlobRoundTripDecodesBitwiseLikeTheOriginal) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    in_child([] {
        for (const char* dt : {"f16", "int8"}) {
            auto e = make_engine("cuda:0", dt);
            ASSERT_TRUE(e);
            const Model& m = e->model();
            KvIdentity id{model_fingerprint(m.file()), tokenizer_fingerprint(m.file()), m.config().n_vocab};
            const std::vector<int32_t> toks = prompt_ids(75);
            KvSeq orig;
            std::vector<float> l0, l1;
            SeqBatch b{&orig, toks.data(), 75, false};
            ASSERT_TRUE(e->backend().forward({&b, 1}, l0).ok());
            char tmpl[] = "/tmp/duet-cudakv-XXXXXX";
            const std::string dir = ::mkdtemp(tmpl);
            const std::string whole = dir + "/whole.kvblob", tail = dir + "/tail.kvblob";
            auto h = blob_write_device(whole, id, e->pool(), orig, toks, 0, 75);
            ASSERT_TRUE(h.ok()) << h.error().message;
            ASSERT_TRUE(blob_verify_file(whole).ok());
            ASSERT_TRUE(blob_write_device(tail, id, e->pool(), orig, toks, 37, 38).ok());

            // Whole, and a prefix of 37 positions (mid-block) continued by the tail blob.
            KvSeq a, c;
            auto ia = blob_import_device(whole, id, e->pool(), a);
            ASSERT_TRUE(ia.ok()) << ia.error().message;
            EXPECT_EQ(ia->tokens, toks);
            SeqBatch pre{&c, toks.data(), 37, false};
            ASSERT_TRUE(e->backend().forward({&pre, 1}, l1).ok());
            // A corrupt tail first: refused, c untouched.
            {
                std::ifstream in(tail, std::ios::binary);
                std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
                bytes[bytes.size() - 3] ^= 4;
                const std::string bad = dir + "/bad.kvblob";
                std::ofstream(bad, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
                const int32_t free_before = e->pool().allocator().n_free();
                const std::vector<int32_t> blocks_before = c.blocks();
                auto r = blob_import_device(bad, id, e->pool(), c);
                ASSERT_FALSE(r.ok());
                EXPECT_NE(r.error().message.find("data_crc"), std::string::npos) << r.error().message;
                EXPECT_EQ(e->pool().allocator().n_free(), free_before);
                EXPECT_EQ(c.blocks(), blocks_before);
                EXPECT_EQ(c.n_tokens(), 37);
            }
            auto ic = blob_import_device(tail, id, e->pool(), c);
            ASSERT_TRUE(ic.ok()) << ic.error().message;
            ASSERT_EQ(c.n_tokens(), 75);

            const int64_t nv = m.config().n_vocab;
            int32_t next = static_cast<int32_t>(std::max_element(l0.begin(), l0.begin() + nv) - l0.begin());
            for (int step = 0; step < 3; ++step) {
                int32_t t0 = next, t1 = next, t2 = next;
                std::vector<float> x0, x1, x2;
                SeqBatch s0{&orig, &t0, 1, false}, s1{&a, &t1, 1, false}, s2{&c, &t2, 1, false};
                ASSERT_TRUE(e->backend().forward({&s0, 1}, x0).ok());
                ASSERT_TRUE(e->backend().forward({&s1, 1}, x1).ok());
                ASSERT_TRUE(e->backend().forward({&s2, 1}, x2).ok());
                ASSERT_EQ(0, std::memcmp(x0.data(), x1.data(), nv * sizeof(float))) << dt << " whole, step " << step;
                ASSERT_EQ(0, std::memcmp(x0.data(), x2.data(), nv * sizeof(float))) << dt << " continued, step " << step;
                next = static_cast<int32_t>(std::max_element(x0.begin(), x0.begin() + nv) - x0.begin());
            }
            // The same format as a CPU arena's: a CPU engine imports it.
            auto cpu = make_engine("cpu", dt);
            ASSERT_TRUE(cpu);
            KvSeq on_cpu;
            auto icpu = blob_import(whole, id, cpu->pool(), on_cpu);
            EXPECT_TRUE(icpu.ok()) << icpu.error().message;
            on_cpu.release(cpu->pool());
            for (KvSeq* s : {&orig, &a, &c}) s->release(e->pool());
            std::system(("rm -rf " + dir).c_str());
        }
    });
}

TEST(CudaKv, ContextsThroughTheHostMirrorKeepTheLogitsOfAFreshComputation) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    in_child([] {
        auto e = make_engine("cuda:0");
        ASSERT_TRUE(e);
        const Model& m = e->model();
        KvPool& arena = e->pool();
        auto mirror = KvMirror::create(arena.layout(), arena.allocator());
        ASSERT_TRUE(mirror.ok()) << mirror.error().message;
        // Halves of 3 blocks: every operation of more than 6 blocks cycles both.
        auto staged = CudaKvStage::create(0, arena.data(), (*mirror)->pool(), arena.layout().block_bytes() * 3);
        ASSERT_TRUE(staged.ok()) << staged.error().message;
        ASSERT_EQ((*staged)->chunk_blocks(), 3);
        CudaKvStage& stage = **staged;
        KvCacheManager kv(arena);
        BackendCompute compute(e->backend(), kv, 24);  // several passes per context
        auto dev = UringLogDevice::create();
        ASSERT_TRUE(dev.ok()) << dev.error().message;
        KvLogSync sync(**dev);
        char tmpl[] = "/tmp/duet-cudactx-XXXXXX";
        const std::string dir = ::mkdtemp(tmpl);
        ContextStoreOptions o;
        o.dir = dir;
        o.id = {model_fingerprint(m.file()), tokenizer_fingerprint(m.file()), m.config().n_vocab};
        o.stage = &stage;
        o.mirror = mirror->get();
        std::unique_ptr<ContextStore> store;
        auto open = [&] {
            store.reset();
            auto s = ContextStore::open((*mirror)->pool(), sync, compute, o);
            ASSERT_TRUE(s.ok()) << s.error().message;
            store = std::move(s).value();
        };
        open();
        // The reference: the context's tokens computed fresh in one pass on the GPU.
        auto expect_exact = [&](const std::string& id, const char* after) {
            auto t = store->tokens(id);
            ASSERT_TRUE(t.ok()) << t.error().message;
            auto got = store->next_logits(id);
            ASSERT_TRUE(got.ok()) << after << ": " << got.error().message;
            KvSeq fresh;
            std::vector<float> want;
            SeqBatch b{&fresh, t->data(), static_cast<int32_t>(t->size()), false};
            ASSERT_TRUE(e->backend().forward({&b, 1}, want).ok());
            fresh.release(arena);
            ASSERT_EQ(got->size(), want.size());
            EXPECT_EQ(0, std::memcmp(got->data(), want.data(), want.size() * sizeof(float)))
                << id << " after " << after << ": logits differ from a fresh computation";
        };
        const std::vector<int32_t> t = prompt_ids(53), more = prompt_ids(70);
        ASSERT_TRUE(store->create("a", t, true).ok());
        ASSERT_TRUE(store->append("a", std::span(more).subspan(53, 17)).ok());
        expect_exact("a", "create and append");
        ASSERT_TRUE(store->fork("a", "b", 37).ok());
        ASSERT_TRUE(store->edit("b", 30, std::span(more).first(9)).ok());
        expect_exact("b", "fork and edit");
        ASSERT_TRUE(store->evict("a").ok());
        expect_exact("a", "an eviction: restored from its log through the mirror");
        auto x = store->export_blob("b", dir + "/b.kvblob");
        ASSERT_TRUE(x.ok()) << x.error().message;
        ASSERT_TRUE(store->import_blob("c", dir + "/b.kvblob", false).ok());
        expect_exact("c", "export and import");
        ASSERT_TRUE(store->evict("c").ok());  // not durable: spilled through the mirror
        expect_exact("c", "a spill and its restore");
        open();  // a restart of the store: the durable contexts come back from their logs
        ContextUsage u;
        ASSERT_TRUE(store->next_logits("b", &u).ok());
        EXPECT_GT(u.restored, 0) << "restored, not computed";
        expect_exact("a", "a restart");
        expect_exact("b", "a restart");
        store.reset();
        std::system(("rm -rf " + dir).c_str());
    });
}
