// libFuzzer target for the GGUF reader: any byte string must parse or be rejected
// with an error, never crash or read out of bounds (run under ASan).
//   cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DDUET_FUZZ=ON
//   ninja -C build-fuzz gguf_fuzz && build-fuzz/tests/gguf_fuzz -max_total_time=60 tests/fuzz/corpus
#include <cstddef>
#include <cstdint>

#include "model/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    auto f = duet::GgufFile::parse(data, size);
    if (f.ok()) {
        // Touch every tensor's first and last byte: they must be inside the input.
        volatile uint8_t sink = 0;
        for (const auto& t : (*f)->tensors())
            if (t.nbytes) sink = sink ^ t.data[0] ^ t.data[t.nbytes - 1];
        for (const auto& [k, v] : (*f)->metadata()) {
            if (v.type == duet::GgufType::ARRAY && v.elems && v.count) (void)v.elem_int(v.count - 1);
        }
    }
    return 0;
}
