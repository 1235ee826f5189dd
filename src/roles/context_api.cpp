#include "roles/context_api.h"

#include "base/log.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "engine/backends.h"
#include "model/backend.h"
#include "model/fingerprint.h"
#include "roles/openai.h"
#include "roles/wire.h"

namespace duet {

using json = nlohmann::json;

// ---------------------------------------------------------------- ServingCompute

ServingCompute::ServingCompute(shm::Instance& inst, shm::ProcRef self, PrefillRouter& router, KvPool& pool,
                               KvCacheManager& kv, uint64_t model_fingerprint)
    : inst_(inst), self_(self), router_(router), pool_(pool), kv_(kv), fingerprint_(model_fingerprint) {}

std::vector<shm::BlockHash> ServingCompute::hashes(std::span<const int32_t> tokens) const {
    // As the prefill worker hashes a prompt (PrefillWorker::admit): chained over full
    // blocks, with the model's fingerprint and no salt.
    const auto bt = static_cast<size_t>(pool_.layout().block_tokens);
    std::vector<shm::BlockHash> out;
    shm::BlockHash h;
    for (size_t at = 0; at + bt <= tokens.size(); at += bt) {
        h = hasher_.hash(h, tokens.data() + at, bt, fingerprint_, {});
        out.push_back(h);
    }
    return out;
}

void ServingCompute::resident(const KvSeq& seq, std::span<const int32_t> tokens) {
    kv_.publish_prefix(seq, hashes(tokens.first(static_cast<size_t>(seq.n_tokens()))), 0, seq.n_tokens());
}

Status ServingCompute::extend(KvSeq& seq, std::span<const int32_t> tokens, std::vector<float>& last) {
    last.clear();
    const auto n = static_cast<int64_t>(tokens.size());
    if (seq.n_tokens() >= n) return make_error(ErrorKind::Invalid, "nothing to compute");
    // What we hold must be findable by prefill's prefix lookup.
    resident(seq, tokens);
    shm::RequestTable& t = inst_.requests();
    if (n >= static_cast<int64_t>(t.max_tokens()))
        return make_error(ErrorKind::Invalid, "the context would hold {} tokens; a request slot holds {} (--ctx)", n,
                          t.max_tokens());
    RequestParams p;
    p.max_tokens = 1;
    p.stop_at_eog = 0;
    p.keep_kv = 1;
    p.sampling.temperature = 0;
    // Prefill starts from our blocks, the partial last one included (copied on write):
    // only the new positions are computed. We hold them until it ends (the store's
    // lock keeps the context from being evicted meanwhile).
    p.given_tokens = static_cast<uint32_t>(seq.n_tokens());
    p.given_by = self_.pack();
    p.bind_arena(kContextArena);  // where our blocks are
    auto r = t.submit(self_, tokens.data(), static_cast<uint32_t>(n), &p, sizeof p);
    while (!r && make_room_ && make_room_()) r = t.submit(self_, tokens.data(), static_cast<uint32_t>(n), &p, sizeof p);
    if (!r) return make_error(ErrorKind::Limit, "the server is at capacity ({})", r.error().message);
    // A failed offer leaves the table empty: prefill then computes every position.
    if (!seq.blocks().empty()) (void)t.offer_blocks(*r, seq.blocks().data(), static_cast<uint32_t>(seq.blocks().size()));
    if (!router_.send(*r)) {
        (void)t.transition(*r, shm::ReqState::Failed, shm::ReqState::Free);  // send() failed it: the front's alone
        return make_error("no prefill worker took the context's computation");
    }
    shm::ReqState st;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
    // Bound to our arena: only its prefill workers take it. When none has run for
    // kNoWorkerWait (a pair down for good under `duet instance`, whose units restart
    // without a limit), the computation ends with an error instead of holding the
    // store (and every context operation behind it) for the whole deadline.
    const shm::InstanceConfig& cfg = inst_.config();
    std::optional<std::chrono::steady_clock::time_point> none_since;  // no such worker running since
    bool gave_up = false;
    for (;;) {
        st = t.state(r->slot);
        if (st == shm::ReqState::Finished || st == shm::ReqState::Failed || st == shm::ReqState::Cancelled) break;
        const auto now = std::chrono::steady_clock::now();
        // While nobody took it (QUEUED), a look at the registry for each prefill worker.
        bool taker = st != shm::ReqState::Queued;
        for (uint32_t p = 0; p < cfg.prefill_workers && !taker; ++p)
            taker = worker_arena(cfg, shm::Role::Prefill, p) == kContextArena &&
                    inst_.registry().find_running(shm::Role::Prefill, static_cast<int32_t>(p)) >= 0;
        if (taker) none_since.reset();
        else if (!none_since) none_since = now;
        if (now > deadline || (none_since && now - *none_since > kNoWorkerWait)) {
            gave_up = true;
            t.cancel(*r);
            // Taken by nobody: nobody else ends it (a prefill worker's later CAS
            // QUEUED -> PREFILLING fails, and its copy of the message is dropped).
            (void)t.transition(*r, shm::ReqState::Queued, shm::ReqState::Cancelled);
            continue;  // a cancelled request still ends
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    Status out;
    const int64_t had = seq.n_tokens();
    recomputed_ = 0;
    if (st == shm::ReqState::Finished) {
        // Prefill computed what its prefix lookup did not find (n_cached).
        const int64_t cached = t.slot(r->slot).n_cached.load(std::memory_order_relaxed);
        recomputed_ = std::max<int64_t>(0, had - cached);
        // Our references now (give_kv_to_client moved prefill's to our arena user).
        const uint32_t nb = t.slot(r->slot).n_blocks.load(std::memory_order_acquire);
        std::vector<int32_t> blocks(t.blocks(r->slot), t.blocks(r->slot) + nb);
        seq.release(pool_);
        seq = KvSeq::adopt(std::move(blocks), n);
    } else if (t.slot(r->slot).error_code.load(std::memory_order_relaxed) ==
               static_cast<int32_t>(ReqError::PrefillKv)) {
        // The store evicts other contexts and tries again (ContextStore::compute).
        out = make_error(ErrorKind::NoKvBlocks, "prefill found no KV blocks for the context's computation");
    } else if (gave_up) {
        out = make_error("no prefill worker of the contexts' KV arena (arena {}) took the context's computation",
                         kContextArena);
    } else {
        out = make_error("prefill failed the context's computation ({})",
                         t.slot(r->slot).error_code.load(std::memory_order_relaxed));
    }
    (void)t.transition(*r, st, shm::ReqState::Free);  // ended: the front's alone
    return out;
}

// ---------------------------------------------------------------- the API

namespace {

ApiReply error_reply(int status, const std::string& message, const std::string& param = "") {
    ApiError e;
    e.status = status;
    e.type = status == 404   ? "not_found_error"
             : status == 409 ? "conflict_error"
             : status == 429 ? "rate_limit_error"
             : status >= 500 ? "server_error"
                             : "invalid_request_error";
    e.message = message;
    e.param = param;
    return {status, error_json(e)};
}

// A store's message as a client may read it: the server's paths under the contexts
// directory become the context they belong to (<dir>/<id>.kvlog -> context '<id>'),
// anything else under it "the contexts directory". The whole message of a server
// error goes to the server's log (a client's own errors, a bad import say, do not).
std::string public_message(const std::string& msg, const std::string& dir, bool server_error) {
    if (dir.empty() || msg.find(dir) == std::string::npos) return msg;
    if (server_error) log::error("contexts: " + msg);
    std::string out;
    size_t at = 0;
    for (size_t p; (p = msg.find(dir, at)) != std::string::npos;) {
        out.append(msg, at, p - at);
        size_t q = p + dir.size();
        if (q < msg.size() && msg[q] == '/') ++q;
        size_t end = q;
        while (end < msg.size() && msg[end] != ':' && msg[end] != ' ' && msg[end] != ',' && msg[end] != ';') ++end;
        const std::string file = msg.substr(q, end - q);
        const size_t dot = file.find(".kvlog");
        if (dot != std::string::npos && file.find('/') == std::string::npos) {
            out += "context '" + file.substr(0, dot) + "'";
        } else {
            out += "the contexts directory";
        }
        at = end;
    }
    out.append(msg, at);
    return out;
}

ApiReply error_reply(const Error& e, const std::string& dir) {
    const int status = e.kind == ErrorKind::NotFound     ? 404
                       : e.kind == ErrorKind::Exists     ? 409
                       : e.kind == ErrorKind::Invalid    ? 400
                       : e.kind == ErrorKind::Limit      ? 429
                       : e.kind == ErrorKind::NoKvBlocks ? 503
                       : e.kind == ErrorKind::NoSpace    ? 507
                                                         : 500;
    std::string m = public_message(e.message, dir, status >= 500);
    if (status == 507) m += " (the contexts' disk is full: free space and retry)";
    return error_reply(status, m, status == 409 ? "id" : "");
}

json info_json(const ContextInfo& i, const ContextUsage* u = nullptr) {
    json j = {{"id", i.id},
              {"object", "context"},
              {"n_tokens", i.n_tokens},
              {"durable", i.durable},
              {"resident", i.resident},
              {"pin_prefix", i.pinned},
              {"disk_bytes", i.disk_bytes},
              {"created", i.created_ns / 1000000000ull},
              {"last_used", i.used_ns / 1000000000ull}};
    if (u)
        j["usage"] = {
            {"restored_tokens", u->restored}, {"reused_tokens", u->reused}, {"prefilled_tokens", u->prefilled}};
    return j;
}

ApiReply ok(int status, const json& j) { return {status, j.dump()}; }

// The body's new tokens: "tokens" (ids), "prompt" (text) or "messages" (chat
// messages: a whole conversation when they start the context, at `at` == 0, else
// the tokens that add them to the conversation before; "add_generation_prompt"
// opens the assistant's turn after them).
std::variant<std::vector<int32_t>, ApiReply> new_tokens(const json& b, const Tokenizer& tok, const ChatTurns& turns,
                                                        int64_t at, bool required) {
    const int given = int(b.contains("tokens")) + int(b.contains("prompt")) + int(b.contains("messages"));
    if (given > 1) return error_reply(400, "send one of \"prompt\", \"tokens\" or \"messages\"");
    if (b.contains("add_generation_prompt") && (!b["add_generation_prompt"].is_boolean() || !b.contains("messages")))
        return error_reply(400, "add_generation_prompt: a boolean, with \"messages\"", "add_generation_prompt");
    if (b.contains("messages")) {
        std::vector<ChatMessage> msgs;
        if (auto e = read_chat_messages(b, msgs)) return error_reply(e->status, e->message, e->param);
        auto t = turns.extend(static_cast<size_t>(at), msgs, b.value("add_generation_prompt", false));
        if (!t) return error_reply(400, t.error().message, "messages");
        return std::move(t).value();
    }
    if (b.contains("tokens")) {
        if (!b["tokens"].is_array()) return error_reply(400, "tokens: an array of token ids", "tokens");
        std::vector<int32_t> t;
        for (const json& v : b["tokens"]) {
            if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.n_vocab())
                return error_reply(400, fmt::format("tokens: ids are integers in [0, {})", tok.n_vocab()), "tokens");
            t.push_back(v.get<int32_t>());
        }
        return t;
    }
    if (b.contains("prompt")) {
        if (!b["prompt"].is_string()) return error_reply(400, "prompt: a string", "prompt");
        return tok.encode(b["prompt"].get<std::string>(), false, false);
    }
    if (required) return error_reply(400, "\"prompt\", \"tokens\" or \"messages\" is required");
    return std::vector<int32_t>{};
}

// A query's value for `key` ("" when absent). Ids and booleans need no %-decoding:
// a value with '%' is taken as it is and refused where it is checked.
std::string query_value(const std::string& query, const std::string& key) {
    size_t at = 0;
    while (at <= query.size()) {
        size_t amp = query.find('&', at);
        if (amp == std::string::npos) amp = query.size();
        const std::string pair = query.substr(at, amp - at);
        if (pair.rfind(key + "=", 0) == 0) return pair.substr(key.size() + 1);
        at = amp + 1;
    }
    return "";
}

std::variant<json, ApiReply> parse_body(const std::string& body) {
    if (body.empty()) return json::object();
    json b = json::parse(body, nullptr, false);
    if (b.is_discarded() || !b.is_object()) return error_reply(400, "the body is not a JSON object");
    return b;
}

std::variant<int64_t, ApiReply> int_field(const json& b, const char* name, int64_t fallback, bool required) {
    if (!b.contains(name)) {
        if (required) return error_reply(400, fmt::format("\"{}\" is required", name), name);
        return fallback;
    }
    if (!b[name].is_number_integer()) return error_reply(400, fmt::format("{}: an integer", name), name);
    return b[name].get<int64_t>();
}

std::string new_id() {
    static std::mt19937_64 rng(std::random_device{}());
    return fmt::format("ctx-{:012x}", rng() & 0xffffffffffffull);
}

}  // namespace

Result<std::unique_ptr<ContextService>> ContextService::open(shm::Instance& inst, shm::ProcRef self,
                                                             PrefillRouter& router, const Model& model,
                                                             const Tokenizer& tok, const ChatTemplate& tmpl,
                                                             const std::string& dir, size_t max_contexts,
                                                             uint64_t max_disk_bytes) {
    const bool gpu = inst.config().cpu_kv_bytes == 0;
    // Contexts offer their blocks to prefill and take back a completion's: they must
    // be in the arena the prefill and decode workers compute in. Their requests are
    // bound to it (RequestParams::bind_arena): on GPU pairs, to GPU 0's pair. With per-role
    // arenas on GPUs a completion's KV would come back in a decode GPU's arena.
    if (gpu && inst.config().kv_split)
        return make_error("contexts on GPUs: the roles of a GPU sharing its arena (not --kv-arenas per-role); "
                          "instance '{}' splits them",
                          inst.config().name);
    std::unique_ptr<ContextService> s(new ContextService());
    s->inst_ = &inst;
    s->tok_ = &tok;
    s->turns_ = std::make_unique<ChatTurns>(tmpl, tok);
    auto user = inst.arena(kContextArena).join(self);
    if (!user) return make_error("contexts: the KV arena: {}", user.error().message);
    s->user_ = *user;
    s->joined_ = true;
    auto dtype = kv_dtype_from(inst.config().kv_dtype);
    if (!dtype) return dtype.error();
    auto alloc = std::make_unique<ShmBlockAllocator>(inst.arena(kContextArena), s->user_);
    s->alloc_ = alloc.get();
    const KvLayout layout = kv_layout(model, *dtype);
    if (gpu) {
        // Device memory this process does not compute in: the store works on the
        // arena's host mirror, its blocks copied on the store thread (kv_stage.h).
        s->gpu_alloc_ = std::move(alloc);
        auto mirror = KvMirror::create(layout, *s->gpu_alloc_);
        if (!mirror) return make_error("contexts: {}", mirror.error().message);
        s->mirror_ = std::move(mirror).value();
        auto stage = kept_kv_stage(inst.config().name, kContextArena, s->mirror_->pool());
        if (!stage) return make_error("contexts: {}", stage.error().message);
        s->stage_ = std::move(stage).value();
        s->pool_ = &s->mirror_->pool();
    } else {
        s->own_pool_ = std::make_unique<KvPool>(layout, inst.cpu_kv_data(kContextArena), std::move(alloc));
        s->pool_ = s->own_pool_.get();
    }
    s->kv_ = std::make_unique<KvCacheManager>(*s->pool_, s->alloc_);
    s->compute_ = std::make_unique<ServingCompute>(inst, self, router, *s->pool_, *s->kv_, model.fingerprint());
    auto dev = UringLogDevice::create();
    if (!dev) return dev.error();
    s->dev_ = std::move(dev).value();
    s->sync_ = std::make_unique<KvLogSync>(*s->dev_);
    ContextStoreOptions o;
    o.dir = dir;
    o.id = {model_fingerprint(model.file()), tokenizer_fingerprint(model.file()), model.config().n_vocab};
    o.max_contexts = max_contexts;
    o.max_disk_bytes = max_disk_bytes;
    o.max_tokens = static_cast<int64_t>(inst.requests().max_tokens());
    // C6: the records of the contexts that are not durable live in the instance's
    // table, so they outlive this process; a front that died left its records there.
    shm::ContextTable& table = inst.contexts();
    if (!table.present())
        return make_error("contexts: instance '{}' has no context table (start it with --contexts-dir too)",
                          inst.config().name);
    if (table.n_slots() < max_contexts + 1)
        return make_error("contexts: the instance's context table has {} records, --contexts-max {} needs {}",
                          table.n_slots(), max_contexts, max_contexts + 1);
    if (Status st = table.claim(self, inst.registry()); !st) return make_error("contexts: {}", st.error().message);
    s->table_ = &table;
    s->self_ = self;
    o.table = &table;
    o.stage = s->stage_.get();
    o.mirror = s->mirror_.get();
    auto store = ContextStore::open(*s->pool_, *s->sync_, *s->compute_, o);
    if (!store) return store.error();
    s->store_ = std::move(store).value();
    // Exports and imports pass through files here; a previous run's are left-overs.
    s->spool_dir_ = dir + "/spool";
    s->store_dir_ = dir;
    if (::mkdir(s->spool_dir_.c_str(), 0700) != 0 && errno != EEXIST)
        return make_error("{}: cannot create: {}", s->spool_dir_, std::strerror(errno));
    if (DIR* d = ::opendir(s->spool_dir_.c_str())) {
        while (dirent* e = ::readdir(d))
            if (e->d_name[0] != '.') ::unlinkat(::dirfd(d), e->d_name, 0);
        ::closedir(d);
    }
    auto most = blob_data_bytes(s->pool_->layout(), o.max_tokens);
    if (!most) return most.error();
    s->max_blob_bytes_ = kBlobHeaderBytes + *most;
    for (const auto& [file, why] : s->store_->refused())
        log::warning(fmt::format("context log {}/{} refused: {}", dir, file, why));
    return s;
}

ContextService::~ContextService() {
    store_.reset();  // gives the blocks back
    if (table_) table_->release(self_);  // the records stay, for the next front
    kv_.reset();
    stage_.reset();
    mirror_.reset();
    own_pool_.reset();
    gpu_alloc_.reset();
    if (joined_) inst_->arena(kContextArena).leave(user_);
}

ApiReply ContextService::create(const std::string& body) {
    auto b = parse_body(body);
    if (auto* e = std::get_if<ApiReply>(&b)) return *e;
    const json& j = std::get<json>(b);
    std::string id = new_id();
    if (j.contains("id")) {
        if (!j["id"].is_string()) return error_reply(400, "id: a string", "id");
        id = j["id"].get<std::string>();
    }
    bool durable = true;
    if (j.contains("durable")) {
        if (!j["durable"].is_boolean()) return error_reply(400, "durable: a boolean", "durable");
        durable = j["durable"].get<bool>();
    }
    bool pin = false;
    if (j.contains("pin_prefix")) {
        if (!j["pin_prefix"].is_boolean()) return error_reply(400, "pin_prefix: a boolean", "pin_prefix");
        pin = j["pin_prefix"].get<bool>();
    }
    auto toks = new_tokens(j, *tok_, *turns_, 0, false);
    if (auto* e = std::get_if<ApiReply>(&toks)) return *e;
    ContextUsage u;
    auto r = store_->create(id, std::get<std::vector<int32_t>>(toks), durable, &u, pin);
    if (!r) return error_reply(r.error(), store_dir_);
    return ok(201, info_json(*r, &u));
}

ApiReply ContextService::route_one(const std::string& method, const std::string& id, const std::string& op,
                                   const std::string& query, const std::string& body) {
    if (auto refused = refused_reply(id)) return *refused;
    if (op.empty() && method == "GET") {
        auto i = store_->info(id);
        if (!i) return error_reply(i.error(), store_dir_);
        json j = info_json(*i);
        if (query.find("tokens=true") != std::string::npos) j["tokens"] = *store_->tokens(id);
        return ok(200, j);
    }
    if (op.empty() && method == "DELETE") {
        if (Status st = store_->remove(id); !st) return error_reply(st.error(), store_dir_);
        return ok(200, {{"id", id}, {"object", "context"}, {"deleted", true}});
    }
    if (method != "POST" || op.empty()) return error_reply(405, fmt::format("{} is not allowed here", method));
    auto b = parse_body(body);
    if (auto* e = std::get_if<ApiReply>(&b)) return *e;
    const json& j = std::get<json>(b);
    ContextUsage u;
    Result<ContextInfo> r = make_error(ErrorKind::NotFound, "no route");
    if (op == "append" || op == "edit") {
        // Where the new tokens go: messages are rendered as a conversation's start
        // there, or as more of it.
        int64_t at = 0;
        if (op == "append") {
            auto i = store_->info(id);
            if (!i) return error_reply(i.error(), store_dir_);
            at = i->n_tokens;
        } else {
            auto a = int_field(j, "at", 0, true);
            if (auto* e = std::get_if<ApiReply>(&a)) return *e;
            at = std::get<int64_t>(a);
        }
        auto toks = new_tokens(j, *tok_, *turns_, at, op == "append");
        if (auto* e = std::get_if<ApiReply>(&toks)) return *e;
        const auto& t = std::get<std::vector<int32_t>>(toks);
        r = op == "append" ? store_->append(id, t, &u) : store_->edit(id, at, t, &u);
    } else if (op == "truncate") {
        auto n = int_field(j, "n_tokens", 0, true);
        if (auto* e = std::get_if<ApiReply>(&n)) return *e;
        r = store_->truncate(id, std::get<int64_t>(n));
    } else if (op == "fork") {
        auto at = int_field(j, "at", -1, false);
        if (auto* e = std::get_if<ApiReply>(&at)) return *e;
        std::string fid = new_id();
        if (j.contains("id")) {
            if (!j["id"].is_string()) return error_reply(400, "id: a string", "id");
            fid = j["id"].get<std::string>();
        }
        int durable = -1;
        if (j.contains("durable")) {
            if (!j["durable"].is_boolean()) return error_reply(400, "durable: a boolean", "durable");
            durable = j["durable"].get<bool>() ? 1 : 0;
        }
        if (std::get<int64_t>(at) < -1) return error_reply(400, "at: a position, 0 or more", "at");
        r = store_->fork(id, fid, std::get<int64_t>(at), durable, &u);
        if (r) return ok(201, info_json(*r, &u));
    } else {
        return error_reply(404, fmt::format("no route for POST /v1/contexts/{}/{}", id, op));
    }
    if (!r) return error_reply(r.error(), store_dir_);
    return ok(200, info_json(*r, &u));
}

ApiReply ContextService::handle(const std::string& method, const std::string& path, const std::string& query,
                                const std::string& body) {
    const std::string base = "/v1/contexts";
    if (path == base || path == base + "/") {
        if (method == "POST") return create(body);
        if (method == "GET") {
            json data = json::array(), refused = json::array();
            for (const ContextInfo& i : store_->list()) data.push_back(info_json(i));
            for (const auto& [file, why] : store_->refused()) refused.push_back({{"file", file}, {"reason", why}});
            return ok(200, {{"object", "list"}, {"data", data}, {"refused", refused}});
        }
        return error_reply(405, fmt::format("{} is not allowed on {}", method, base));
    }
    std::string rest = path.substr(base.size() + 1);
    std::string id = rest, op;
    if (auto slash = rest.find('/'); slash != std::string::npos) {
        id = rest.substr(0, slash);
        op = rest.substr(slash + 1);
    }
    return route_one(method, id, op, query, body);
}

bool ContextService::has_room(uint64_t blocks) const {
    // The free count is a bitmap's popcount; n_available() reads every block's word,
    // so it is asked only when that falls short (as KvCacheManager::reserve does).
    const auto want = static_cast<int64_t>(blocks);
    return alloc_->n_free() >= want || alloc_->n_available() >= want;
}

void ContextService::make_room(uint64_t blocks, const std::string& keep) {
    // Never more than the arena holds: then every idle context would go for nothing.
    blocks = std::min<uint64_t>(blocks, inst_->arena(kContextArena).n_blocks());
    store_->evict_idle(keep, [&] { return has_room(blocks); });
}

std::optional<ApiReply> ContextService::refused_reply(const std::string& id) const {
    for (const auto& [file, why] : store_->refused())
        if (file == id + ".kvlog") {
            ApiError e;
            e.status = 500;
            e.type = "server_error";
            e.code = "context_refused";
            e.message = fmt::format("context '{}' was refused when its log was read at start: {}; its files are kept "
                                    "for inspection (duet kv inspect)",
                                    id, why);
            return ApiReply{500, error_json(e)};
        }
    return std::nullopt;
}

std::variant<std::string, ApiReply> ContextService::export_file(const std::string& id) {
    if (auto refused = refused_reply(id)) return *refused;
    const std::string path = spool_path();
    auto r = store_->export_blob(id, path);
    if (!r) {
        ::unlink(path.c_str());
        return error_reply(r.error(), store_dir_);
    }
    return path;
}

std::string ContextService::spool_path() {
    static std::atomic<uint64_t> n{0};
    // Relaxed: a counter for unique names, nothing ordered by it.
    return fmt::format("{}/{}-{}.kvblob", spool_dir_, ::getpid(), n.fetch_add(1, std::memory_order_relaxed));
}

ApiReply ContextService::import_file(const std::string& query, const std::string& path) {
    struct Unlink {
        const std::string& p;
        ~Unlink() { ::unlink(p.c_str()); }
    } unlink_spool{path};
    std::string id = query_value(query, "id");
    if (id.empty()) id = new_id();
    const std::string durable = query_value(query, "durable");
    if (!durable.empty() && durable != "true" && durable != "false")
        return error_reply(400, "durable: true or false", "durable");
    ContextUsage u;
    auto r = store_->import_blob(id, path, durable != "false", &u);
    if (!r) return error_reply(r.error(), store_dir_);
    return ok(201, info_json(*r, &u));
}

std::variant<ContextKv, ApiReply> ContextService::lease(const std::string& id) {
    auto kv = store_->lease(id);
    if (!kv) return error_reply(kv.error(), store_dir_);
    return std::move(kv).value();
}

void ContextService::release(std::span<const int32_t> blocks) {
    for (int32_t b : blocks) inst_->arena(kContextArena).unref(user_, b);
}

ApiReply ContextService::commit(const std::string& id, size_t context_tokens, std::span<const int32_t> added,
                                std::vector<int32_t> kv_blocks, int64_t kv_valid, bool maybe_done) {
    if (maybe_done) {
        // A completion adopted from a front that died: it may have committed it
        // before it died (and not yet freed the request). Then the context already
        // ends with the added tokens at that length: done, once.
        auto t = store_->tokens(id);
        if (t && t->size() == context_tokens + added.size() &&
            std::equal(added.begin(), added.end(), t->begin() + static_cast<std::ptrdiff_t>(context_tokens))) {
            release(kv_blocks);
            auto info = store_->info(id);
            if (!info) return error_reply(info.error(), store_dir_);
            return ok(200, info_json(*info, nullptr));
        }
    }
    if (!kv_blocks.empty()) {
        ContextUsage u;
        auto r = store_->append_with_kv(id, context_tokens, added, std::move(kv_blocks), kv_valid, &u);
        if (!r && r.error().kind == ErrorKind::Exists)
            return error_reply(409, fmt::format("context '{}' changed during the completion: the completion was not "
                                                "added ({})",
                                                id, r.error().message));
        if (!r) return error_reply(r.error(), store_dir_);
        return ok(200, info_json(*r, &u));
    }
    auto t = store_->tokens(id);
    if (!t) return error_reply(t.error(), store_dir_);
    if (t->size() != context_tokens)
        return error_reply(409, fmt::format("context '{}' changed during the completion ({} tokens, was {}): the "
                                            "completion was not added",
                                            id, t->size(), context_tokens));
    ContextUsage u;
    auto r = store_->append(id, added, &u);
    if (!r) return error_reply(r.error(), store_dir_);
    return ok(200, info_json(*r, &u));
}

}  // namespace duet
