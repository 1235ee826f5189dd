// CRC32C (Castagnoli, the iSCSI polynomial 0x1EDC6F41, reflected), the checksum of
// every KV blob and KV log record (KVLOG.md).
//
// Conventions are the standard ones (initial value and final value inverted), so
// crc32c("123456789") == 0xE3069283, and a running checksum extends: passing the
// CRC of A as `crc` when hashing B gives the CRC of A followed by B.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <sys/uio.h>

namespace duet {

// The CRC of n bytes at p, continuing `crc` (0 to start).
uint32_t crc32c(const void* p, size_t n, uint32_t crc = 0);
// The CRC of the buffers in order, continuing `crc`.
uint32_t crc32c_iov(std::span<const iovec> iov, uint32_t crc = 0);

}  // namespace duet
