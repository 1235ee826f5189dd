#include "roles/workers.h"

#include <unistd.h>

#include <algorithm>

namespace duet {

shm::InstanceConfig serve_instance_config(const ServeLayout& l, const Model& model) {
    KvLayout kv = CpuBackend::kv_layout(model);
    const uint64_t block_bytes = kv.tile_elems() * sizeof(uint16_t) * static_cast<uint64_t>(kv.n_layer);
    uint64_t blocks = l.n_blocks;
    if (blocks == 0) {
        blocks = static_cast<uint64_t>(l.n_requests) * static_cast<uint64_t>((l.n_ctx + kv.block_tokens - 1) / kv.block_tokens);
        blocks = std::min<uint64_t>(blocks, (8ull << 30) / block_bytes);
    }
    shm::InstanceConfig c;
    c.name = l.instance;
    c.registry_slots = 16;
    c.n_rings = 2;
    c.requests.n_slots = l.n_requests;
    c.requests.max_tokens = static_cast<uint32_t>(l.n_ctx);
    c.requests.block_tokens = static_cast<uint32_t>(kv.block_tokens);
    c.arenas.push_back(shm::ArenaConfig{static_cast<uint32_t>(blocks), 4, 0});
    c.cpu_kv_bytes = block_bytes * blocks;
    c.model_fingerprint = model.fingerprint();
    return c;
}

// ---------------------------------------------------------------- shared

Status WorkerBase::init(shm::Instance& inst, const Model& model, shm::Role role, const WorkerOptions& o) {
    inst_ = &inst;
    model_ = &model;
    opts_ = o;
    auto tok = Tokenizer::from_gguf(model.file());
    if (!tok) return tok.error();
    tok_ = std::move(tok).value();
    auto self = inst.registry().claim(role, -1, getpid());
    if (!self) return self.error();
    self_ = *self;
    auto user = inst.arena(0).join(self_);
    if (!user) return user.error();
    user_ = *user;
    joined_ = true;
    auto alloc = std::make_unique<ShmBlockAllocator>(inst.arena(0), user_);
    alloc_ = alloc.get();
    pool_ = std::make_unique<KvPool>(CpuBackend::kv_layout(model), reinterpret_cast<uint16_t*>(inst.cpu_kv_data()),
                                     std::move(alloc));
    threads_ = std::make_unique<ThreadPool>(std::max(1, o.threads), o.cpus);
    backend_ = std::make_unique<CpuBackend>(model, *pool_, *threads_, o.isa);
    inst.registry().set_running(self_);
    return {};
}

WorkerBase::~WorkerBase() {
    backend_.reset();
    pool_.reset();
    if (inst_ && joined_) inst_->arena(0).leave(user_);
    if (inst_ && self_.valid()) inst_->registry().release(self_);
}

Status WorkerBase::run(const std::atomic<bool>& stop) {
    shm::Doorbell& bell = inst_->registry().doorbell(self_.slot);
    while (!stop.load(std::memory_order_relaxed)) {
        auto did = step();
        if (!did) return did.error();
        inst_->registry().heartbeat(self_);
        // Idle: sleep until a producer rings, or 1 ms (to settle hand-offs, see stop).
        if (!*did) shm::doorbell_wait(bell, [&] { return has_work(); }, 256, 1'000'000);
    }
    return {};
}

// ---------------------------------------------------------------- prefill

Result<std::unique_ptr<PrefillWorker>> PrefillWorker::create(shm::Instance& inst, const Model& model,
                                                             const WorkerOptions& o) {
    std::unique_ptr<PrefillWorker> w(new PrefillWorker());
    if (Status st = w->init(inst, model, shm::Role::Prefill, o); !st) return st.error();
    w->in_ = shm::SpscConsumer<WireMsg>(inst.ring(kRingToPrefill));
    w->out_ = shm::SpscProducer<WireMsg>(inst.ring(kRingToDecode));
    return w;
}

PrefillWorker::~PrefillWorker() {
    for (Pending& p : pending_)
        for (int32_t b : p.blocks) pool_->allocator().unref(b);
}

bool PrefillWorker::has_work() { return in_.readable(); }

void PrefillWorker::settle() {
    shm::RequestTable& t = inst_->requests();
    for (size_t i = 0; i < pending_.size();) {
        if (shm::handoff_settled(t, pending_[i].h)) {
            for (int32_t b : pending_[i].blocks) pool_->allocator().unref(b);
            pending_[i] = std::move(pending_.back());
            pending_.pop_back();
        } else {
            ++i;
        }
    }
}

Result<bool> PrefillWorker::step() {
    settle();
    size_t n = 0;
    const WireMsg* m = in_.peek(&n);
    if (n == 0) return false;
    shm::RequestTable& t = inst_->requests();
    const shm::ReqRef r{m->slot, m->gen};
    // A message for a request another prefill took, or that was re-driven and sent
    // again, loses this CAS and is dropped.
    if (t.transition(r, shm::ReqState::Queued, shm::ReqState::Prefilling, self_)) {
        const RequestParams p = request_params(t, r.slot);
        const uint32_t np = t.slot(r.slot).n_prompt.load(std::memory_order_relaxed);
        std::vector<int32_t> prompt(t.tokens(r.slot), t.tokens(r.slot) + np), output;
        auto no = t.read_output(r, 0, output);
        auto done_already = [&] {
            return output.size() >= p.max_tokens || (p.stop_at_eog && !output.empty() && tok_->is_eog(output.back()));
        };
        if (!no || done_already()) {  // re-driven after its last token was written
            t.transition(r, shm::ReqState::Prefilling, shm::ReqState::Finished);
        } else {
            std::vector<int32_t> all = prompt;
            all.insert(all.end(), output.begin(), output.end());
            KvSeq seq;
            Status st;
            for (size_t i = 0; i < all.size() && st.ok(); i += static_cast<size_t>(opts_.prefill_chunk)) {
                SeqBatch b{&seq, all.data() + i,
                           static_cast<int32_t>(std::min<size_t>(static_cast<size_t>(opts_.prefill_chunk), all.size() - i)),
                           false};
                st = backend_->forward({&b, 1}, logits_);
            }
            int32_t next = -1;
            if (st.ok()) {
                next = sampler_.sample(logits_.data(), backend_->n_vocab(), p.sampling, prompt, output, output.size());
                st = t.append_output(r, &next, 1);
            }
            if (st.ok()) st = t.append_blocks(r, seq.blocks().data(), static_cast<uint32_t>(seq.blocks().size()));
            if (!st.ok()) {
                t.slot(r.slot).error_code.store(1, std::memory_order_relaxed);
                t.transition(r, shm::ReqState::Prefilling, shm::ReqState::Failed);
                seq.release(*pool_);
            } else if (output.size() + 1 >= p.max_tokens || (p.stop_at_eog && tok_->is_eog(next)) ||
                       t.cancelled(r)) {
                t.transition(r, shm::ReqState::Prefilling,
                             t.cancelled(r) ? shm::ReqState::Cancelled : shm::ReqState::Finished);
                seq.release(*pool_);
            } else {
                const uint32_t att = t.attempt(r.slot);
                WireMsg h{r.slot, r.gen, att, self_.slot, self_.gen, user_, {}};
                while (!out_.try_push(h)) usleep(50);  // decode drains it every step
                shm::Registry& reg = inst_->registry();
                if (int32_t s = reg.find_running(shm::Role::Decode); s >= 0)
                    shm::doorbell_ring(reg.doorbell(static_cast<uint32_t>(s)));
                pending_.push_back({shm::Handoff{r, att, self_, user_}, seq.detach()});
            }
        }
    }
    in_.release(1);  // only now: a prefill that dies before this leaves the message to its successor
    return true;
}

// ---------------------------------------------------------------- decode

Result<std::unique_ptr<DecodeWorker>> DecodeWorker::create(shm::Instance& inst, const Model& model,
                                                           const WorkerOptions& o) {
    std::unique_ptr<DecodeWorker> w(new DecodeWorker());
    if (Status st = w->init(inst, model, shm::Role::Decode, o); !st) return st.error();
    w->in_ = shm::SpscConsumer<WireMsg>(inst.ring(kRingToDecode));
    return w;
}

DecodeWorker::~DecodeWorker() {
    for (Active& a : active_) a.seq.release(*pool_);
}

bool DecodeWorker::has_work() { return !active_.empty() || in_.readable(); }

void DecodeWorker::finish(size_t i, shm::ReqState to) {
    inst_->requests().transition(active_[i].req, shm::ReqState::Decoding, to);
    active_[i].seq.release(*pool_);
    active_[i] = std::move(active_.back());
    active_.pop_back();
}

Result<bool> DecodeWorker::step() {
    shm::RequestTable& t = inst_->requests();
    size_t n = 0;
    const WireMsg* m = in_.peek(&n);
    for (size_t i = 0; i < n; ++i) {
        shm::Handoff h{{m[i].slot, m[i].gen}, m[i].attempt, {m[i].from_slot, m[i].from_gen}, m[i].from_user};
        if (!shm::handoff_accept(inst_->arena(0), t, h, self_, user_)) continue;
        Active a;
        a.req = h.req;
        a.params = request_params(t, h.req.slot);
        const uint32_t np = t.slot(h.req.slot).n_prompt.load(std::memory_order_relaxed);
        a.prompt.assign(t.tokens(h.req.slot), t.tokens(h.req.slot) + np);
        (void)t.read_output(h.req, 0, a.output);
        const uint32_t nb = t.slot(h.req.slot).n_blocks.load(std::memory_order_acquire);
        std::vector<int32_t> blocks(t.blocks(h.req.slot), t.blocks(h.req.slot) + nb);
        alloc_->handed_by(h.from_user, blocks);
        // Every token but the newest output has its KV in the blocks.
        a.seq = KvSeq::adopt(std::move(blocks), static_cast<int64_t>(np + a.output.size()) - 1);
        active_.push_back(std::move(a));
    }
    in_.release(n);
    for (size_t i = 0; i < active_.size();) {
        if (t.cancelled(active_[i].req)) finish(i, shm::ReqState::Cancelled);
        else ++i;
    }
    if (active_.empty()) return false;
    std::vector<SeqBatch> batch;
    for (Active& a : active_) batch.push_back(SeqBatch{&a.seq, &a.output.back(), 1, false});
    if (Status st = backend_->forward(batch, logits_); !st) {
        // Out of KV blocks (or similar): fail the newest request and try again next step.
        t.slot(active_.back().req.slot).error_code.store(2, std::memory_order_relaxed);
        finish(active_.size() - 1, shm::ReqState::Failed);
        return true;
    }
    const int64_t nv = backend_->n_vocab();
    std::vector<size_t> done;
    for (size_t i = 0; i < active_.size(); ++i) {
        Active& a = active_[i];
        int32_t next = sampler_.sample(logits_.data() + static_cast<int64_t>(i) * nv, nv, a.params.sampling, a.prompt,
                                       a.output, a.output.size());
        a.output.push_back(next);
        if (!t.append_output(a.req, &next, 1).ok() || a.output.size() >= a.params.max_tokens ||
            (a.params.stop_at_eog && tok_->is_eog(next)))
            done.push_back(i);
    }
    for (size_t k = done.size(); k-- > 0;) finish(done[k], shm::ReqState::Finished);
    return true;
}

}  // namespace duet
