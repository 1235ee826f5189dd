#include "engine/grammar.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <unordered_map>

#include <xgrammar/xgrammar.h>

#include "model/tokenizer.h"
#include "shm/doorbell.h"

// xgrammar's logging, routed here (cmake/xgrammar.cmake builds it with
// XGRAMMAR_LOG_CUSTOMIZE=1): a fatal error is an exception its caller catches; a
// warning says a constraint is dropped or approximated, which check_grammar() turns
// into an error. Warnings are collected per thread while a check runs; any other
// time they are dropped (a compile after a passed check emits none).
namespace {
thread_local std::vector<std::string>* g_warnings = nullptr;
}  // namespace

namespace xgrammar {
[[noreturn]] void LogFatalImpl(const std::string& file, int lineno, const std::string& message) {
    (void)file;
    (void)lineno;
    throw std::runtime_error(message);
}
void LogMessageImpl(const std::string& file, int lineno, int level, const std::string& message) {
    (void)file;
    (void)lineno;
    if (level >= 2 && g_warnings) g_warnings->push_back(message);  // XGRAMMAR_LOG_LEVEL_WARNING
}
}  // namespace xgrammar

namespace duet {

namespace {

// Whitespace between JSON tokens: any, but at most this much in a row, so that a
// sampled model cannot spend its whole budget on blanks where the grammar allows
// them (xgrammar's any_whitespace without a bound).
constexpr int kMaxWhitespace = 16;

// Any JSON object: the schema form, so that it gets the same whitespace bound as a
// schema (xgrammar's built-in JSON grammar has none).
constexpr const char* kAnyObject = R"({"type": "object", "additionalProperties": true})";

xgrammar::Grammar grammar_of(const duet::GrammarSpec& g) {
    switch (g.kind) {
        case GrammarKind::JsonSchema:
            return xgrammar::Grammar::FromJSONSchema(g.source, true, std::nullopt, std::nullopt, true, kMaxWhitespace);
        case GrammarKind::JsonObject:
            return xgrammar::Grammar::FromJSONSchema(kAnyObject, true, std::nullopt, std::nullopt, true,
                                                     kMaxWhitespace);
        case GrammarKind::Ebnf: return xgrammar::Grammar::FromEBNF(g.source, "root");
        case GrammarKind::StructuralTag: {
            auto v = xgrammar::Grammar::FromStructuralTag(g.source);
            if (auto* grammar = std::get_if<xgrammar::Grammar>(&v)) return *grammar;
            std::visit([](const auto& e) { throw std::runtime_error(e.what()); }, std::get<1>(v));
        }
    }
    throw std::runtime_error("unknown grammar kind");
}

}  // namespace

// Whether an EBNF source has "[ max_tokens =" or "[ max_chars =" (a rule's budget
// attribute; blanks allowed around the name). (Not std::regex: GCC 12 warns inside
// it under ASan, and this needs none.)
static bool has_rule_budget(std::string_view src) {
    auto blanks = [&](size_t i) {
        while (i < src.size() && (src[i] == ' ' || src[i] == '\t' || src[i] == '\n' || src[i] == '\r')) ++i;
        return i;
    };
    for (size_t at = src.find('['); at != std::string_view::npos; at = src.find('[', at + 1)) {
        const size_t name = blanks(at + 1);
        for (std::string_view word : {std::string_view("max_tokens"), std::string_view("max_chars")})
            if (src.substr(name, word.size()) == word) {
                const size_t eq = blanks(name + word.size());
                if (eq < src.size() && src[eq] == '=') return true;
            }
    }
    return false;
}

// The 256 single bytes and an end token: a vocabulary small enough to compile any
// grammar against in a check, so that what xgrammar's compiler does (its optimizer
// builds the automata of regular expressions, and warns or fails there) happens
// before a request is admitted, not in a worker after the client got a 200.
static const xgrammar::TokenizerInfo& byte_vocabulary() {
    static const xgrammar::TokenizerInfo info = [] {
        std::vector<std::string> v;
        for (int b = 0; b < 256; ++b) v.emplace_back(1, static_cast<char>(b));
        v.emplace_back();  // the end token
        return xgrammar::TokenizerInfo(v, xgrammar::VocabType::RAW, static_cast<int>(v.size()),
                                       std::vector<int32_t>{256}, false);
    }();
    return info;
}

static Status check_grammar_now(const GrammarSpec& g) {
    // Token and character budgets on rules ("name[max_tokens=N]") are approximate, and
    // their state depends on how the matcher was stepped: not the exact, replayable
    // state a re-drive needs.
    if (g.kind == GrammarKind::Ebnf && has_rule_budget(g.source))
        return make_error("rule budgets (max_tokens, max_chars) are not supported: they are not exact");
    std::vector<std::string> warnings;
    g_warnings = &warnings;
    try {
        xgrammar::GrammarCompiler compiler(byte_vocabulary(), 1, false);
        (void)compiler.CompileGrammar(grammar_of(g));
    } catch (const std::exception& e) {
        g_warnings = nullptr;
        return make_error("{}", e.what());
    }
    g_warnings = nullptr;
    if (!warnings.empty()) return make_error("cannot be enforced exactly: {}", warnings.front());
    return {};
}

// Clients send the same schema again and again: its verdict is kept (256 sources at
// most, all forgotten when full), so the front's thread compiles each once.
Status check_grammar(const GrammarSpec& g) {
    static std::mutex mu;
    static std::unordered_map<std::string, std::string> seen;  // source -> "" (honoured) or why not
    std::string key = std::to_string(static_cast<int>(g.kind)) + ":" + g.source;
    {
        std::lock_guard<std::mutex> lock(mu);
        if (auto it = seen.find(key); it != seen.end()) {
            if (it->second.empty()) return {};
            return make_error("{}", it->second);
        }
    }
    Status st = check_grammar_now(g);
    std::lock_guard<std::mutex> lock(mu);
    if (seen.size() >= 256) seen.clear();
    seen.emplace(std::move(key), st ? std::string() : st.error().message);
    return st;
}

struct GrammarSet::Impl {
    // xgrammar's own cache, bounded: without a bound (its default) a schema per
    // request, each with its enum, would stay for the life of the process; without
    // the cache, rules shared by schemas (JSON strings, numbers) are compiled anew
    // each time (compile p50 12.2 ms against 1.9 ms on the bench corpus).
    static constexpr int64_t kCompilerCacheBytes = 64ll << 20;
    explicit Impl(const Tokenizer& tok, int32_t nv)
        : n_vocab(nv), info(vocab_of(tok, nv)), compiler(info, 1, true, kCompilerCacheBytes) {}

    // The vocabulary as xgrammar takes it: each token's bytes (RAW), control and
    // unknown tokens as "" (never allowed as text), the end-of-generation ids as its
    // stop tokens (allowed once the grammar is complete), ids past the tokenizer's
    // vocabulary (padding of the logits) never allowed.
    static xgrammar::TokenizerInfo vocab_of(const Tokenizer& tok, int32_t nv) {
        std::vector<std::string> v(static_cast<size_t>(tok.n_vocab()));
        for (int32_t i = 0; i < tok.n_vocab(); ++i)
            if (!tok.is_special(i) && !tok.is_eog(i)) v[static_cast<size_t>(i)] = std::string(tok.piece(i));
        return xgrammar::TokenizerInfo(v, xgrammar::VocabType::RAW, nv, tok.eog_ids(), false);
    }

    struct Matcher {
        GrammarSpec spec;
        xgrammar::GrammarMatcher m;
        std::vector<int32_t> fed;  // the tokens it accepted, in order
        uint64_t used = 0;
    };

    static std::string key_of(const GrammarSpec& g) {
        return std::to_string(static_cast<int>(g.kind)) + ":" + g.source;
    }

    // Compiles g (throws what xgrammar throws). One compile at a time in the process,
    // the caller's or the background thread's: the two never contend for xgrammar's
    // caches, and the process never computes on more cores than its own.
    std::shared_ptr<xgrammar::CompiledGrammar> compile(const GrammarSpec& g) {
        std::lock_guard<std::mutex> one(compile_mu);
        switch (g.kind) {
            case GrammarKind::JsonSchema:
                return std::make_shared<xgrammar::CompiledGrammar>(
                    compiler.CompileJSONSchema(g.source, true, std::nullopt, std::nullopt, true, kMaxWhitespace));
            case GrammarKind::JsonObject:
                return std::make_shared<xgrammar::CompiledGrammar>(
                    compiler.CompileJSONSchema(kAnyObject, true, std::nullopt, std::nullopt, true, kMaxWhitespace));
            case GrammarKind::Ebnf:
                return std::make_shared<xgrammar::CompiledGrammar>(compiler.CompileGrammar(g.source, "root"));
            case GrammarKind::StructuralTag:
                return std::make_shared<xgrammar::CompiledGrammar>(compiler.CompileGrammar(grammar_of(g)));
        }
        throw std::runtime_error("unknown grammar kind");
    }

    // The caller's thread: g compiled, from the cache, from a compile ahead (waited
    // for if it runs now), or compiled here.
    std::shared_ptr<xgrammar::CompiledGrammar> compiled(const GrammarSpec& g) {
        const std::string key = key_of(g);
        if (auto it = cache.find(key); it != cache.end()) return it->second;
        const uint64_t t0 = shm::monotonic_ns();
        std::shared_ptr<xgrammar::CompiledGrammar> c;
        {
            std::unique_lock<std::mutex> l(mu);
            if (auto q = std::find_if(queue.begin(), queue.end(), [&](const auto& e) { return e.first == key; });
                q != queue.end())
                queue.erase(q);  // not started: compiled here, now
            if (inflight == key) {
                stats.ahead_waited += 1;
                done_cv.wait(l, [&] { return inflight != key; });
            }
            if (auto r = ready.find(key); r != ready.end()) {
                c = std::move(r->second);
                ready.erase(r);
                stats.ahead_used += 1;
            }
        }
        const auto spent = [&] {
            std::lock_guard<std::mutex> l(mu);
            stats.compile_ns += shm::monotonic_ns() - t0;
        };
        if (!c) {
            {
                std::lock_guard<std::mutex> l(mu);
                stats.compiles += 1;  // tried, failed or not
            }
            try {
                c = compile(g);
            } catch (...) {
                spent();
                throw;
            }
        }
        spent();
        if (cache.size() >= kMaxCached) cache.clear();  // a bound, not a policy: recompiling is correct
        cache.emplace(key, c);
        return c;
    }

    // The background thread: compiles what prefetch() queued, one at a time, into
    // `ready`. At the worker's own priority: a lower one (nice +10 was tried) made the
    // serving thread that waits for it, or for compile_mu, wait on a thread that the
    // other role's threads (lent cores) or its own steps starve.
    void compile_ahead() {
        std::unique_lock<std::mutex> l(mu);
        for (;;) {
            work_cv.wait(l, [&] { return stop || !queue.empty(); });
            if (stop) return;
            auto [key, g] = std::move(queue.front());
            queue.pop_front();
            inflight = key;
            l.unlock();
            const uint64_t t0 = shm::monotonic_ns();
            std::shared_ptr<xgrammar::CompiledGrammar> c;
            try {
                c = compile(g);
            } catch (...) {
                // allowed() compiles it again and reports the error where it can.
            }
            const uint64_t ns = shm::monotonic_ns() - t0;
            l.lock();
            if (c) {
                // A bound (grammars of requests that never came: cancelled, failed,
                // taken by another worker): the oldest go first.
                while (ready.size() >= kMaxCached && !ready_order.empty()) {
                    ready.erase(ready_order.front());
                    ready_order.pop_front();
                }
                if (ready_order.size() >= 4 * kMaxCached)  // keys taken by allowed() meanwhile
                    std::erase_if(ready_order, [&](const std::string& k) { return !ready.contains(k); });
                ready.emplace(key, std::move(c));
                ready_order.push_back(key);
                stats.ahead += 1;
                stats.ahead_ns += ns;
            }
            inflight.clear();
            done_cv.notify_all();
        }
    }

    static constexpr size_t kMaxCached = 64;
    // Above any batch a worker holds (decode: 2 x --max-batch of 256 at most, parked included).
    static constexpr size_t kMaxMatchers = 1024;
    int32_t n_vocab;
    xgrammar::TokenizerInfo info;
    xgrammar::GrammarCompiler compiler;
    std::unordered_map<std::string, std::shared_ptr<xgrammar::CompiledGrammar>> cache;  // the caller's thread
    std::unordered_map<uint64_t, std::unique_ptr<Matcher>> matchers;
    std::vector<int32_t> bits;  // the last mask (xgrammar's int32 words)
    uint64_t tick = 0;
    std::mutex compile_mu;  // one compile at a time (compile())
    // Compiling ahead. mu guards what follows and the compile counters of stats.
    mutable std::mutex mu;
    std::condition_variable work_cv;  // queued work, or stop
    std::condition_variable done_cv;  // a compile ahead ended
    std::deque<std::pair<std::string, GrammarSpec>> queue;
    std::string inflight;  // the key being compiled ahead ("": none)
    std::unordered_map<std::string, std::shared_ptr<xgrammar::CompiledGrammar>> ready;
    std::deque<std::string> ready_order;  // ready's keys, oldest first (some may be gone)
    bool stop = false;
    bool no_thread = false;  // the thread could not be started: no compiling ahead
    std::thread thread;      // started by the first prefetch()
    // The caller's thread writes masks, mask_ns, fed and rolled_back without mu (stats()
    // is called on that thread); the rest under mu.
    Stats stats;
};

GrammarSet::GrammarSet(const Tokenizer& tok, int32_t n_vocab) : impl_(std::make_unique<Impl>(tok, n_vocab)) {
    impl_->bits.assign(static_cast<size_t>(xgrammar::GetBitmaskSize(n_vocab)), 0);
}

GrammarSet::~GrammarSet() {
    Impl& s = *impl_;
    {
        std::lock_guard<std::mutex> l(s.mu);
        s.stop = true;
    }
    s.work_cv.notify_all();
    if (s.thread.joinable()) s.thread.join();  // after the compile it may be in
}

int32_t GrammarSet::n_vocab() const { return impl_->n_vocab; }
size_t GrammarSet::n_matchers() const { return impl_->matchers.size(); }
GrammarSet::Stats GrammarSet::stats() const {
    std::lock_guard<std::mutex> l(impl_->mu);
    return impl_->stats;
}
void GrammarSet::forget(uint64_t key) { impl_->matchers.erase(key); }

void GrammarSet::prefetch(const GrammarSpec& g) {
    Impl& s = *impl_;
    std::string key = Impl::key_of(g);
    if (s.cache.contains(key)) return;
    {
        std::lock_guard<std::mutex> l(s.mu);
        if (s.no_thread || s.inflight == key || s.ready.contains(key) ||
            std::any_of(s.queue.begin(), s.queue.end(), [&](const auto& e) { return e.first == key; }))
            return;
        // A bound on work queued ahead: past it, nothing more is queued (those queued
        // first are nearest to being needed; the rest are compiled when needed).
        if (s.queue.size() >= Impl::kMaxCached) return;
        s.queue.emplace_back(std::move(key), g);
        if (!s.thread.joinable()) {
            try {
                s.thread = std::thread([&s] { s.compile_ahead(); });
            } catch (const std::system_error&) {  // no thread to be had (a limit): compiled when needed
                s.queue.clear();
                s.no_thread = true;
                return;
            }
        }
    }
    s.work_cv.notify_one();
}

void GrammarSet::wait_prefetched() {
    Impl& s = *impl_;
    std::unique_lock<std::mutex> l(s.mu);
    while (!s.queue.empty() || !s.inflight.empty()) s.done_cv.wait_for(l, std::chrono::milliseconds(5));
}

Result<std::span<const uint32_t>> GrammarSet::allowed(uint64_t key, const GrammarSpec& g,
                                                      std::span<const int32_t> output) {
    Impl& s = *impl_;
    try {
        auto it = s.matchers.find(key);
        if (it != s.matchers.end() && !(it->second->spec == g)) {
            s.matchers.erase(it);
            it = s.matchers.end();
        }
        if (it == s.matchers.end()) {
            // A bound on matchers kept for requests that left without being forgotten:
            // the least recently used go (rebuilt from their output if they come back).
            if (s.matchers.size() >= Impl::kMaxMatchers) {
                auto oldest = s.matchers.begin();
                for (auto i = s.matchers.begin(); i != s.matchers.end(); ++i)
                    if (i->second->used < oldest->second->used) oldest = i;
                s.matchers.erase(oldest);
            }
            auto c = s.compiled(g);
            auto m = std::make_unique<Impl::Matcher>(Impl::Matcher{g, xgrammar::GrammarMatcher(*c), {}, 0});
            it = s.matchers.emplace(key, std::move(m)).first;
        }
        Impl::Matcher& m = *it->second;
        m.used = ++s.tick;
        // Sync with the output: back to the common prefix, then feed the rest.
        size_t common = 0;
        while (common < m.fed.size() && common < output.size() && m.fed[common] == output[common]) ++common;
        if (common < m.fed.size()) {
            const auto back = static_cast<int>(m.fed.size() - common);
            m.m.Rollback(back);
            m.fed.resize(common);
            s.stats.rolled_back += static_cast<uint64_t>(back);
        }
        for (size_t i = common; i < output.size(); ++i) {
            if (!m.m.AcceptToken(output[i])) {
                const int32_t bad = output[i];
                s.matchers.erase(it);
                return make_error("output token {} (position {}) is not allowed by the request's grammar", bad, i);
            }
            m.fed.push_back(output[i]);
            ++s.stats.fed;
        }
        if (m.m.IsTerminated()) {
            // Complete, its end token fed (a request re-driven after its last token was
            // written): nothing may follow.
            std::fill(s.bits.begin(), s.bits.end(), 0);
            return std::span<const uint32_t>(reinterpret_cast<const uint32_t*>(s.bits.data()), s.bits.size());
        }
        int64_t shape[1] = {static_cast<int64_t>(s.bits.size())};
        DLTensor t{};
        t.data = s.bits.data();
        t.device = DLDevice{kDLCPU, 0};
        t.ndim = 1;
        t.dtype = xgrammar::GetBitmaskDLType();
        t.shape = shape;
        t.strides = nullptr;
        t.byte_offset = 0;
        const uint64_t t0 = shm::monotonic_ns();
        m.m.FillNextTokenBitmask(&t);
        s.stats.masks += 1;
        s.stats.mask_ns += shm::monotonic_ns() - t0;
    } catch (const std::exception& e) {
        impl_->matchers.erase(key);
        return make_error("grammar: {}", e.what());
    }
    return std::span<const uint32_t>(reinterpret_cast<const uint32_t*>(s.bits.data()), s.bits.size());
}

}  // namespace duet
