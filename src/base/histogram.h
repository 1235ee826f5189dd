// A latency histogram for /metrics: fixed 1-2-5 bucket bounds from 1 µs to 100 s,
// lock-free counts (any thread may observe), rendered in Prometheus' text format,
// and a quantile estimate (linear inside the bucket, as Prometheus'
// histogram_quantile does) for logs and benchmarks.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>

#include <fmt/format.h>

namespace duet {

class Histogram {
public:
    static constexpr int kBuckets = 25;  // 1e-6 .. 1e2 seconds, 1-2-5 per decade
    // The i-th bound, the double nearest 1, 2 or 5 x 10^(i/3 - 6): a small integer
    // divided (or multiplied) by an exact power of ten rounds once, so the shortest
    // text of each is "5e-06", "0.02", "100" (Prometheus' `le` as its own clients
    // write it), never pow()'s 4.9999999999999996e-06.
    static double bound(int i) {
        static const double mant[3] = {1, 2, 5};
        static const double pow10[7] = {1, 10, 100, 1e3, 1e4, 1e5, 1e6};  // exact doubles
        const int e = i / 3 - 6;
        return e < 0 ? mant[i % 3] / pow10[-e] : mant[i % 3] * pow10[e];
    }

    void observe(double seconds) {
        int i = 0;
        while (i < kBuckets && seconds > bound(i)) ++i;
        counts_[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed);
        // Sum in nanoseconds: an integer add is one atomic instruction.
        sum_ns_.fetch_add(static_cast<uint64_t>(std::max(0.0, seconds) * 1e9), std::memory_order_relaxed);
    }
    uint64_t count() const {
        uint64_t n = 0;
        for (const auto& c : counts_) n += c.load(std::memory_order_relaxed);
        return n;
    }
    // The q-quantile (0..1) in seconds; NaN when empty. Values past the last bound
    // report that bound.
    double quantile(double q) const {
        const uint64_t n = count();
        if (n == 0) return NAN;
        const double rank = q * static_cast<double>(n);
        double seen = 0;
        for (int i = 0; i <= kBuckets; ++i) {
            const double c = static_cast<double>(counts_[static_cast<size_t>(i)].load(std::memory_order_relaxed));
            if (c > 0 && seen + c >= rank) {
                if (i == kBuckets) return bound(kBuckets - 1);
                const double lo = i == 0 ? 0 : bound(i - 1), hi = bound(i);
                return lo + (hi - lo) * std::clamp((rank - seen) / c, 0.0, 1.0);
            }
            seen += c;
        }
        return bound(kBuckets - 1);
    }
    // "# HELP", "# TYPE" and the _bucket / _sum / _count lines.
    std::string prometheus(const std::string& name, const std::string& help) const {
        return fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name) + series(name, "");
    }
    // The _bucket / _sum / _count lines alone, with `labels` (`class="batch"`; "":
    // none) before le: one series of a labelled family.
    std::string series(const std::string& name, const std::string& labels) const {
        const std::string sep = labels.empty() ? "" : ",";
        const std::string own = labels.empty() ? "" : "{" + labels + "}";
        std::string s;
        uint64_t cum = 0;
        for (int i = 0; i < kBuckets; ++i) {
            cum += counts_[static_cast<size_t>(i)].load(std::memory_order_relaxed);
            s += fmt::format("{}_bucket{{{}{}le=\"{}\"}} {}\n", name, labels, sep, bound(i), cum);
        }
        cum += counts_[kBuckets].load(std::memory_order_relaxed);
        s += fmt::format("{}_bucket{{{}{}le=\"+Inf\"}} {}\n{}_sum{} {}\n{}_count{} {}\n", name, labels, sep, cum, name,
                         own, static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9, name, own, cum);
        return s;
    }

private:
    std::array<std::atomic<uint64_t>, kBuckets + 1> counts_{};  // the last: above every bound
    std::atomic<uint64_t> sum_ns_{0};
};

}  // namespace duet
