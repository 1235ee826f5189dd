// Tokenizer implementation. Reference: llama.cpp src/llama-vocab.cpp and
// src/unicode.cpp (load(), tokenizer_st_partition(), llm_tokenizer_bpe_session,
// llm_tokenizer_spm_session, token_to_piece(), detokenize()). Our own code; the
// comments name each place where the behaviour is chosen to match it.
#include "model/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <queue>

namespace duet {

namespace {

// ---------------------------------------------------------------------------
// UTF-8 and the GPT-2 byte map

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the other 68
// to U+0100 + n in ascending byte order (space -> U+0120, '\n' -> U+010A).
constexpr std::array<uint16_t, 256> make_byte_to_cpt() {
    std::array<uint16_t, 256> m{};
    int n = 0;
    for (int b = 0; b < 256; ++b) {
        bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        m[b] = static_cast<uint16_t>(printable ? b : 256 + n++);
    }
    return m;
}
constexpr std::array<uint16_t, 256> kByteToCpt = make_byte_to_cpt();

// Inverse of kByteToCpt over U+0000..U+0143; -1 where no byte maps there.
constexpr std::array<int16_t, 324> make_cpt_to_byte() {
    std::array<int16_t, 324> m{};
    for (auto& v : m) v = -1;
    for (int b = 0; b < 256; ++b) m[kByteToCpt[b]] = static_cast<int16_t>(b);
    return m;
}
constexpr std::array<int16_t, 324> kCptToByte = make_cpt_to_byte();

void append_utf8(std::string& out, uint32_t cpt) {
    if (cpt < 0x80) {
        out.push_back(static_cast<char>(cpt));
    } else if (cpt < 0x800) {
        out.push_back(static_cast<char>(0xC0 | (cpt >> 6)));
        out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
    } else if (cpt < 0x10000) {
        out.push_back(static_cast<char>(0xE0 | (cpt >> 12)));
        out.push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
    } else {
        out.push_back(static_cast<char>(0xF0 | (cpt >> 18)));
        out.push_back(static_cast<char>(0x80 | ((cpt >> 12) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
    }
}

constexpr uint32_t kReplacement = 0xFFFD;

// Length of the UTF-8 sequence a lead byte announces, as llama.cpp's
// unicode_len_utf8 counts it (continuation and invalid bytes count as 1).
size_t utf8_len_lead(uint8_t b) {
    static constexpr uint8_t kLookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return kLookup[b >> 4];
}

// Strict validity (what PCRE2 accepts in UTF mode): shortest form, no
// surrogates, nothing above U+10FFFF.
bool utf8_valid(std::string_view s) {
    const auto* p = reinterpret_cast<const uint8_t*>(s.data());
    size_t n = s.size(), i = 0;
    while (i < n) {
        uint8_t b = p[i];
        if (b < 0x80) { ++i; continue; }
        size_t len;
        uint8_t lo = 0x80, hi = 0xBF;
        if (b >= 0xC2 && b <= 0xDF) len = 2;
        else if (b == 0xE0) { len = 3; lo = 0xA0; }
        else if (b >= 0xE1 && b <= 0xEC) len = 3;
        else if (b == 0xED) { len = 3; hi = 0x9F; }
        else if (b >= 0xEE && b <= 0xEF) len = 3;
        else if (b == 0xF0) { len = 4; lo = 0x90; }
        else if (b >= 0xF1 && b <= 0xF3) len = 4;
        else if (b == 0xF4) { len = 4; hi = 0x8F; }
        else return false;
        if (i + len > n) return false;
        if (p[i + 1] < lo || p[i + 1] > hi) return false;
        for (size_t k = 2; k < len; ++k)
            if ((p[i + k] & 0xC0) != 0x80) return false;
        i += len;
    }
    return true;
}

// Rewrites text the way llama.cpp's unicode_cpts_from_utf8 reads it, so that the
// BPE path sees the same code points: a byte that does not start a well-formed
// sequence becomes U+FFFD and decoding resumes at the next byte; over-long forms
// are accepted and re-encoded in shortest form. Two deliberate differences:
// surrogates and values above U+10FFFF (which llama.cpp passes through or throws
// on) also become U+FFFD, because PCRE2 only takes valid UTF-8.
std::string utf8_sanitize(std::string_view s) {
    std::string out;
    out.reserve(s.size() + 8);
    const auto* p = reinterpret_cast<const uint8_t*>(s.data());
    size_t n = s.size(), i = 0;
    while (i < n) {
        uint8_t b = p[i];
        uint32_t cpt = kReplacement;
        size_t len = 1;
        auto cont = [&](size_t k) { return i + k < n && (p[i + k] & 0xC0) == 0x80; };
        if (b < 0x80) {
            cpt = b;
        } else if ((b & 0x40) == 0) {
            // stray continuation byte
        } else if ((b & 0x20) == 0) {
            if (cont(1)) { cpt = ((b & 0x1Fu) << 6) | (p[i + 1] & 0x3Fu); len = 2; }
        } else if ((b & 0x10) == 0) {
            if (cont(1) && cont(2)) {
                cpt = ((b & 0x0Fu) << 12) | ((p[i + 1] & 0x3Fu) << 6) | (p[i + 2] & 0x3Fu);
                len = 3;
            }
        } else if ((b & 0x08) == 0) {
            if (cont(1) && cont(2) && cont(3)) {
                cpt = ((b & 0x07u) << 18) | ((p[i + 1] & 0x3Fu) << 12) | ((p[i + 2] & 0x3Fu) << 6) |
                      (p[i + 3] & 0x3Fu);
                len = 4;
            }
        }
        if ((cpt >= 0xD800 && cpt <= 0xDFFF) || cpt > 0x10FFFF) cpt = kReplacement;
        append_utf8(out, cpt);
        i += len;
    }
    return out;
}

// Decodes one code point of a vocabulary string (which is valid UTF-8).
uint32_t next_cpt(std::string_view s, size_t& i) {
    auto b = static_cast<uint8_t>(s[i]);
    size_t len = utf8_len_lead(b);
    if (i + len > s.size()) len = 1;
    uint32_t cpt;
    switch (len) {
        case 2: cpt = b & 0x1Fu; break;
        case 3: cpt = b & 0x0Fu; break;
        case 4: cpt = b & 0x07u; break;
        default: ++i; return b;
    }
    for (size_t k = 1; k < len; ++k) cpt = (cpt << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3Fu);
    i += len;
    return cpt;
}

bool parse_byte_token(std::string_view text, uint8_t& byte) {
    // "<0xNN>"
    if (text.size() != 6 || text.substr(0, 3) != "<0x" || text[5] != '>') return false;
    auto hex = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        return -1;
    };
    int h = hex(text[3]), l = hex(text[4]);
    if (h < 0 || l < 0) return false;
    byte = static_cast<uint8_t>(h * 16 + l);
    return true;
}

constexpr std::string_view kSpmSpace = "\xE2\x96\x81";  // U+2581

// ---------------------------------------------------------------------------
// Pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe lists them.

// GPT-2's. llama.cpp runs it with a hand-written matcher that adds a final
// `|\s+`; without it an unmatched single whitespace becomes a piece of its own
// anyway (see split_regex), so the results are the same.
constexpr const char* kRegexGpt2 =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
// Llama-3's, with llama.cpp's case-insensitive contractions spelled out.
constexpr const char* kRegexLlama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// Qwen2's: Llama-3's with single digits.
constexpr const char* kRegexQwen2 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<const char*> regexes_for(Tokenizer::Pre pre) {
    switch (pre) {
        case Tokenizer::Pre::Smollm: return {R"(\p{N})", kRegexGpt2};
        case Tokenizer::Pre::Gpt2: return {kRegexGpt2};
        case Tokenizer::Pre::Llama3: return {kRegexLlama3};
        case Tokenizer::Pre::Qwen2: return {kRegexQwen2};
        case Tokenizer::Pre::Default:
            return {R"([\p{P}\$\+<=>\^~\|]+)", kRegexGpt2, R"(\p{N}+)", R"([0-9][0-9][0-9])"};
    }
    return {};
}

// `\s` as llama.cpp means it: the Unicode White_Space property (its
// unicode_set_whitespace). PCRE2's UCP `\s` also matches U+180E (it is in
// PCRE2's `\h`), so every `\s` / `\S` is rewritten to this explicit class.
constexpr std::string_view kWhiteSpaceItems =
    R"(\x{09}-\x{0D}\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

std::string expand_whitespace(std::string_view pat) {
    std::string out;
    bool in_class = false;
    for (size_t i = 0; i < pat.size(); ++i) {
        char c = pat[i];
        if (c == '\\' && i + 1 < pat.size()) {
            char e = pat[i + 1];
            ++i;
            if (e == 's') {
                if (in_class) out.append(kWhiteSpaceItems);
                else out.append("[").append(kWhiteSpaceItems).append("]");
            } else if (e == 'S' && !in_class) {
                out.append("[^").append(kWhiteSpaceItems).append("]");
            } else {
                out.push_back('\\');
                out.push_back(e);
            }
            continue;
        }
        if (c == '[' && !in_class) in_class = true;
        else if (c == ']' && in_class) in_class = false;
        out.push_back(c);
    }
    return out;
}

// A mergeable adjacent pair of BPE symbols.
struct Candidate {
    int32_t rank;
    int32_t left, right;
    int32_t left_id, right_id;
    int32_t result;
};
struct CandidateLater {
    // The heap keeps the "largest" on top: make that the lowest rank, then the
    // leftmost pair (llama.cpp's llm_bigram_bpe::comparator).
    bool operator()(const Candidate& a, const Candidate& b) const {
        return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    }
};

struct SpmBigram {
    float score;
    int32_t left, right;
    size_t size;
};
struct SpmBigramLower {
    // Highest score first, then leftmost (llama.cpp's llm_bigram_spm::comparator).
    bool operator()(const SpmBigram& a, const SpmBigram& b) const {
        return a.score < b.score || (a.score == b.score && a.left > b.left);
    }
};

// Scratch space for one encode() call, reused across its words so that the hot
// loop does not allocate.
struct BpeScratch {
    std::vector<int32_t> id, prev, next;
    std::vector<Candidate> heap;
    std::string encoded;
};

const char* const kEogTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
    "<end_of_utterance>",
};
const char* const kEotTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<end_of_utterance>",
};
const char* const kFimPadTexts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"};
const char* const kFimRepTexts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"};
const char* const kFimSepTexts[] = {"<|file_sep|>"};

template <size_t N>
bool text_in(std::string_view t, const char* const (&list)[N]) {
    for (const char* s : list)
        if (t == s) return true;
    return false;
}

}  // namespace

// ---------------------------------------------------------------------------

struct Tokenizer::Regex {
    pcre2_code* code = nullptr;
    ~Regex() { pcre2_code_free(code); }
};

Tokenizer::Tokenizer() { std::fill(std::begin(byte_token_), std::end(byte_token_), kNone); }
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_gguf(const GgufFile& f) {
    std::unique_ptr<Tokenizer> t(new Tokenizer());

    auto model = f.get_string("tokenizer.ggml.model");
    if (!model) return model.error();
    if (*model == "gpt2") {
        t->model_ = Model::Bpe;
    } else if (*model == "llama") {
        t->model_ = Model::Spm;
    } else {
        return make_error("tokenizer.ggml.model '{}' is not supported; duet supports 'gpt2' "
                          "(byte-level BPE) and 'llama' (SentencePiece BPE)", *model);
    }

    if (t->model_ == Model::Bpe) {
        // Pre-tokenizer names and their flags as llama.cpp's load() sets them.
        const GgufValue* pv = f.find("tokenizer.ggml.pre");
        std::string_view pre = pv && pv->type == GgufType::STRING ? pv->s : std::string_view();
        t->clean_spaces_ = true;
        if (pre.empty()) {
            spdlog::warn("tokenizer.ggml.pre is missing: using the 'default' pre-tokenizer; "
                         "re-convert the model for exact tokenization");
            t->pre_ = Pre::Default;
        } else if (pre == "default") {
            t->pre_ = Pre::Default;
        } else if (pre == "gpt-2" || pre == "gpt2") {
            t->pre_ = Pre::Gpt2;
        } else if (pre == "smollm") {
            t->pre_ = Pre::Smollm;
            t->clean_spaces_ = false;
        } else if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") {
            t->pre_ = Pre::Llama3;
            t->ignore_merges_ = true;
            t->add_bos_ = true;
        } else if (pre == "qwen2" || pre == "deepseek-r1-qwen") {
            t->pre_ = Pre::Qwen2;
            t->clean_spaces_ = false;
        } else {
            return make_error("tokenizer.ggml.pre '{}' is not supported; duet supports 'default', "
                              "'gpt-2' (or 'gpt2'), 'smollm', 'llama-bpe' (or 'llama3', 'llama-v3') "
                              "and 'qwen2' (or 'deepseek-r1-qwen')", pre);
        }
    } else {
        t->add_space_prefix_ = true;
        t->add_bos_ = true;
        t->bos_ = 1;
        t->eos_ = 2;
        t->unk_ = 0;
    }

    // Vocabulary.
    const GgufValue* tv = f.find("tokenizer.ggml.tokens");
    if (!tv || tv->type != GgufType::ARRAY || tv->elem_type != GgufType::STRING)
        return make_error("tokenizer.ggml.tokens is missing or not an array of strings; "
                          "the model file has no vocabulary");
    const size_t n = tv->strs.size();
    if (n == 0) return make_error("tokenizer.ggml.tokens is empty");
    if (n > static_cast<size_t>(INT32_MAX)) return make_error("tokenizer.ggml.tokens has {} entries", n);

    const GgufValue* types = f.find("tokenizer.ggml.token_type");
    if (types) {
        if (types->type != GgufType::ARRAY || !(types->elem_type == GgufType::I32 || types->elem_type == GgufType::U32))
            return make_error("tokenizer.ggml.token_type should be an array of int32");
        if (types->count < n)
            return make_error("tokenizer.ggml.token_type has {} entries for {} tokens", types->count, n);
    }
    const GgufValue* scores = f.find("tokenizer.ggml.scores");
    if (scores) {
        if (scores->type != GgufType::ARRAY ||
            !(scores->elem_type == GgufType::F32 || scores->elem_type == GgufType::I32))
            return make_error("tokenizer.ggml.scores should be an array of float32");
        if (scores->count < n)
            return make_error("tokenizer.ggml.scores has {} entries for {} tokens", scores->count, n);
    }

    t->texts_.resize(n);
    t->types_.resize(n, TokenType::Normal);
    t->scores_.resize(n, 0.0f);
    t->text_to_id_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        std::string text(tv->strs[i]);
        if (text.empty()) text = fmt::format("[EMPTY_{}]", i);  // as llama.cpp
        auto [it, fresh] = t->text_to_id_.emplace(text, static_cast<int32_t>(i));
        if (!fresh)
            return make_error("duplicate token in vocabulary: '{}' has ids {} and {}", text, it->second, i);
        t->texts_[i] = std::move(text);
        if (types) {
            int64_t ty = types->elem_int(i);
            t->types_[i] = (ty >= 0 && ty <= 6) ? static_cast<TokenType>(ty) : TokenType::Undefined;
        }
        if (scores) {
            t->scores_[i] = scores->elem_type == GgufType::F32 ? static_cast<float>(scores->elem_float(i))
                                                               : static_cast<float>(scores->elem_int(i));
        }
    }

    // Special ids: a key present with an id outside the vocabulary is ignored
    // and the default kept, as llama.cpp does.
    auto read_id = [&](const char* key, int32_t& id) -> Status {
        const GgufValue* v = f.find(key);
        if (!v) return {};
        if (!v->is_int()) return make_error("metadata key '{}' should be an integer token id", key);
        if (v->i >= 0 && v->i < static_cast<int64_t>(n)) id = static_cast<int32_t>(v->i);
        else spdlog::warn("{} = {} is outside the vocabulary of {} tokens; ignored", key, v->i, n);
        return {};
    };
    int32_t fim_pad = kNone, fim_rep = kNone, fim_sep = kNone;
    for (auto [key, id] : {std::pair<const char*, int32_t*>{"tokenizer.ggml.bos_token_id", &t->bos_},
                           {"tokenizer.ggml.eos_token_id", &t->eos_},
                           {"tokenizer.ggml.eot_token_id", &t->eot_},
                           {"tokenizer.ggml.eom_token_id", &t->eom_},
                           {"tokenizer.ggml.unknown_token_id", &t->unk_},
                           {"tokenizer.ggml.fim_pad_token_id", &fim_pad},
                           {"tokenizer.ggml.fim_rep_token_id", &fim_rep},
                           {"tokenizer.ggml.fim_sep_token_id", &fim_sep}}) {
        if (Status s = read_id(key, *id); !s) return s.error();
    }
    auto add_bos = f.get_bool_or("tokenizer.ggml.add_bos_token", t->add_bos_);
    if (!add_bos) return add_bos.error();
    t->add_bos_ = *add_bos;
    auto add_eos = f.get_bool_or("tokenizer.ggml.add_eos_token", t->add_eos_);
    if (!add_eos) return add_eos.error();
    t->add_eos_ = *add_eos;
    auto asp = f.get_bool_or("tokenizer.ggml.add_space_prefix", t->add_space_prefix_);
    if (!asp) return asp.error();
    t->add_space_prefix_ = *asp;
    if (t->add_bos_ && t->bos_ == kNone)
        return make_error("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is not set");
    if (t->add_eos_ && t->eos_ == kNone)
        return make_error("tokenizer.ggml.add_eos_token is true but tokenizer.ggml.eos_token_id is not set");

    // End-of-generation tokens, found by text as llama.cpp's load() does. A token
    // found this way that is not typed control is made control, so that it is
    // neither produced from plain text nor printed by decode(skip_special).
    t->eog_.assign(n, 0);
    auto make_control = [&](size_t i) {
        if (t->types_[i] != TokenType::Control) t->types_[i] = TokenType::Control;
    };
    bool has_return = false, has_call = false;
    int32_t end_id = kNone;
    for (size_t i = 0; i < n; ++i) {
        std::string_view text = t->texts_[i];
        if (t->eot_ == kNone && text_in(text, kEotTexts)) { t->eot_ = static_cast<int32_t>(i); make_control(i); }
        if (t->eom_ == kNone && text == "<|eom_id|>") { t->eom_ = static_cast<int32_t>(i); make_control(i); }
        if (fim_pad == kNone && text_in(text, kFimPadTexts)) { fim_pad = static_cast<int32_t>(i); make_control(i); }
        if (fim_rep == kNone && text_in(text, kFimRepTexts)) { fim_rep = static_cast<int32_t>(i); make_control(i); }
        if (fim_sep == kNone && text_in(text, kFimSepTexts)) { fim_sep = static_cast<int32_t>(i); make_control(i); }
        if (text_in(text, kEogTexts)) {
            t->eog_[i] = 1;
            make_control(i);
            has_return |= text == "<|return|>";
            has_call |= text == "<|call|>";
            if (text == "<|end|>") end_id = static_cast<int32_t>(i);
        }
    }
    for (int32_t id : {fim_pad, fim_rep, fim_sep, t->eos_, t->eot_, t->eom_})
        if (id != kNone) t->eog_[id] = 1;
    // gpt-oss (harmony): <|end|> ends a message, not the generation.
    if (has_return && has_call && end_id != kNone) {
        t->eog_[end_id] = 0;
        t->types_[end_id] = TokenType::UserDefined;
    }

    Status s = t->model_ == Model::Bpe ? t->init_bpe(f) : t->init_spm();
    if (!s) return s.error();
    t->finish_specials();
    return t;
}

Status Tokenizer::init_bpe(const GgufFile& f) {
    const size_t n = texts_.size();
    for (int b = 0; b < 256; ++b) {
        std::string s;
        append_utf8(s, kByteToCpt[b]);
        auto it = text_to_id_.find(s);
        if (it != text_to_id_.end()) byte_token_[b] = it->second;
    }

    const GgufValue* mv = f.find("tokenizer.ggml.merges");
    if (!mv || mv->type != GgufType::ARRAY || mv->elem_type != GgufType::STRING)
        return make_error("tokenizer.ggml.merges is missing or not an array of strings; "
                          "a 'gpt2' tokenizer needs its BPE merges");
    // Merges are kept by token id. A merge whose halves or result are not in the
    // vocabulary can never produce a token, so it is dropped.
    merges_.reserve(mv->strs.size());
    size_t dropped = 0;
    std::string joined;
    for (size_t r = 0; r < mv->strs.size(); ++r) {
        std::string_view m = mv->strs[r];
        size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
        if (sp == std::string_view::npos) { ++dropped; continue; }
        std::string_view a = m.substr(0, sp), b = m.substr(sp + 1);
        auto ia = text_to_id_.find(std::string(a));
        auto ib = text_to_id_.find(std::string(b));
        joined.assign(a).append(b);
        auto ij = text_to_id_.find(joined);
        if (ia == text_to_id_.end() || ib == text_to_id_.end() || ij == text_to_id_.end()) { ++dropped; continue; }
        uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) |
                       static_cast<uint32_t>(ib->second);
        merges_.emplace(key, Merge{static_cast<int32_t>(r), ij->second});  // first rank wins
    }
    if (dropped) spdlog::debug("tokenizer: {} BPE merges name tokens outside the vocabulary", dropped);

    for (const char* pat : regexes_for(pre_)) {
        std::string p = expand_whitespace(pat);
        int err = 0;
        PCRE2_SIZE off = 0;
        auto r = std::make_unique<Regex>();
        r->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), PCRE2_UTF | PCRE2_UCP, &err,
                                &off, nullptr);
        if (!r->code) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(err, msg, sizeof msg);
            return make_error("pre-tokenizer regex '{}' does not compile at offset {}: {}", pat, off,
                              reinterpret_cast<const char*>(msg));
        }
        // Without JIT the interpreter is used: slower, same result.
        pcre2_jit_compile(r->code, PCRE2_JIT_COMPLETE);
        regexes_.push_back(std::move(r));
    }

    // Pieces: the byte map undone for normal tokens.
    pieces_.resize(n);
    for (size_t i = 0; i < n; ++i) {
        const std::string& text = texts_[i];
        uint8_t byte;
        switch (types_[i]) {
            case TokenType::Normal: {
                std::string out;
                for (size_t k = 0; k < text.size();) {
                    uint32_t cpt = next_cpt(text, k);
                    if (cpt < kCptToByte.size() && kCptToByte[cpt] >= 0) out.push_back(static_cast<char>(kCptToByte[cpt]));
                    else append_utf8(out, cpt);  // not a byte-map character: kept as is
                }
                pieces_[i] = std::move(out);
                break;
            }
            case TokenType::Byte:
                pieces_[i] = parse_byte_token(text, byte) ? std::string(1, static_cast<char>(byte)) : text;
                break;
            case TokenType::Control:
            case TokenType::Unknown:
            case TokenType::UserDefined:
                pieces_[i] = text;
                break;
            case TokenType::Unused:
            case TokenType::Undefined:
                break;
        }
    }
    return {};
}

Status Tokenizer::init_spm() {
    const size_t n = texts_.size();
    // Byte fallback tokens: <0xNN>, else the byte itself as a token (llama.cpp's
    // byte_to_token), else unknown.
    for (int b = 0; b < 256; ++b) {
        auto it = text_to_id_.find(fmt::format("<0x{:02X}>", b));
        if (it == text_to_id_.end()) it = text_to_id_.find(std::string(1, static_cast<char>(b)));
        byte_token_[b] = it != text_to_id_.end() ? it->second : unk_;
    }
    pieces_.resize(n);
    for (size_t i = 0; i < n; ++i) {
        const std::string& text = texts_[i];
        uint8_t byte;
        switch (types_[i]) {
            case TokenType::Normal: {
                std::string out;
                for (size_t k = 0; k < text.size();) {
                    if (text.compare(k, kSpmSpace.size(), kSpmSpace) == 0) { out.push_back(' '); k += kSpmSpace.size(); }
                    else out.push_back(text[k++]);
                }
                pieces_[i] = std::move(out);
                break;
            }
            case TokenType::Byte:
                pieces_[i] = parse_byte_token(text, byte) ? std::string(1, static_cast<char>(byte)) : text;
                break;
            case TokenType::Control:
            case TokenType::Unknown:
            case TokenType::UserDefined:
                pieces_[i] = text;
                break;
            case TokenType::Unused:
            case TokenType::Undefined:
                break;
        }
    }
    return {};
}

void Tokenizer::finish_specials() {
    for (size_t i = 0; i < texts_.size(); ++i) {
        TokenType ty = types_[i];
        if (ty == TokenType::Control || ty == TokenType::UserDefined || ty == TokenType::Unknown)
            specials_.push_back(static_cast<int32_t>(i));
    }
    // Longest text first. llama.cpp's std::sort leaves equal lengths in no
    // particular order; two different texts of one length cannot both match at
    // one place, so only overlapping matches could tell the difference.
    std::stable_sort(specials_.begin(), specials_.end(),
                     [&](int32_t a, int32_t b) { return texts_[a].size() > texts_[b].size(); });
}

// ---------------------------------------------------------------------------
// Encoding

std::vector<Tokenizer::Fragment> Tokenizer::partition(std::string_view text, bool parse_special) const {
    std::vector<Fragment> frags;
    if (text.empty()) return frags;
    frags.push_back({kNone, text});
    std::vector<Fragment> next;
    // As llama.cpp's tokenizer_st_partition: each special text in turn, longest
    // first, splits every raw fragment at each of its occurrences. Without
    // parse_special only user-defined tokens split (as HF tokenizers does).
    for (int32_t id : specials_) {
        TokenType ty = types_[id];
        if (!parse_special && (ty == TokenType::Control || ty == TokenType::Unknown)) continue;
        const std::string& st = texts_[id];
        bool any = false;
        for (const Fragment& fr : frags) {
            if (fr.token != kNone || fr.text.find(st) == std::string_view::npos) continue;
            any = true;
            break;
        }
        if (!any) continue;
        next.clear();
        for (const Fragment& fr : frags) {
            if (fr.token != kNone) { next.push_back(fr); continue; }
            std::string_view rest = fr.text;
            for (size_t at; (at = rest.find(st)) != std::string_view::npos;) {
                if (at > 0) next.push_back({kNone, rest.substr(0, at)});
                next.push_back({id, {}});
                rest.remove_prefix(at + st.size());
            }
            if (!rest.empty()) next.push_back({kNone, rest});
        }
        frags.swap(next);
    }
    return frags;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 4);
    if (add_special && add_bos_) out.push_back(bos_);
    // SentencePiece: a space is prefixed to the first raw fragment and to every
    // raw fragment that follows a special token (llama.cpp's is_prev_special).
    bool prev_special = true;
    for (const Fragment& fr : partition(text, parse_special)) {
        if (fr.token != kNone) {
            out.push_back(fr.token);
            prev_special = true;
            continue;
        }
        if (model_ == Model::Bpe) {
            encode_bpe(fr.text, out);
        } else {
            if (add_space_prefix_ && prev_special) {
                std::string with_space;
                with_space.reserve(fr.text.size() + 1);
                with_space.push_back(' ');
                with_space.append(fr.text);
                encode_spm(with_space, out);
            } else {
                encode_spm(fr.text, out);
            }
            prev_special = false;
        }
    }
    if (add_special && add_eos_) out.push_back(eos_);
    return out;
}

namespace {

// Appends to `spans` the pieces of text[begin, end) that `re` cuts: each match,
// and each stretch between matches (kept as a piece of its own, as llama.cpp's
// unicode_regex_split does). The subject is the span alone, so look-ahead does
// not see past it.
void split_regex(pcre2_code* re, pcre2_match_data* md, std::string_view text, size_t begin, size_t end,
                 std::vector<std::pair<size_t, size_t>>& spans) {
    auto subject = reinterpret_cast<PCRE2_SPTR>(text.data() + begin);
    size_t len = end - begin;
    size_t pos = 0, gap = 0;
    uint32_t opts = PCRE2_NO_UTF_CHECK;  // the text was validated once
    while (pos < len) {
        int rc = pcre2_match(re, subject, len, pos, opts, md, nullptr);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            if (!(opts & PCRE2_NO_JIT)) {  // e.g. JIT stack exhausted: retry interpreted
                opts |= PCRE2_NO_JIT;
                continue;
            }
            break;  // cannot happen for these patterns; the rest stays one piece
        }
        PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) {  // an empty match (none of our patterns can give one)
            pos = ms + utf8_len_lead(static_cast<uint8_t>(subject[ms]));
            continue;
        }
        if (ms > gap) spans.emplace_back(begin + gap, begin + ms);
        spans.emplace_back(begin + ms, begin + me);
        pos = gap = me;
    }
    if (gap < len) spans.emplace_back(begin + gap, end);
}

}  // namespace

void Tokenizer::encode_bpe(std::string_view raw, std::vector<int32_t>& out) const {
    std::string sanitized;
    std::string_view text = raw;
    if (!utf8_valid(raw)) {
        sanitized = utf8_sanitize(raw);
        text = sanitized;
    }
    std::vector<std::pair<size_t, size_t>> spans{{0, text.size()}}, next;
    pcre2_match_data* md = pcre2_match_data_create(4, nullptr);
    for (const auto& re : regexes_) {
        next.clear();
        next.reserve(spans.size() * 2);
        for (auto [b, e] : spans) split_regex(re->code, md, text, b, e, next);
        spans.swap(next);
    }
    pcre2_match_data_free(md);

    BpeScratch scratch;
    for (auto [b, e] : spans) {
        std::string_view word = text.substr(b, e - b);
        if (ignore_merges_) {
            // Llama-3: a word that is a token as a whole is that token.
            scratch.encoded.clear();
            for (unsigned char c : word) append_utf8(scratch.encoded, kByteToCpt[c]);
            auto it = text_to_id_.find(scratch.encoded);
            if (it != text_to_id_.end()) {
                out.push_back(it->second);
                continue;
            }
        }
        // Merge by rank. The scratch vectors are reused across words.
        const int32_t n = static_cast<int32_t>(word.size());
        auto& id = scratch.id;
        auto& prev = scratch.prev;
        auto& next_i = scratch.next;
        id.resize(n);
        prev.resize(n);
        next_i.resize(n);
        for (int32_t i = 0; i < n; ++i) {
            id[i] = byte_token_[static_cast<uint8_t>(word[i])];
            prev[i] = i - 1;
            next_i[i] = i + 1 < n ? i + 1 : -1;
        }
        auto& heap = scratch.heap;
        heap.clear();
        auto try_add = [&](int32_t l, int32_t r) {
            if (l < 0 || r < 0 || id[l] == kNone || id[r] == kNone) return;
            uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(id[l])) << 32) | static_cast<uint32_t>(id[r]);
            auto it = merges_.find(key);
            if (it == merges_.end()) return;
            heap.push_back(Candidate{it->second.rank, l, r, id[l], id[r], it->second.result});
            std::push_heap(heap.begin(), heap.end(), CandidateLater{});
        };
        for (int32_t i = 0; i + 1 < n; ++i) try_add(i, i + 1);
        while (!heap.empty()) {
            std::pop_heap(heap.begin(), heap.end(), CandidateLater{});
            Candidate c = heap.back();
            heap.pop_back();
            // Stale when either side has merged since: symbols only grow, so
            // unchanged ids at still-adjacent positions mean the pair stands.
            if (id[c.left] != c.left_id || id[c.right] != c.right_id || next_i[c.left] != c.right)
                continue;
            id[c.left] = c.result;
            id[c.right] = kNone;
            int32_t after = next_i[c.right];
            next_i[c.left] = after;
            if (after >= 0) prev[after] = c.left;
            try_add(prev[c.left], c.left);
            try_add(c.left, after);
        }
        // A symbol with no token (a byte whose code point is not in the
        // vocabulary) is dropped, as llama.cpp drops it.
        for (int32_t i = 0; i >= 0 && i < n; i = next_i[i])
            if (id[i] != kNone) out.push_back(id[i]);
    }
}

void Tokenizer::encode_spm(std::string_view raw, std::vector<int32_t>& out) const {
    std::string text;
    text.reserve(raw.size() + 16);
    for (char c : raw) {
        if (c == ' ') text.append(kSpmSpace);
        else text.push_back(c);
    }
    struct Sym {
        size_t start, len;
        int32_t prev, next;
    };
    std::vector<Sym> sym;
    for (size_t off = 0; off < text.size();) {
        size_t len = std::min(utf8_len_lead(static_cast<uint8_t>(text[off])), text.size() - off);
        int32_t i = static_cast<int32_t>(sym.size());
        sym.push_back({off, len, i - 1, off + len == text.size() ? -1 : i + 1});
        off += len;
    }
    std::priority_queue<SpmBigram, std::vector<SpmBigram>, SpmBigramLower> heap;
    auto lookup = [&](size_t start, size_t len) -> int32_t {
        auto it = text_to_id_.find(std::string_view(text).substr(start, len));
        return it == text_to_id_.end() ? kNone : it->second;
    };
    auto try_add = [&](int32_t l, int32_t r) {
        if (l < 0 || r < 0) return;
        size_t size = sym[l].len + sym[r].len;
        int32_t id = lookup(sym[l].start, size);
        if (id == kNone) return;
        heap.push(SpmBigram{scores_[id], l, r, size});
    };
    for (int32_t i = 1; i < static_cast<int32_t>(sym.size()); ++i) try_add(i - 1, i);
    while (!heap.empty()) {
        SpmBigram bg = heap.top();
        heap.pop();
        Sym& l = sym[bg.left];
        Sym& r = sym[bg.right];
        // Stale when either side has merged since (llama.cpp's size check).
        if (l.len == 0 || r.len == 0 || l.len + r.len != bg.size) continue;
        l.len += r.len;
        r.len = 0;
        l.next = r.next;
        if (r.next >= 0) sym[r.next].prev = bg.left;
        try_add(l.prev, bg.left);
        try_add(bg.left, l.next);
    }
    for (int32_t i = sym.empty() ? -1 : 0; i != -1; i = sym[i].next) {
        int32_t id = lookup(sym[i].start, sym[i].len);
        if (id != kNone) {
            out.push_back(id);
            continue;
        }
        for (size_t k = 0; k < sym[i].len; ++k) {
            int32_t b = byte_token_[static_cast<uint8_t>(text[sym[i].start + k])];
            if (b != kNone) out.push_back(b);
        }
    }
}

// ---------------------------------------------------------------------------
// Decoding

std::string_view Tokenizer::piece(int32_t id) const {
    if (id < 0 || id >= n_vocab()) return {};
    return pieces_[id];
}

std::string_view Tokenizer::token_text(int32_t id) const {
    if (id < 0 || id >= n_vocab()) return {};
    return texts_[id];
}

TokenType Tokenizer::token_type(int32_t id) const {
    if (id < 0 || id >= n_vocab()) return TokenType::Undefined;
    return types_[id];
}

bool Tokenizer::is_eog(int32_t id) const { return id >= 0 && id < n_vocab() && eog_[id]; }

std::vector<int32_t> Tokenizer::eog_ids() const {
    std::vector<int32_t> ids;
    for (size_t i = 0; i < eog_.size(); ++i)
        if (eog_[i]) ids.push_back(static_cast<int32_t>(i));
    return ids;
}

bool Tokenizer::is_special(int32_t id) const {
    TokenType t = token_type(id);
    return t == TokenType::Control || t == TokenType::Unknown;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
    std::string out;
    bool at_start = true;
    for (int32_t id : ids) {
        if (id < 0 || id >= n_vocab()) continue;
        if (skip_special && is_special(id)) continue;
        std::string_view p = pieces_[id];
        // SentencePiece: drop the space the encoder prefixed. llama.cpp strips
        // it from the first token even when that is a BOS it does not print,
        // which leaves " Hello" for [BOS, "▁Hello"]; we strip it from the first
        // printed token so that decode(encode(s)) == s.
        if (at_start && model_ == Model::Spm && add_space_prefix_ && !is_special(id) && !p.empty() && p[0] == ' ')
            p.remove_prefix(1);
        at_start = false;
        out.append(p);
    }
    if (clean_spaces_) clean_spaces(out);
    return out;
}

// llama.cpp's clean_up_tokenization_spaces passes in llama_detokenize, in order.
void Tokenizer::clean_spaces(std::string& s) const {
    if (s.size() < 2) return;
    std::string out;
    out.reserve(s.size());
    // " ?", " !", " .", " ," lose the space.
    out.push_back(s[0]);
    for (size_t i = 1; i < s.size(); ++i) {
        char x = s[i];
        if (s[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) out.pop_back();
        out.push_back(x);
    }
    s.swap(out);
    out.clear();
    // " ' " becomes "'". llama.cpp overwrites the dropped space with NUL in
    // place, so the character after it never sees a space before it.
    out.push_back(s[0]);
    size_t nul_at = std::string::npos;
    for (size_t i = 1; i < s.size(); ++i) {
        char x = s[i];
        char before = i - 1 == nul_at ? '\0' : s[i - 1];
        if (x == '\'' && i + 1 < s.size() && before == ' ' && s[i + 1] == ' ') {
            out.pop_back();
            nul_at = ++i;
        }
        out.push_back(x);
    }
    s.swap(out);
    out.clear();
    // " 's", " 'm", " 're", " 've" lose the space (" 't", " 'd", " 'll" keep it).
    if (s.empty()) return;
    out.push_back(s[0]);
    for (size_t i = 1; i < s.size(); ++i) {
        char x = s[i];
        if (s[i - 1] == ' ' && x == '\'' && i + 1 < s.size()) {
            char x1 = s[i + 1];
            if (x1 == 's' || x1 == 'm') {
                out.pop_back();
            } else if (i + 2 < s.size()) {
                char x2 = s[i + 2];
                if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) out.pop_back();
            }
        }
        out.push_back(x);
    }
    s.swap(out);
}

// ---------------------------------------------------------------------------
// UTF-8 hold-back and the Detokenizer

void utf8_append_valid(std::string& out, std::string_view in, std::string* hold) {
    const auto* p = reinterpret_cast<const uint8_t*>(in.data());
    const size_t n = in.size();
    size_t i = 0;
    while (i < n) {
        uint8_t b = p[i];
        if (b < 0x80) {
            out.push_back(static_cast<char>(b));
            ++i;
            continue;
        }
        size_t len = 0;
        uint8_t lo = 0x80, hi = 0xBF;
        if (b >= 0xC2 && b <= 0xDF) len = 2;
        else if (b == 0xE0) { len = 3; lo = 0xA0; }
        else if (b >= 0xE1 && b <= 0xEC) len = 3;
        else if (b == 0xED) { len = 3; hi = 0x9F; }
        else if (b >= 0xEE && b <= 0xEF) len = 3;
        else if (b == 0xF0) { len = 4; lo = 0x90; }
        else if (b >= 0xF1 && b <= 0xF3) len = 4;
        else if (b == 0xF4) { len = 4; hi = 0x8F; }
        if (len == 0) {  // cannot start a character
            append_utf8(out, kReplacement);
            ++i;
            continue;
        }
        size_t k = 1;
        while (k < len && i + k < n) {
            uint8_t c = p[i + k];
            bool ok = k == 1 ? (c >= lo && c <= hi) : (c & 0xC0) == 0x80;
            if (!ok) break;
            ++k;
        }
        if (k == len) {
            out.append(in.substr(i, len));
            i += len;
        } else if (i + k == n) {  // valid so far, cut short by the end of input
            if (hold) hold->assign(in.substr(i));
            else append_utf8(out, kReplacement);
            return;
        } else {  // a maximal invalid subpart of k bytes
            append_utf8(out, kReplacement);
            i += k;
        }
    }
}

Detokenizer::Detokenizer(const Tokenizer& tok, bool skip_special) : tok_(tok), skip_special_(skip_special) {}

std::string Detokenizer::push(int32_t id) {
    std::string out;
    if (id < 0 || id >= tok_.n_vocab()) return out;
    bool special = tok_.is_special(id);
    if (skip_special_ && special) return out;
    std::string_view p = tok_.piece(id);
    // Same leading-space rule as Tokenizer::decode.
    if (at_start_ && tok_.model() == Tokenizer::Model::Spm && tok_.add_space_prefix() && !special && !p.empty() &&
        p[0] == ' ')
        p.remove_prefix(1);
    at_start_ = false;
    std::string buf;
    buf.reserve(pending_.size() + p.size());
    buf.append(pending_).append(p);
    pending_.clear();
    utf8_append_valid(out, buf, &pending_);
    return out;
}

std::string Detokenizer::finish() {
    std::string out;
    if (!pending_.empty()) utf8_append_valid(out, pending_, nullptr);
    pending_.clear();
    return out;
}

void Detokenizer::reset() {
    pending_.clear();
    at_start_ = true;
}

}  // namespace duet
