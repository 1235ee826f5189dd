// The identities a KV blob or log carries (kv/blob.h KvIdentity), computed from a
// GGUF file at load. KVLOG.md "Fingerprints" says what each covers and why.
#pragma once

#include "kv/blob.h"
#include "model/gguf.h"

namespace duet {

// Bumped whenever duet's tokenizer would split some text differently for the same
// metadata (a fix in the pre-tokenizer, say): KV of tokens from the old code must
// not be taken for the new code's.
constexpr uint32_t kTokenizerImplVersion = 1;

// SHA-256 (first 128 bits) of: every metadata key and value but general.* (names,
// authors, URLs: not the weights) and tokenizer.* (the tokenizer's own
// fingerprint), plus general.architecture; the tensor table (names, types, shapes,
// offsets); and each tensor's bytes, whole up to 64 KiB, else 16 windows of 4 KiB
// evenly spread from its first byte to its last. A fine-tune, a requantization or
// another model of the same shapes differs in nearly every window; reading at most
// 64 KiB a tensor keeps it cheap for a 16 GB file (a few MB hashed).
Fp128 model_fingerprint(const GgufFile& f);
// SHA-256 (first 128 bits) of every tokenizer.* key and value except the chat
// template (not tokenization), and kTokenizerImplVersion.
Fp128 tokenizer_fingerprint(const GgufFile& f);

}  // namespace duet
