#include "engine/engine.h"

#include <unistd.h>

#include <atomic>
#include <chrono>

#include "engine/backends.h"

namespace duet {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Result<cpu::Isa> parse_isa(const std::string& name) {
    if (name.empty()) return cpu::isa_best();
    for (cpu::Isa isa : {cpu::Isa::Scalar, cpu::Isa::Avx2, cpu::Isa::Avx512, cpu::Isa::Amx}) {
        if (name != cpu::isa_name(isa)) continue;
        if (!cpu::isa_supported(isa)) return make_error("this CPU (or build) does not support {}", name);
        return isa;
    }
    return make_error("unknown ISA '{}': expected scalar, avx2, avx512 or amx", name);
}

Engine::~Engine() {
    // The backend first (it reads the pool), then the pool (shm_), then the device
    // memory under it.
    backend_.reset();
    shm_.reset();
    device_kv_.reset();
}

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& opts) {
    std::unique_ptr<Engine> e(new Engine());
    auto isa = parse_isa(opts.isa);
    if (!isa) return isa.error();
    e->isa_ = *isa;
    auto dev = parse_device(opts.device);
    if (!dev) return dev.error();
    e->device_ = *dev;
    if (dev->cuda && !cuda_built())
        return make_error("device {}: this duet was built without CUDA (configure with -DDUET_CUDA=ON)", dev->name());
    auto model = Model::load(opts.model_path);
    if (!model) return model.error();
    e->model_ = std::move(model).value();
    auto tok = Tokenizer::from_gguf(e->model_->file());
    if (!tok) return make_error("{}: {}", opts.model_path, tok.error().message);
    e->tok_ = std::move(tok).value();
    if (e->tok_->n_vocab() != e->model_->config().n_vocab)
        return make_error("{}: tokenizer has {} tokens but the model's vocabulary is {}", opts.model_path,
                          e->tok_->n_vocab(), e->model_->config().n_vocab);

    int64_t n_ctx = opts.n_ctx > 0 ? opts.n_ctx : std::min<int64_t>(e->model_->config().n_ctx_train, 4096);
    if (n_ctx > e->model_->config().n_ctx_train)
        return make_error("context of {} tokens is more than the model's {}", n_ctx, e->model_->config().n_ctx_train);
    e->n_ctx_ = n_ctx;
    auto dtype = parse_kv_dtype(opts.kv_dtype);
    if (!dtype) return dtype.error();
    KvLayout layout = kv_layout(*e->model_, *dtype);
    ShmKvOptions so;
    static std::atomic<int> n_engines{0};
    if (opts.instance.empty()) {
        auto scope = shm_scope();
        if (!scope) return scope.error();
        so.instance = fmt::format("{}run-{}-{}", *scope, getpid(), n_engines++);
    } else {
        so.instance = opts.instance;
    }
    so.model_fingerprint = e->model_->fingerprint();
    so.huge_pages = opts.huge_pages;
    const auto n_blocks = static_cast<int32_t>((n_ctx + layout.block_tokens - 1) / layout.block_tokens);
    if (dev->cuda) {
        auto mem = make_device_kv(*dev, layout, n_blocks);
        if (!mem) return mem.error();
        e->device_kv_ = std::move(mem).value();
        so.device_data = e->device_kv_->data();
        so.device_name = dev->name();
    }
    auto kv = ShmKv::create(layout, n_blocks, so);
    if (!kv) return kv.error();
    e->shm_ = std::move(kv).value();

    int n_threads = opts.threads;
    if (n_threads <= 0)
        n_threads = opts.cpus.empty() ? static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)) : static_cast<int>(opts.cpus.size());
    e->threads_ = std::make_unique<ThreadPool>(n_threads, opts.cpus);
    BackendOptions bo;
    bo.device = *dev;
    bo.isa = *isa;
    bo.threads = e->threads_.get();
    bo.max_batch = 8;  // one sequence here; a few buckets for batched callers
    bo.max_ctx = n_ctx;
    bo.cuda_graphs = opts.cuda_graphs;
    bo.cuda_qgemv = opts.cuda_qgemv;
    auto b = make_backend(*e->model_, e->shm_->pool(), bo);
    if (!b) return b.error();
    e->backend_desc_ = std::move(b->description);
    e->backend_ = std::move(b->backend);
    return e;
}

Result<GenerateStats> Engine::generate(const std::vector<int32_t>& prompt, const GenerateOptions& opts,
                                       const std::function<bool(int32_t)>& on_token) {
    if (Status s = opts.sampling.validate(); !s) return s.error();
    if (prompt.empty()) return make_error("the prompt is empty: at least one token is needed");
    if (static_cast<int64_t>(prompt.size()) >= n_ctx_)
        return make_error("the prompt has {} tokens; the context holds {}", prompt.size(), n_ctx_);
    GenerateStats st;
    st.prompt_tokens = static_cast<int64_t>(prompt.size());
    KvSeq seq;
    std::vector<float> logits;
    std::vector<int32_t> out;
    auto fail = [&](const Error& e) {
        seq.release(pool());
        return e;
    };

    auto t0 = std::chrono::steady_clock::now();
    const int64_t chunk = std::max<int64_t>(1, opts.prefill_budget);
    for (int64_t i = 0; i < st.prompt_tokens; i += chunk) {
        SeqBatch b{&seq, prompt.data() + i, static_cast<int32_t>(std::min(chunk, st.prompt_tokens - i)), false};
        if (Status s = backend_->forward({&b, 1}, logits); !s) return fail(s.error());
    }
    const int64_t budget = std::min(opts.max_tokens, n_ctx_ - st.prompt_tokens);
    auto t1 = t0;
    while (st.generated < budget) {
        // The token path's one step (token_step.h), as a serving worker takes it.
        const TokenRules rules{StopRules{static_cast<uint64_t>(budget), opts.stop_at_eog}, {}};
        const Emitted e = emit(sampler_, logits.data(), backend_->n_vocab(), -1, opts.sampling, rules, prompt, out,
                               [&](int32_t x) { return tok_->is_eog(x); });
        if (e.finish == Finish::Failed) return fail(make_error("no token could be chosen"));
        const int32_t id = e.token;
        const Finish f = e.finish;
        if (st.generated == 0) {
            st.prompt_seconds = seconds_since(t0);
            t1 = std::chrono::steady_clock::now();
        }
        out.push_back(id);
        ++st.generated;
        if (!on_token(id)) break;
        if (f != Finish::None) {
            st.finish = f;
            break;
        }
        shm_->instance().registry().heartbeat(shm_->self());  // `duet shm status` shows it
        SeqBatch b{&seq, &out.back(), 1, false};
        if (Status s = backend_->forward({&b, 1}, logits); !s) return fail(s.error());
    }
    st.generate_seconds = st.generated > 1 ? seconds_since(t1) : 0.0;
    seq.release(pool());
    return st;
}

}  // namespace duet
