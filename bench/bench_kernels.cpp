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
// - Prefill/<type>/<n_in>x<rows>/<n_tok>: matmul on hot weights; "ops" counts
//   2 * rows * n_in * n_tok per iteration (GOPS). n_tok = 1 here is the decode
//   kernel's speed when weights come from cache (its compute ceiling).
// Times are CPU time of the one thread (robust to sharing the machine).
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels.h"

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
        if (t == DType::Q4_K || t == DType::Q6_K) {
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
    for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
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
    const Shape decode[] = {{DType::Q4_1, 576, 576},   {DType::Q4_1, 576, 1536}, {DType::Q4_1, 1536, 576},
                            {DType::Q4_1, 576, 192},   {DType::Q8_0, 576, 49152}, {DType::Q4_0, 576, 1536},
                            {DType::F16, 576, 1536},   {DType::Q4_K, 1536, 576}, {DType::Q6_K, 1536, 576}};
    const Shape prefill[] = {{DType::Q4_1, 576, 576},  {DType::Q4_1, 576, 1536}, {DType::Q4_1, 1536, 576},
                             {DType::Q8_0, 576, 1536}, {DType::Q4_0, 576, 1536}};
    for (Isa isa : isas) {
        const std::string in = duet::cpu::isa_name(isa);
        for (const Shape& s : decode) {
            if (isa == Isa::Scalar && s.t != DType::Q4_1) continue;
            const std::string name = "Decode/" + in + "/" + duet::dtype_name(s.t) + "/" + std::to_string(s.n_in) + "x" +
                                     std::to_string(s.rows);
            benchmark::RegisterBenchmark(name.c_str(), BM_Decode, isa, s.t, s.n_in, s.rows)
                ->Unit(benchmark::kMicrosecond);
        }
        benchmark::RegisterBenchmark(("DecodeStep/" + in + "/SmolLM2-135M").c_str(), BM_DecodeStep, isa)
            ->Unit(benchmark::kMillisecond);
        if (isa == Isa::Scalar) continue;
        for (const Shape& s : prefill) {
            for (int n_tok : {1, 64, 512}) {
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
