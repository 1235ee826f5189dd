// Micro-benchmarks of kernels/cpu, single thread.
//
//   bench_kernels [--benchmark_filter=...]      (DUET_ISA=avx2 etc. caps the level)
//
// Figures that matter are ratios measured in the same run:
// - MemRead/96MiB: a plain read of a 96 MiB buffer, the decode floor;
//   MemRead/96MiB/wide: the same with 256-bit loads (more lines in flight).
// - Decode/<type>/<n_in>x<rows>: matmul with n_tok = 1 on weights that are not
//   in cache (each iteration uses the next of enough copies to exceed 256 MiB);
//   bytes_per_second counts weight bytes. Compare with MemRead.
// - DecodeStep/SmolLM2-135M: every matmul of one decode step of the default
//   model (30 layers of Q4_1 q,k,v,o,gate,up,down and the Q8_0 tied head;
//   ~96 MB of distinct weights), n_tok = 1.
// - L3Decode/<isa>/threads:<n>: the n_tok = 1 matmuls of one decode step of
//   SmolLM2-135M on buffers the size of its weights (30 layers of Q4_1 q, k, v,
//   o, gate, up, down, 66 MB, laid out in GGUF file order and run in execution
//   order, then the 49152 x 576 Q8_0 output head, 30 MB), and in the same
//   iteration read_fold over the same bytes, n threads splitting each matrix's
//   rows as duet does. The weights fit in L3 on the build machine, as they do
//   during decode. Counters per type: <type>_GBps and <type>_ratio (the kernel's
//   rate over read_fold's on the same bytes, the figure that matters), and both
//   together: read_GBps, ratio. The time is the kernels'.
// - Prefill/<type>/<n_in>x<rows>/<n_tok>: matmul on hot weights; "ops" counts
//   2 * rows * n_in * n_tok per iteration (GOPS). n_tok = 1 here is the decode
//   kernel's speed when weights come from cache (its compute ceiling); 2 to 16,
//   the many-row passes of batched decode and verify rows (time against n_tok = 1).
// - Int8Peak/<isa>: one core's int8 dot-product peak in the kernels' instruction mix
//   (GOPS, counted as Prefill's are): the ceiling for Prefill's quantized figures.
// Times are CPU time of the one thread (robust to sharing the machine), except
// L3Decode's: wall time of the kernel part.
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace {

using duet::DType;
using duet::cpu::Isa;

struct AlignedBuf {
    explicit AlignedBuf(size_t n) : size(n), p(static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) & ~size_t{63}))) {
        std::memset(p, 0, size);  // touch every page now, not in the timed loop
    }
    ~AlignedBuf() { std::free(p); }
    AlignedBuf(const AlignedBuf&) = delete;
    AlignedBuf& operator=(const AlignedBuf&) = delete;
    size_t size;
    uint8_t* p;
};

std::vector<float> random_floats(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng);
    return v;
}

// One weight matrix quantized from random floats.
std::unique_ptr<AlignedBuf> make_matrix(DType t, int64_t rows, int64_t n_in) {
    const size_t rb = duet::dtype_row_bytes(t, n_in);
    auto m = std::make_unique<AlignedBuf>(rb * static_cast<size_t>(rows));
    const std::vector<float> f = random_floats(static_cast<size_t>(n_in) * 4, 1);
    for (int64_t r = 0; r < rows; ++r) {
        const float* src = f.data() + static_cast<size_t>(r % 4) * static_cast<size_t>(n_in);
        if (t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K || t == DType::Q5_0 || t == DType::Q5_1) {
            std::mt19937 rng(static_cast<uint32_t>(r));
            for (size_t i = 0; i < rb; ++i) m->p[static_cast<size_t>(r) * rb + i] = static_cast<uint8_t>(rng() & 0x3F);
        } else {
            duet::cpu::quantize_row(Isa::Scalar, t, src, m->p + static_cast<size_t>(r) * rb, n_in);
        }
    }
    return m;
}

std::unique_ptr<AlignedBuf> make_acts(Isa isa, DType wt, int n_tok, int64_t n_in) {
    const DType xt = duet::cpu::vec_dot_type(wt);
    const size_t xs = duet::dtype_row_bytes(xt, n_in);
    auto x = std::make_unique<AlignedBuf>(xs * static_cast<size_t>(n_tok));
    for (int t = 0; t < n_tok; ++t) {
        const std::vector<float> f = random_floats(static_cast<size_t>(n_in), 100 + static_cast<uint32_t>(t));
        duet::cpu::quantize_row(isa, xt, f.data(), x->p + static_cast<size_t>(t) * xs, n_in);
    }
    return x;
}

void BM_MemRead(benchmark::State& st) {
    const size_t n = size_t{96} << 20;
    AlignedBuf buf(n);
    for (size_t i = 0; i < n; i += 4096) buf.p[i] = static_cast<uint8_t>(i >> 12);
    const uint64_t* p = reinterpret_cast<const uint64_t*>(buf.p);
    for (auto _ : st) {
        uint64_t a = 0, b = 0, c = 0, d = 0;
        for (size_t i = 0; i < n / 8; i += 4) {
            a ^= p[i];
            b ^= p[i + 1];
            c ^= p[i + 2];
            d ^= p[i + 3];
        }
        benchmark::DoNotOptimize(a ^ b ^ c ^ d);
    }
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * static_cast<int64_t>(n));
}

// The same buffer read with 256-bit loads: fewer instructions per cache line,
// so more lines in flight. On the build machine this reads 30-40% faster than the
// plain loop; it is the stricter floor for kernels that use wide loads.
__attribute__((target("avx2"))) uint64_t read_wide(const uint8_t* p, size_t n) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (size_t i = 0; i < n; i += 128) {
        a = _mm256_xor_si256(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
        b = _mm256_xor_si256(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
        c = _mm256_xor_si256(c, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
        d = _mm256_xor_si256(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
    }
    const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
    return static_cast<uint64_t>(_mm256_extract_epi64(x, 0) ^ _mm256_extract_epi64(x, 3));
}

void BM_MemReadWide(benchmark::State& st) {
    const size_t n = size_t{96} << 20;
    AlignedBuf buf(n);
    for (size_t i = 0; i < n; i += 4096) buf.p[i] = static_cast<uint8_t>(i >> 12);
    for (auto _ : st) benchmark::DoNotOptimize(read_wide(buf.p, n));
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * static_cast<int64_t>(n));
}

// The int8 dot-product peak of one core at a level, in the instruction mix the
// quantized kernels use for 32 products (AVX2: vpmaddubsw, vpmaddwd by ones, vpaddd;
// AVX-512 VNNI: one vpdpbusd per 64): 8 independent accumulators on operands in
// registers (the empty asm makes the weights look new each iteration, so nothing is
// hoisted). "ops" counts 2 per product, as Prefill's do: a kernel's GOPS over this is
// the fraction of the machine's int8 peak it reaches.
__attribute__((target("avx2"))) int32_t int8_peak_avx2(int64_t iters) {
    __m256i w = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i x[8], acc[8];
    for (int i = 0; i < 8; ++i) {
        x[i] = _mm256_set1_epi8(static_cast<char>(i + 1));
        acc[i] = _mm256_setzero_si256();
    }
    for (int64_t it = 0; it < iters; ++it) {
        asm volatile("" : "+x"(w));
        for (int i = 0; i < 8; ++i)
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x[i]), ones));
    }
    __m256i s = acc[0];
    for (int i = 1; i < 8; ++i) s = _mm256_add_epi32(s, acc[i]);
    return _mm256_extract_epi32(s, 0);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) int32_t int8_peak_vnni(int64_t iters) {
    __m512i w = _mm512_set1_epi8(3);
    __m512i x[8], acc[8];
    for (int i = 0; i < 8; ++i) {
        x[i] = _mm512_set1_epi8(static_cast<char>(i + 1));
        acc[i] = _mm512_setzero_si512();
    }
    for (int64_t it = 0; it < iters; ++it) {
        asm volatile("" : "+v"(w));
        for (int i = 0; i < 8; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x[i]);
    }
    __m512i s = acc[0];
    for (int i = 1; i < 8; ++i) s = _mm512_add_epi32(s, acc[i]);
    return _mm512_reduce_add_epi32(s);
}

// AMX: four independent 16 x 16 int32 accumulators, each TDPBSSD 16 x 64 by 64 x 16
// bytes (16384 products), operands in tiles. Isa::Amx's kernels use K = 32 (one
// block) per TDPBSSD, so they can reach at most half of this.
struct alignas(64) AmxPeakConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

__attribute__((target("amx-tile,amx-int8"))) int32_t int8_peak_amx(int64_t iters) {
    static const AmxPeakConfig cfg;
    alignas(64) static int8_t ops[16 * 64];
    alignas(64) int32_t out[16 * 16];
    for (int i = 0; i < 16 * 64; ++i) ops[i] = static_cast<int8_t>(i % 7 - 3);
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ops, 64);
    _tile_loadd(5, ops, 64);
    _tile_loadd(6, ops, 64);
    _tile_loadd(7, ops, 64);
    for (int64_t it = 0; it < iters; ++it) {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}

void BM_Int8Peak(benchmark::State& st, Isa isa) {
    constexpr int64_t kIters = 1 << 16;
    for (auto _ : st) {
        benchmark::DoNotOptimize(isa == Isa::Amx      ? int8_peak_amx(kIters / 64)
                                 : isa == Isa::Avx512 ? int8_peak_vnni(kIters)
                                                      : int8_peak_avx2(kIters));
    }
    // products per loop iteration
    const int64_t per_iter = isa == Isa::Amx ? 4 * 16384 / 64 : isa == Isa::Avx512 ? 8 * 64 : 8 * 32;
    st.counters["ops"] =
        benchmark::Counter(2.0 * static_cast<double>(per_iter * kIters) * static_cast<double>(st.iterations()),
                           benchmark::Counter::kIsRate);
}

// n_tok = 1 on cold weights: rotate through copies totalling >= 256 MiB.
void BM_Decode(benchmark::State& st, Isa isa, DType t, int64_t n_in, int64_t rows) {
    const size_t rb = duet::dtype_row_bytes(t, n_in);
    const size_t mat = rb * static_cast<size_t>(rows);
    const size_t copies = std::max<size_t>(2, ((size_t{256} << 20) + mat - 1) / mat);
    auto one = make_matrix(t, rows, n_in);
    AlignedBuf pool(mat * copies);
    for (size_t c = 0; c < copies; ++c) std::memcpy(pool.p + c * mat, one->p, mat);
    auto x = make_acts(isa, t, 1, n_in);
    const size_t xs = duet::dtype_row_bytes(duet::cpu::vec_dot_type(t), n_in);
    std::vector<float> y(static_cast<size_t>(rows));
    size_t c = 0;
    for (auto _ : st) {
        duet::cpu::matmul(isa, t, pool.p + c * mat, rb, n_in, x->p, xs, 1, y.data(), static_cast<size_t>(rows), 0, rows);
        benchmark::ClobberMemory();
        c = c + 1 == copies ? 0 : c + 1;
    }
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * static_cast<int64_t>(mat));
}

// Hot weights, n_tok tokens.
void BM_Prefill(benchmark::State& st, Isa isa, DType t, int64_t n_in, int64_t rows, int n_tok) {
    const size_t rb = duet::dtype_row_bytes(t, n_in);
    auto w = make_matrix(t, rows, n_in);
    auto x = make_acts(isa, t, n_tok, n_in);
    const size_t xs = duet::dtype_row_bytes(duet::cpu::vec_dot_type(t), n_in);
    std::vector<float> y(static_cast<size_t>(rows) * static_cast<size_t>(n_tok));
    for (auto _ : st) {
        duet::cpu::matmul(isa, t, w->p, rb, n_in, x->p, xs, n_tok, y.data(), static_cast<size_t>(rows), 0, rows);
        benchmark::ClobberMemory();
    }
    const double ops = 2.0 * static_cast<double>(rows) * static_cast<double>(n_in) * n_tok;
    st.counters["ops"] = benchmark::Counter(ops * static_cast<double>(st.iterations()), benchmark::Counter::kIsRate);
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * static_cast<int64_t>(rb) * rows);
}

// One decode step of SmolLM2-135M: 30 layers x 7 Q4_1 matrices + Q8_0 head.
void BM_DecodeStep(benchmark::State& st, Isa isa) {
    struct Mat {
        DType t;
        int64_t n_in, rows;
    };
    const Mat layer[] = {{DType::Q4_1, 576, 576},  {DType::Q4_1, 576, 192},  {DType::Q4_1, 576, 192},
                         {DType::Q4_1, 576, 576},  {DType::Q4_1, 576, 1536}, {DType::Q4_1, 576, 1536},
                         {DType::Q4_1, 1536, 576}};
    const Mat head = {DType::Q8_0, 576, 49152};
    std::vector<Mat> mats;
    for (int l = 0; l < 30; ++l) mats.insert(mats.end(), std::begin(layer), std::end(layer));
    mats.push_back(head);
    size_t total = 0;
    std::vector<size_t> off;
    for (const Mat& m : mats) {
        off.push_back(total);
        total += duet::dtype_row_bytes(m.t, m.n_in) * static_cast<size_t>(m.rows);
    }
    AlignedBuf pool(total);
    for (size_t i = 0; i < std::size(layer); ++i) {
        auto one = make_matrix(layer[i].t, layer[i].rows, layer[i].n_in);
        for (int l = 0; l < 30; ++l) std::memcpy(pool.p + off[7 * l + i], one->p, one->size);
    }
    auto h = make_matrix(head.t, head.rows, head.n_in);
    std::memcpy(pool.p + off.back(), h->p, h->size);
    auto x576 = make_acts(isa, DType::Q4_1, 1, 576);
    auto x1536 = make_acts(isa, DType::Q4_1, 1, 1536);
    auto xh = make_acts(isa, DType::Q8_0, 1, 576);
    std::vector<float> y(49152);
    for (auto _ : st) {
        for (size_t i = 0; i < mats.size(); ++i) {
            const Mat& m = mats[i];
            const uint8_t* x = m.t == DType::Q8_0 ? xh->p : m.n_in == 1536 ? x1536->p : x576->p;
            const size_t xs = duet::dtype_row_bytes(duet::cpu::vec_dot_type(m.t), m.n_in);
            duet::cpu::matmul(isa, m.t, pool.p + off[i], duet::dtype_row_bytes(m.t, m.n_in), m.n_in, x, xs, 1,
                              y.data(), static_cast<size_t>(m.rows), 0, m.rows);
        }
        benchmark::ClobberMemory();
    }
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * static_cast<int64_t>(total));
    st.counters["MB"] = static_cast<double>(total) / 1e6;
}

// Runs job(tid) on n threads (this one and n - 1 workers that spin between
// jobs, like duet's pool during decode) and returns when all are done.
class SpinTeam {
   public:
    explicit SpinTeam(int n) : n_(n), passed_(static_cast<size_t>(n), 0) {
        for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { work(i); });
    }
    ~SpinTeam() {
        stop_.store(true, std::memory_order_relaxed);
        gen_.fetch_add(1, std::memory_order_release);  // pairs with the acquire load in work()
        for (std::thread& t : workers_) t.join();
    }
    SpinTeam(const SpinTeam&) = delete;
    SpinTeam& operator=(const SpinTeam&) = delete;
    int size() const { return n_; }
    template <class F>
    void run(F&& job) {
        job_ = [&job](int tid) { job(tid); };
        left_.store(n_ - 1, std::memory_order_relaxed);
        gen_.fetch_add(1, std::memory_order_release);  // publishes job_; pairs with work()'s acquire load
        job(0);
        while (left_.load(std::memory_order_acquire) != 0) {  // pairs with work()'s release decrement
        }
    }
    // All n threads meet here (thread tid's k-th call meets the others' k-th).
    void barrier(int tid) {
        const uint64_t target = ++passed_[static_cast<size_t>(tid)] * static_cast<uint64_t>(n_);
        bar_.fetch_add(1, std::memory_order_acq_rel);  // orders this thread's writes before the others pass
        while (bar_.load(std::memory_order_acquire) < target) {  // pairs with the other threads' fetch_add
        }
    }

   private:
    void work(int tid) {
        uint64_t seen = 0;
        for (;;) {
            uint64_t g;
            while ((g = gen_.load(std::memory_order_acquire)) == seen) {  // pairs with run()'s release increment
            }
            seen = g;
            if (stop_.load(std::memory_order_relaxed)) return;
            job_(tid);
            left_.fetch_sub(1, std::memory_order_release);  // pairs with run()'s acquire load
        }
    }
    int n_;
    std::vector<std::thread> workers_;
    std::function<void(int)> job_;
    std::atomic<uint64_t> gen_{0};
    std::atomic<int> left_{0};
    std::vector<uint64_t> passed_;  // barriers passed, per thread (each touches its own)
    std::atomic<uint64_t> bar_{0};
    std::atomic<bool> stop_{false};
};

// Rows [b, e) of n for thread tid of nth, in multiples of 16 (as duet splits).
void split_rows(int64_t n, int tid, int nth, int64_t* b, int64_t* e) {
    const int64_t per = (n / nth + 15) / 16 * 16;
    *b = std::min(n, per * tid);
    *e = tid == nth - 1 ? n : std::min(n, per * (tid + 1));
}

// One decode step's matmuls (see L3Decode above) against read_fold over the
// same bytes, in decode's order: the Q4_1 layers, then the Q8_0 head.
void BM_L3Decode(benchmark::State& st, Isa isa, int nth) {
    struct Mat {
        DType t;
        int64_t n_in, rows;
        size_t off;
    };
    // Execution order q, k, v, o, gate, up, down; file order down, gate, up, k, o, q, v.
    const Mat layer[] = {{DType::Q4_1, 576, 576, 0},  {DType::Q4_1, 576, 192, 0},  {DType::Q4_1, 576, 192, 0},
                         {DType::Q4_1, 576, 576, 0},  {DType::Q4_1, 576, 1536, 0}, {DType::Q4_1, 576, 1536, 0},
                         {DType::Q4_1, 1536, 576, 0}};
    const int file_order[] = {6, 4, 5, 1, 3, 0, 2};
    std::vector<Mat> mats;
    size_t total = 0;
    for (int l = 0; l < 30; ++l) {
        Mat m[7];
        std::copy(std::begin(layer), std::end(layer), m);
        for (int i : file_order) {
            m[i].off = total;
            total += duet::dtype_row_bytes(m[i].t, m[i].n_in) * static_cast<size_t>(m[i].rows);
        }
        mats.insert(mats.end(), m, m + 7);
    }
    const size_t q4_bytes = total;
    mats.push_back({DType::Q8_0, 576, 49152, total});
    total += duet::dtype_row_bytes(DType::Q8_0, 576) * 49152;
    AlignedBuf pool(total);
    for (size_t i = 0; i < mats.size(); ++i) {  // 8 distinct matrices, the layers' copied into every layer
        const Mat& m = mats[i];
        const size_t bytes = duet::dtype_row_bytes(m.t, m.n_in) * static_cast<size_t>(m.rows);
        if (i < 7 || m.t == DType::Q8_0) {
            auto one = make_matrix(m.t, m.rows, m.n_in);
            std::memcpy(pool.p + m.off, one->p, bytes);
        } else {
            std::memcpy(pool.p + m.off, pool.p + mats[i % 7].off, bytes);
        }
    }
    auto x576 = make_acts(isa, DType::Q4_1, 1, 576);
    auto x1536 = make_acts(isa, DType::Q4_1, 1, 1536);
    auto xh = make_acts(isa, DType::Q8_0, 1, 576);
    std::vector<float> y(49152);
    SpinTeam team(nth);
    std::vector<uint64_t> sink(static_cast<size_t>(nth) * 8);
    const size_t n4 = mats.size() - 1;  // mats [0, n4) are Q4_1, the last the head
    auto kernel = [&](size_t m0, size_t m1) {
        return [&, m0, m1](int tid) {
            for (size_t i = m0; i < m1; ++i) {
                const Mat& m = mats[i];
                int64_t b, e;
                split_rows(m.rows, tid, nth, &b, &e);
                const uint8_t* x = m.t == DType::Q8_0 ? xh->p : m.n_in == 1536 ? x1536->p : x576->p;
                duet::cpu::matmul(isa, m.t, pool.p + m.off, duet::dtype_row_bytes(m.t, m.n_in), m.n_in, x,
                                  duet::dtype_row_bytes(duet::cpu::vec_dot_type(m.t), m.n_in), 1, y.data(),
                                  static_cast<size_t>(m.rows), b, e);
                if (nth > 1) team.barrier(tid);
            }
        };
    };
    auto read = [&](size_t m0, size_t m1) {
        return [&, m0, m1](int tid) {
            uint64_t acc = 0;
            for (size_t i = m0; i < m1; ++i) {
                const Mat& m = mats[i];
                int64_t b, e;
                split_rows(m.rows, tid, nth, &b, &e);
                const size_t rb = duet::dtype_row_bytes(m.t, m.n_in);
                acc ^= duet::cpu::read_fold(isa, pool.p + m.off + static_cast<size_t>(b) * rb,
                                            static_cast<size_t>(e - b) * rb);
            }
            sink[static_cast<size_t>(tid) * 8] ^= acc;
        };
    };
    using Clock = std::chrono::steady_clock;
    auto timed = [&](auto job) {
        const auto t0 = Clock::now();
        team.run(job);
        return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    double k4 = 0, k8 = 0, r4 = 0, r8 = 0;
    for (auto _ : st) {
        const double a = timed(kernel(0, n4)), b = timed(kernel(n4, n4 + 1));
        r4 += timed(read(0, n4));
        r8 += timed(read(n4, n4 + 1));
        st.SetIterationTime(a + b);
        k4 += a;
        k8 += b;
    }
    benchmark::DoNotOptimize(sink.data());
    const double it = static_cast<double>(st.iterations());
    const double b4 = static_cast<double>(q4_bytes) * it, b8 = static_cast<double>(total - q4_bytes) * it;
    st.counters["Q4_1_GBps"] = b4 / k4 / 1e9;
    st.counters["Q4_1_ratio"] = r4 / k4;
    st.counters["Q8_0_GBps"] = b8 / k8 / 1e9;
    st.counters["Q8_0_ratio"] = r8 / k8;
    st.counters["read_GBps"] = (b4 + b8) / (r4 + r8) / 1e9;
    st.counters["ratio"] = (r4 + r8) / (k4 + k8);
}

void BM_Quantize(benchmark::State& st, Isa isa, DType t, int64_t n) {
    const std::vector<float> f = random_floats(static_cast<size_t>(n), 5);
    std::vector<uint8_t> q(duet::dtype_row_bytes(t, n));
    for (auto _ : st) {
        duet::cpu::quantize_row(isa, t, f.data(), q.data(), n);
        benchmark::ClobberMemory();
    }
    st.SetItemsProcessed(static_cast<int64_t>(st.iterations()) * n);
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<Isa> isas;
    for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx}) {
        if (duet::cpu::isa_supported(i) && static_cast<int>(i) <= static_cast<int>(duet::cpu::isa_best())) isas.push_back(i);
    }
    // CPU time, not wall time: the build machines are shared, and a descheduled
    // thread should not count. Single-threaded, so the two agree when idle.
    benchmark::RegisterBenchmark("MemRead/96MiB", BM_MemRead)->Unit(benchmark::kMillisecond);
    if (duet::cpu::isa_supported(Isa::Avx2)) {
        benchmark::RegisterBenchmark("MemRead/96MiB/wide", BM_MemReadWide)->Unit(benchmark::kMillisecond);
    }
    struct Shape {
        DType t;
        int64_t n_in, rows;
    };
    const Shape decode[] = {{DType::Q4_1, 576, 576},  {DType::Q4_1, 576, 1536},  {DType::Q4_1, 1536, 576},
                            {DType::Q4_1, 576, 192},  {DType::Q8_0, 576, 49152}, {DType::Q4_0, 576, 1536},
                            {DType::F16, 576, 1536},  {DType::Q4_K, 1536, 576},  {DType::Q5_K, 1536, 576},
                            {DType::Q6_K, 1536, 576}, {DType::Q5_0, 576, 1536},  {DType::Q5_1, 576, 1536}};
    const Shape prefill[] = {{DType::Q4_1, 576, 576},  {DType::Q4_1, 576, 1536}, {DType::Q4_1, 1536, 576},
                             {DType::Q8_0, 576, 1536}, {DType::Q4_0, 576, 1536}, {DType::Q4_K, 1536, 576},
                             {DType::Q5_K, 1536, 576}, {DType::Q6_K, 1536, 576}, {DType::Q5_0, 576, 1536},
                             {DType::Q5_1, 576, 1536}};
    for (Isa isa : isas) {
        const std::string in = duet::cpu::isa_name(isa);
        // Amx decodes as Avx512 (its tiles start at 16 tokens): its prefill and peak only.
        for (const Shape& s : decode) {
            if (isa == Isa::Amx) break;
            if (isa == Isa::Scalar && s.t != DType::Q4_1) continue;
            const std::string name = "Decode/" + in + "/" + duet::dtype_name(s.t) + "/" + std::to_string(s.n_in) + "x" +
                                     std::to_string(s.rows);
            benchmark::RegisterBenchmark(name.c_str(), BM_Decode, isa, s.t, s.n_in, s.rows)
                ->Unit(benchmark::kMicrosecond);
        }
        if (isa != Isa::Amx) {
            benchmark::RegisterBenchmark(("DecodeStep/" + in + "/SmolLM2-135M").c_str(), BM_DecodeStep, isa)
                ->Unit(benchmark::kMillisecond);
        }
        if (isa != Isa::Scalar && isa != Isa::Amx) {
            for (int nth : {1, 2}) {
                const std::string name = "L3Decode/" + in + "/threads:" + std::to_string(nth);
                benchmark::RegisterBenchmark(name.c_str(), BM_L3Decode, isa, nth)
                    ->UseManualTime()
                    ->Unit(benchmark::kMillisecond);
            }
        }
        if (isa == Isa::Scalar) continue;
        benchmark::RegisterBenchmark(("Int8Peak/" + in).c_str(), BM_Int8Peak, isa)->Unit(benchmark::kMicrosecond);
        for (const Shape& s : prefill) {
            for (int n_tok : {1, 2, 4, 8, 16, 32, 64, 512}) {
                const std::string name = "Prefill/" + in + "/" + duet::dtype_name(s.t) + "/" + std::to_string(s.n_in) +
                                         "x" + std::to_string(s.rows) + "/" + std::to_string(n_tok);
                benchmark::RegisterBenchmark(name.c_str(), BM_Prefill, isa, s.t, s.n_in, s.rows, n_tok)
                    ->Unit(benchmark::kMicrosecond);
            }
        }
        for (DType t : {DType::Q8_0, DType::Q8_1, DType::Q8_K}) {
            const std::string name = "Quantize/" + in + "/" + duet::dtype_name(t) + "/1536";
            benchmark::RegisterBenchmark(name.c_str(), BM_Quantize, isa, t, 1536);
        }
    }
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}
