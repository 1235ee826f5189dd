// The I/O beneath the KV append log (kv_log.h): a batch of (write, fdatasync)
// pairs. UringLogDevice is the real one; tests put a fault-injecting device in its
// place (tests/kv_fault_device.h) to drop, tear, short-write and fail I/O on cue.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include <sys/uio.h>

#include "base/result.h"

struct io_uring;

namespace duet {

struct LogWrite {
    int fd = -1;
    uint64_t offset = 0;
    std::vector<iovec> iov;  // written in order from `offset`
};

// What happened to one pair. The sync ran only when the whole write did: after a
// short or failed write it is ECANCELED (io_uring cancels the rest of a broken
// link chain) and the caller continues or fails the write.
struct LogWriteResult {
    uint64_t written = 0;  // bytes written from the start of iov
    int write_err = 0;     // errno of the write that stopped (0: none)
    int sync_err = 0;      // errno of the fdatasync (0: durable; ECANCELED: not run)
};

class LogDevice {
public:
    virtual ~LogDevice() = default;
    // Each op's writes at its offset, then fdatasync of its fd, ordered (the sync
    // never overtakes its write); the pairs run concurrently. Fills out[i] for ops[i].
    virtual void write_sync(std::span<const LogWrite> ops, std::span<LogWriteResult> out) = 0;
};

// One submission of UringLogDevice's plan: a WRITEV of an IOV_MAX-sized piece of an
// op's buffers, or its op's FSYNC.
struct UringStep {
    enum class Kind : uint8_t { Writev, Fsync };
    Kind kind = Kind::Writev;
    uint32_t op = 0;     // the LogWrite it serves
    uint32_t piece = 0;  // Writev: which piece of the op's iov, in order
    size_t first_iov = 0, n_iov = 0;
    uint64_t offset = 0, bytes = 0;
    bool link = false;      // IOSQE_IO_LINK: the next step runs only once this one completed in full
    bool datasync = false;  // Fsync: IORING_FSYNC_DATASYNC
};
// Steps submitted together (one io_uring_enter), or one at a time, each waited for
// (an op whose chain is longer than the ring: a failed write skips the rest of it).
struct UringWave {
    std::vector<UringStep> steps;
    bool one_at_a_time = false;
};
// What UringLogDevice::write_sync submits for `ops` on a ring of `entries`. Pure, so
// that the rule the log's durability rests on, every write of an op linked in one
// chain that ends in its datasync, is tested without a ring or a disk
// (log_device_test): a dropped link or sync would pass every crash test, since
// SIGKILL keeps the page cache.
std::vector<UringWave> plan_uring_writes(std::span<const LogWrite> ops, unsigned entries);

// io_uring (liburing): each write is an IORING_OP_WRITEV linked (IOSQE_IO_LINK) to an
// IORING_OP_FSYNC with IORING_FSYNC_DATASYNC, so the sync starts only after the
// write completed in full; a write of more than IOV_MAX buffers is several linked
// WRITEVs. Every pair of a batch goes in one io_uring_enter, so the file system
// gets all the syncs at once (ext4 / xfs join concurrent fdatasyncs into one
// journal commit). Buffered I/O: KVLOG.md "Buffered, not O_DIRECT" says why.
class UringLogDevice final : public LogDevice {
public:
    static Result<std::unique_ptr<UringLogDevice>> create(unsigned entries = 256);
    ~UringLogDevice() override;
    void write_sync(std::span<const LogWrite> ops, std::span<LogWriteResult> out) override;

private:
    UringLogDevice() = default;
    std::unique_ptr<io_uring> ring_;
    unsigned entries_ = 0;
    std::mutex mu_;  // one batch in the ring at a time
};

// pwritev + fdatasync, one pair after the other (the reference the benchmark
// compares io_uring with; also what a test uses to check the device contract).
class SyncLogDevice final : public LogDevice {
public:
    void write_sync(std::span<const LogWrite> ops, std::span<LogWriteResult> out) override;
};

}  // namespace duet
