#include "kv/crc32c.h"

#include <algorithm>
#include <climits>

#include <isa-l/crc.h>

namespace duet {

// ISA-L's crc32_iscsi (Debian's libisal) picks its fastest version at run time
// (three interleaved SSE4.2 crc32 streams folded with PCLMULQDQ). It neither
// inverts on entry nor on exit, and its length is an int: the standard CRC is
// ~crc32_iscsi(p, n, ~crc), in pieces under 2 GiB.
uint32_t crc32c(const void* p, size_t n, uint32_t crc) {
    auto* b = static_cast<unsigned char*>(const_cast<void*>(p));  // ISA-L only reads it
    uint32_t c = ~crc;
    constexpr size_t kPiece = size_t{1} << 30;
    while (n > 0) {
        const size_t k = std::min(n, kPiece);
        c = crc32_iscsi(b, static_cast<int>(k), c);
        b += k;
        n -= k;
    }
    return ~c;
}

uint32_t crc32c_iov(std::span<const iovec> iov, uint32_t crc) {
    for (const iovec& v : iov) crc = crc32c(v.iov_base, v.iov_len, crc);
    return crc;
}

}  // namespace duet
