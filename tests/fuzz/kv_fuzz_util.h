// What the KV fuzz targets share: a check that holds under NDEBUG, a CRC32C
// computed bit by bit from the polynomial (the reference the ISA-L checksum of the
// code under test is held to), the bytes of a sequence's KV rows, and a scratch
// directory on tmpfs that is removed at exit.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "kv/blob.h"
#include "kv/kv_pool.h"

#define KV_FUZZ_CHECK(cond, what)                                                                  \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            std::fprintf(stderr, "%s:%d: check failed: %s: %s\n", __FILE__, __LINE__, #cond,       \
                         std::string(what).c_str());                                               \
            std::abort();                                                                          \
        }                                                                                          \
    } while (0)

namespace duet::kvfuzz {

// CRC32C (reflected polynomial 0x82F63B78, inverted in and out), one bit at a time.
inline uint32_t ref_crc32c(const uint8_t* p, size_t n, uint32_t crc = 0) {
    crc = ~crc;
    for (size_t i = 0; i < n; ++i) {
        crc ^= p[i];
        for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

// The arena bytes of positions [first, first + n) of seq in blob order.
inline std::vector<uint8_t> rows_bytes(KvPool& pool, const KvSeq& seq, uint64_t first, uint64_t n) {
    std::vector<uint8_t> out;
    auto iov = kv_rows_iov(pool, seq.blocks(), first, n);
    KV_FUZZ_CHECK(iov.ok(), iov.ok() ? "" : iov.error().message);
    for (const iovec& v : *iov)
        out.insert(out.end(), static_cast<const uint8_t*>(v.iov_base), static_cast<const uint8_t*>(v.iov_base) + v.iov_len);
    return out;
}

// A fresh directory under /dev/shm (or TMPDIR, or /tmp), removed when the process exits.
inline std::string scratch_dir(const char* tag) {
    static std::vector<std::string> dirs;  // the fuzz process's own: removed by the atexit hook
    const char* base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp");
    std::string t = std::string(base) + "/" + tag + ".XXXXXX";
    KV_FUZZ_CHECK(::mkdtemp(t.data()) != nullptr, t);
    if (dirs.empty()) std::atexit([] {
            std::error_code ec;
            for (const std::string& d : dirs) std::filesystem::remove_all(d, ec);
        });
    dirs.push_back(t);
    return t;
}

// Replaces the contents of fd with [p, p + n).
inline void write_all(int fd, const uint8_t* p, size_t n, uint64_t at = 0) {
    KV_FUZZ_CHECK(::ftruncate(fd, 0) == 0, "ftruncate");
    size_t done = 0;
    while (done < n) {
        const ssize_t w = ::pwrite(fd, p + done, n - done, static_cast<off_t>(at + done));
        KV_FUZZ_CHECK(w > 0, "pwrite");
        done += static_cast<size_t>(w);
    }
}

// The checksums a writer would have put in, from the formats as kv/blob.h and
// kv/kv_log.h document them: so that a mutated field reaches the checks behind the
// CRCs (ranges, sizes, record semantics, replay) instead of stopping at a CRC.
// Blob: the data CRC at 96 over the bytes after the header, then the header CRC at
// 124 over bytes 0..123.
inline void fix_blob_crcs(std::vector<uint8_t>& b) {
    if (b.size() < 128) return;
    const uint32_t data = ref_crc32c(b.data() + 128, b.size() - 128);
    std::memcpy(b.data() + 96, &data, 4);
    const uint32_t head = ref_crc32c(b.data(), 124);
    std::memcpy(b.data() + 124, &head, 4);
}
// Log: the file header CRC at 124; then record by record, as far as headers fit,
// payload_crc (at 32, when the payload fits), prev_crc (at 36: the chain) and
// header_crc (at 44: CRC32C of the salt, at 72 in the file header, then bytes
// 0..43), stepping by 48 + payload + padding to 8.
inline void fix_log_crcs(std::vector<uint8_t>& b) {
    if (b.size() < 128) return;
    uint32_t prev = ref_crc32c(b.data(), 124);
    std::memcpy(b.data() + 124, &prev, 4);
    const uint8_t* salt = b.data() + 72;
    for (uint64_t off = 128; off + 48 <= b.size();) {
        uint8_t* h = b.data() + off;
        uint64_t pb;
        std::memcpy(&pb, h + 24, 8);
        const bool whole = pb <= b.size() - off - 48;
        if (whole) {
            const uint32_t pc = ref_crc32c(h + 48, pb);
            std::memcpy(h + 32, &pc, 4);
        }
        std::memcpy(h + 36, &prev, 4);
        prev = ref_crc32c(h, 44, ref_crc32c(salt, 8));
        std::memcpy(h + 44, &prev, 4);
        if (!whole) break;
        off += 48 + pb + ((8 - (pb & 7)) & 7);
    }
}

}  // namespace duet::kvfuzz
