// Tokenizer: text <-> token ids for the vocabularies llama.cpp reads from GGUF.
//
// Two models are supported, named by `tokenizer.ggml.model`:
//   - "gpt2":  byte-level BPE. The text is split into words by the pre-tokenizer
//     regexes that `tokenizer.ggml.pre` names ("default", "gpt-2"/"gpt2",
//     "smollm", "llama-bpe"/"llama3"/"llama-v3", "qwen2"/"deepseek-r1-qwen"),
//     each word is mapped byte -> printable code point (GPT-2's byte map) and
//     merged by merge rank.
//   - "llama": SentencePiece BPE: spaces become U+2581, an optional space
//     prefix, pieces merged by score, bytes with no piece fall back to <0xNN>.
// The behaviour follows llama.cpp's llama-vocab.cpp so that both engines give
// the same ids for the same text; where it differs the .cpp says where and why.
//
// A Tokenizer copies what it needs out of the GgufFile and keeps no pointer into
// it. It is immutable after from_gguf(), so one instance may be shared by any
// number of threads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/result.h"
#include "model/gguf.h"

namespace duet {

// tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
enum class TokenType : uint8_t {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
};

class Tokenizer {
public:
    enum class Model { Spm, Bpe };
    // Pre-tokenizer of a BPE vocabulary (unused for SentencePiece).
    enum class Pre { Default, Gpt2, Smollm, Llama3, Qwen2 };

    static constexpr int32_t kNone = -1;

    static Result<std::unique_ptr<Tokenizer>> from_gguf(const GgufFile& f);
    ~Tokenizer();
    Tokenizer(const Tokenizer&) = delete;
    Tokenizer& operator=(const Tokenizer&) = delete;

    // add_special: prepend BOS / append EOS as the model's add_bos_token /
    // add_eos_token say. parse_special: control and user-defined token texts in
    // `text` (e.g. "<|im_start|>") become those single tokens; otherwise only
    // user-defined texts do (as llama.cpp and HF do) and control texts are
    // tokenized as plain text.
    std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;

    // The bytes token `id` stands for (the GPT-2 byte map undone, U+2581 turned
    // back into a space, <0xNN> turned into its byte). Control, unknown and
    // user-defined tokens give their text. Unused tokens and ids out of range
    // give "".
    std::string_view piece(int32_t id) const;
    // The token's text as stored in the vocabulary.
    std::string_view token_text(int32_t id) const;
    TokenType token_type(int32_t id) const;

    // Concatenated pieces. skip_special leaves out control and unknown tokens
    // (user-defined ones stay, as in llama.cpp). For SentencePiece the space the
    // encoder prefixed to the text is removed from the first text token. For the
    // gpt2/default/llama3 pre-tokenizers llama.cpp's clean_up_tokenization_spaces
    // rules are applied (" ." -> "." etc.), as llama_detokenize does. The result
    // is the raw bytes: it can hold invalid UTF-8 when `ids` ends mid-character
    // (use Detokenizer for text that must be valid).
    std::string decode(std::span<const int32_t> ids, bool skip_special) const;

    int32_t n_vocab() const { return static_cast<int32_t>(texts_.size()); }
    int32_t bos() const { return bos_; }
    int32_t eos() const { return eos_; }
    int32_t eot() const { return eot_; }
    int32_t unk() const { return unk_; }
    bool add_bos() const { return add_bos_; }
    bool add_space_prefix() const { return add_space_prefix_; }
    bool add_eos() const { return add_eos_; }
    Model model() const { return model_; }
    Pre pre() const { return pre_; }

    // End of generation. Following llama.cpp: the EOS, EOT and EOM ids, every
    // token whose text is one of <|eot_id|>, <|im_end|>, <|end|>, <end_of_turn>,
    // <|endoftext|>, <|eom_id|>, <EOT>, _<EOT>, <|end_of_text|>,
    // <end_of_utterance>, </s>, <|return|>, <|call|>, and the FIM pad / repo /
    // file-separator tokens found by text (<|fim_pad|>, <fim_pad>, <reponame>,
    // <|repo_name|>, <|file_sep|>, ...); <|end|> is left out when <|return|>
    // and <|call|> exist (gpt-oss). For SmolLM2 that is ids 0, 2 and 4
    // (<reponame> counts as the FIM repo token, as in llama.cpp).
    bool is_eog(int32_t id) const;
    // Every id is_eog says yes to, ascending.
    std::vector<int32_t> eog_ids() const;
    // Control or unknown: what decode(skip_special = true) leaves out.
    bool is_special(int32_t id) const;

private:
    struct Regex;
    struct Merge {
        int32_t rank;
        int32_t result;
    };

    Tokenizer();
    Status init_bpe(const GgufFile& f);
    Status init_spm();
    void finish_specials();

    // Splits text into raw-text fragments and special tokens (llama.cpp's
    // tokenizer_st_partition).
    struct Fragment {
        int32_t token;         // kNone for raw text
        std::string_view text; // raw text when token == kNone
    };
    std::vector<Fragment> partition(std::string_view text, bool parse_special) const;

    void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;
    void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
    void clean_spaces(std::string& s) const;

    Model model_ = Model::Bpe;
    Pre pre_ = Pre::Default;
    bool add_bos_ = false;
    bool add_eos_ = false;
    bool add_space_prefix_ = false;
    bool ignore_merges_ = false;
    bool clean_spaces_ = false;
    int32_t bos_ = kNone, eos_ = kNone, eot_ = kNone, eom_ = kNone, unk_ = kNone;

    std::vector<std::string> texts_;   // vocabulary strings
    std::vector<std::string> pieces_;  // decoded bytes, see piece()
    std::vector<TokenType> types_;
    std::vector<float> scores_;        // SentencePiece merge priority
    std::vector<uint8_t> eog_;         // 1 where is_eog
    struct StringHash {
        using is_transparent = void;
        size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
    };
    std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> text_to_id_;
    // Control, user-defined and unknown ids, longest text first.
    std::vector<int32_t> specials_;

    // BPE: the token of each byte's GPT-2 code point. SentencePiece: the byte
    // fallback token (<0xNN>).
    int32_t byte_token_[256];
    // BPE only: merges by (left id << 32 | right id), and the pre-tokenizer
    // regexes, applied in order.
    std::unordered_map<uint64_t, Merge> merges_;
    std::vector<std::unique_ptr<Regex>> regexes_;
};

// Incremental detokenizer for streaming: push() returns the text that became
// complete with this token. An incomplete UTF-8 sequence at the end is held back
// until the bytes that complete it arrive, so every returned string is valid
// UTF-8 (bytes that can never form a character come out as U+FFFD, one per
// maximal invalid subpart, as Python's errors="replace" does). finish() flushes
// what is held (an unfinished sequence becomes U+FFFD).
//
// The output equals decode() of the same ids except that decode() returns raw
// bytes and applies clean_up_tokenization_spaces, which needs look-ahead;
// llama.cpp's server streams token_to_piece() the same way.
class Detokenizer {
public:
    explicit Detokenizer(const Tokenizer& tok, bool skip_special = true);
    std::string push(int32_t id);
    std::string finish();
    void reset();

private:
    const Tokenizer& tok_;
    bool skip_special_;
    bool at_start_ = true;
    std::string pending_;  // a valid, incomplete UTF-8 prefix (at most 3 bytes)
};

// Appends `in` to `out` as valid UTF-8, replacing each maximal invalid subpart
// with U+FFFD. When `hold` is non-null, an incomplete but so far valid sequence
// at the very end is not written but stored in *hold.
void utf8_append_valid(std::string& out, std::string_view in, std::string* hold);

}  // namespace duet
