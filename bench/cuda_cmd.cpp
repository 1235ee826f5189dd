#include "bench/cuda_cmd.h"

#include <cstdio>

#include "base/trace.h"
#include "engine/backends.h"
#include "kv/kv_pool.h"

#if DUET_HAVE_CUDA
#include "bench/cuda_bench.h"
#endif

namespace duet {

int cmd_bench_cuda(const CudaBenchArgs& a) {
    auto dev = parse_device(a.device);
    if (!dev || !dev->cuda) {
        std::fprintf(stderr, "duet bench cuda: --device must be cuda or cuda:N (got '%s')\n", a.device.c_str());
        return 2;
    }
    if (Status st = check_device(*dev); !st) {
        std::fprintf(stderr, "duet bench cuda: %s\n", st.error().message.c_str());
        return 1;
    }
#if DUET_HAVE_CUDA
    CudaBenchOptions o;
    o.model = a.model;
    o.device = dev->index;
    if (!a.batches.empty()) o.batches = a.batches;
    o.ctx = a.ctx;
    o.steps = a.steps;
    o.prefill_tokens = a.prefill_tokens;
    auto dt = parse_kv_dtype(a.kv_dtype);
    if (!dt) {
        std::fprintf(stderr, "duet bench cuda: --kv-dtype: %s\n", dt.error().message.c_str());
        return 2;
    }
    o.kv_dtype = *dt;
    for (const std::string& f : a.skip) {
        bool* flag = f == "sampled"  ? &o.sampled
                     : f == "eager"  ? &o.eager
                     : f == "qgemv"  ? &o.qgemv
                     : f == "copies" ? &o.copies
                                     : nullptr;
        if (!flag) {
            std::fprintf(stderr, "duet bench cuda: --skip: no figure '%s' (sampled, eager, qgemv, copies)\n",
                         f.c_str());
            return 2;
        }
        *flag = false;
    }
    // The backend's ranges and the device's own timings of each pass (base/trace.h).
    if (!a.trace.empty()) {
        Status st = trace::start_file(a.trace);
        if (st) st = trace::open(a.trace, "bench cuda");
        if (!st) {
            std::fprintf(stderr, "duet bench cuda: --trace: %s\n", st.error().message.c_str());
            return 2;
        }
    }
    auto j = run_cuda_bench(o);
    if (!a.trace.empty()) {
        if (Status st = trace::finish_file(a.trace); !st)
            std::fprintf(stderr, "duet bench cuda: --trace: %s\n", st.error().message.c_str());
    }
    if (!j) {
        std::fprintf(stderr, "duet bench cuda: %s\n", j.error().message.c_str());
        return 1;
    }
    if (!a.json_out.empty()) {
        FILE* f = std::fopen(a.json_out.c_str(), "w");
        if (!f || std::fprintf(f, "%s\n", j->dump(1).c_str()) < 0 || std::fclose(f) != 0) {
            std::fprintf(stderr, "duet bench cuda: cannot write %s\n", a.json_out.c_str());
            return 1;
        }
    }
    if (a.json) std::printf("%s\n", j->dump().c_str());
    else std::printf("%s", cuda_bench_markdown(*j).c_str());
    return 0;
#else
    return 1;  // check_device said why
#endif
}

}  // namespace duet
