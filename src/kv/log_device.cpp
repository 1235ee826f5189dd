#include "kv/log_device.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include <liburing.h>
#include <unistd.h>

namespace duet {

Result<std::unique_ptr<UringLogDevice>> UringLogDevice::create(unsigned entries) {
    std::unique_ptr<UringLogDevice> d(new UringLogDevice());
    d->ring_ = std::make_unique<io_uring>();
    const int r = io_uring_queue_init(entries, d->ring_.get(), 0);
    if (r < 0) {
        d->ring_.reset();
        return make_error("io_uring_queue_init({}): {} (is io_uring disabled? see /proc/sys/kernel/io_uring_disabled)",
                          entries, std::strerror(-r));
    }
    d->entries_ = entries;
    return d;
}

UringLogDevice::~UringLogDevice() {
    if (ring_) io_uring_queue_exit(ring_.get());
}

namespace {

// user_data: op index << 20 | piece (0..2^20-2: the op's k-th WRITEV; all ones: its fsync).
constexpr uint64_t kSyncPiece = (1u << 20) - 1;

}  // namespace

void UringLogDevice::write_sync(std::span<const LogWrite> ops, std::span<LogWriteResult> out) {
    std::lock_guard lock(mu_);
    io_uring* ring = ring_.get();
    // Per op, its WRITEV pieces: [first iovec, count).
    struct Piece {
        size_t first, count;
        uint64_t bytes, offset;
    };
    std::vector<std::vector<Piece>> pieces(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
        out[i] = {};
        uint64_t off = ops[i].offset;
        for (size_t f = 0; f < ops[i].iov.size(); f += IOV_MAX) {
            const size_t c = std::min<size_t>(IOV_MAX, ops[i].iov.size() - f);
            uint64_t b = 0;
            for (size_t k = 0; k < c; ++k) b += ops[i].iov[f + k].iov_len;
            pieces[i].push_back({f, c, b, off});
            off += b;
        }
    }
    // Per op: bytes written by its pieces (in order: a piece counts only when all
    // before it completed in full), and whether the chain broke.
    std::vector<std::vector<int64_t>> res(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) res[i].assign(pieces[i].size(), 0);

    // Submit in waves of whole chains that fit the ring.
    size_t next = 0;
    while (next < ops.size()) {
        unsigned used = 0, inflight = 0;
        size_t end = next;
        while (end < ops.size() && (used == 0 || used + pieces[end].size() + 1 <= entries_)) {
            if (pieces[end].size() + 1 > entries_) {  // a chain longer than the ring: run it alone, piecewise below
                if (used == 0) ++end;
                break;
            }
            used += static_cast<unsigned>(pieces[end].size() + 1);
            ++end;
        }
        for (size_t i = next; i < end; ++i) {
            const size_t np = pieces[i].size();
            if (np + 1 > entries_) {
                // Too many pieces for one chain: the device contract only needs the
                // sync after all writes, so write the pieces unlinked-in-sequence
                // (each waited for) and then sync. Reached only with huge records.
                bool broke = false;
                for (size_t p = 0; p < np && !broke; ++p) {
                    io_uring_sqe* sqe = io_uring_get_sqe(ring);
                    io_uring_prep_writev(sqe, ops[i].fd, &ops[i].iov[pieces[i][p].first],
                                         static_cast<unsigned>(pieces[i][p].count), pieces[i][p].offset);
                    io_uring_submit(ring);
                    io_uring_cqe* cqe = nullptr;
                    while (io_uring_wait_cqe(ring, &cqe) == -EINTR) {}
                    res[i][p] = cqe->res;
                    io_uring_cqe_seen(ring, cqe);
                    if (res[i][p] < 0 || static_cast<uint64_t>(res[i][p]) < pieces[i][p].bytes) broke = true;
                }
                if (broke) {
                    out[i].sync_err = ECANCELED;
                } else {
                    io_uring_sqe* sqe = io_uring_get_sqe(ring);
                    io_uring_prep_fsync(sqe, ops[i].fd, IORING_FSYNC_DATASYNC);
                    io_uring_submit(ring);
                    io_uring_cqe* cqe = nullptr;
                    while (io_uring_wait_cqe(ring, &cqe) == -EINTR) {}
                    out[i].sync_err = cqe->res < 0 ? -cqe->res : 0;
                    io_uring_cqe_seen(ring, cqe);
                }
                continue;
            }
            for (size_t p = 0; p < np; ++p) {
                io_uring_sqe* sqe = io_uring_get_sqe(ring);
                io_uring_prep_writev(sqe, ops[i].fd, &ops[i].iov[pieces[i][p].first],
                                     static_cast<unsigned>(pieces[i][p].count), pieces[i][p].offset);
                io_uring_sqe_set_flags(sqe, IOSQE_IO_LINK);
                io_uring_sqe_set_data64(sqe, (static_cast<uint64_t>(i) << 20) | p);
                ++inflight;
            }
            io_uring_sqe* sqe = io_uring_get_sqe(ring);
            io_uring_prep_fsync(sqe, ops[i].fd, IORING_FSYNC_DATASYNC);
            io_uring_sqe_set_data64(sqe, (static_cast<uint64_t>(i) << 20) | kSyncPiece);
            ++inflight;
        }
        int s;
        while ((s = io_uring_submit(ring)) == -EINTR || s == -EAGAIN) {}
        while (inflight > 0) {
            io_uring_cqe* cqe = nullptr;
            const int w = io_uring_wait_cqe(ring, &cqe);
            if (w == -EINTR) continue;
            if (w < 0) break;  // cannot happen with a valid ring; leaves the rest as unsynced
            const uint64_t ud = io_uring_cqe_get_data64(cqe);
            const size_t i = static_cast<size_t>(ud >> 20), p = static_cast<size_t>(ud & kSyncPiece);
            if (p == kSyncPiece)
                out[i].sync_err = cqe->res < 0 ? -cqe->res : 0;
            else
                res[i][p] = cqe->res;
            io_uring_cqe_seen(ring, cqe);
            --inflight;
        }
        next = end;
    }
    // Bytes written in order; the first short or failed piece ends the count.
    for (size_t i = 0; i < ops.size(); ++i) {
        for (size_t p = 0; p < pieces[i].size(); ++p) {
            const int64_t r = res[i][p];
            if (r < 0) {
                // -ECANCELED: an earlier piece broke the chain; it reported the cause.
                if (r != -ECANCELED || out[i].write_err == 0) out[i].write_err = static_cast<int>(-r);
                break;
            }
            out[i].written += static_cast<uint64_t>(r);
            if (static_cast<uint64_t>(r) < pieces[i][p].bytes) break;  // short: the rest was cancelled
        }
        if (out[i].write_err == ECANCELED) out[i].write_err = EIO;  // cancelled with no cause seen
    }
}

void SyncLogDevice::write_sync(std::span<const LogWrite> ops, std::span<LogWriteResult> out) {
    for (size_t i = 0; i < ops.size(); ++i) {
        out[i] = {};
        uint64_t off = ops[i].offset;
        bool whole = true;
        for (size_t f = 0; f < ops[i].iov.size() && whole; f += IOV_MAX) {
            const size_t c = std::min<size_t>(IOV_MAX, ops[i].iov.size() - f);
            uint64_t b = 0;
            for (size_t k = 0; k < c; ++k) b += ops[i].iov[f + k].iov_len;
            ssize_t r;
            while ((r = ::pwritev(ops[i].fd, &ops[i].iov[f], static_cast<int>(c), static_cast<off_t>(off))) < 0 &&
                   errno == EINTR) {}
            if (r < 0) {
                out[i].write_err = errno;
                whole = false;
            } else {
                out[i].written += static_cast<uint64_t>(r);
                off += static_cast<uint64_t>(r);
                if (static_cast<uint64_t>(r) < b) whole = false;
            }
        }
        if (!whole) {
            out[i].sync_err = ECANCELED;
            continue;
        }
        out[i].sync_err = ::fdatasync(ops[i].fd) == 0 ? 0 : errno;
    }
}

}  // namespace duet
