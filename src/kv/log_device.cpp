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

std::vector<UringWave> plan_uring_writes(std::span<const LogWrite> ops, unsigned entries) {
    // Per op, its WRITEV pieces.
    std::vector<std::vector<UringStep>> pieces(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
        uint64_t off = ops[i].offset;
        for (size_t f = 0; f < ops[i].iov.size(); f += IOV_MAX) {
            UringStep w;
            w.op = static_cast<uint32_t>(i);
            w.piece = static_cast<uint32_t>(pieces[i].size());
            w.first_iov = f;
            w.n_iov = std::min<size_t>(IOV_MAX, ops[i].iov.size() - f);
            w.offset = off;
            for (size_t k = 0; k < w.n_iov; ++k) w.bytes += ops[i].iov[f + k].iov_len;
            off += w.bytes;
            pieces[i].push_back(w);
        }
    }
    auto sync_of = [](size_t i) {
        UringStep s;
        s.kind = UringStep::Kind::Fsync;
        s.op = static_cast<uint32_t>(i);
        s.datasync = true;
        return s;
    };
    std::vector<UringWave> waves;
    // Waves of whole chains that fit the ring.
    size_t next = 0;
    while (next < ops.size()) {
        unsigned used = 0;
        size_t end = next;
        while (end < ops.size() && (used == 0 || used + pieces[end].size() + 1 <= entries)) {
            if (pieces[end].size() + 1 > entries) {  // a chain longer than the ring: alone, one step at a time
                if (used == 0) ++end;
                break;
            }
            used += static_cast<unsigned>(pieces[end].size() + 1);
            ++end;
        }
        UringWave w;
        for (size_t i = next; i < end; ++i) {
            // Too many pieces for one chain: the device contract only needs the
            // sync after all writes, so the pieces go one after the other, each
            // waited for, then the sync. Reached only with huge records.
            w.one_at_a_time = pieces[i].size() + 1 > entries;
            for (UringStep p : pieces[i]) {
                p.link = !w.one_at_a_time;
                w.steps.push_back(p);
            }
            w.steps.push_back(sync_of(i));
        }
        waves.push_back(std::move(w));
        next = end;
    }
    return waves;
}

void UringLogDevice::write_sync(std::span<const LogWrite> ops, std::span<LogWriteResult> out) {
    std::lock_guard lock(mu_);
    io_uring* ring = ring_.get();
    const std::vector<UringWave> waves = plan_uring_writes(ops, entries_);
    // Per op and piece: the bytes it should write, and its result (bytes or -errno).
    std::vector<std::vector<uint64_t>> want(ops.size());
    std::vector<std::vector<int64_t>> res(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) out[i] = {};
    for (const UringWave& w : waves)
        for (const UringStep& s : w.steps)
            if (s.kind == UringStep::Kind::Writev) {
                want[s.op].push_back(s.bytes);
                res[s.op].push_back(0);
            }
    auto prep = [&](const UringStep& s) {
        io_uring_sqe* sqe = io_uring_get_sqe(ring);
        if (s.kind == UringStep::Kind::Writev) {
            io_uring_prep_writev(sqe, ops[s.op].fd, &ops[s.op].iov[s.first_iov], static_cast<unsigned>(s.n_iov),
                                 s.offset);
        } else {
            io_uring_prep_fsync(sqe, ops[s.op].fd, s.datasync ? IORING_FSYNC_DATASYNC : 0);
        }
        if (s.link) io_uring_sqe_set_flags(sqe, IOSQE_IO_LINK);
        io_uring_sqe_set_data64(sqe, (static_cast<uint64_t>(s.op) << 20) |
                                         (s.kind == UringStep::Kind::Fsync ? kSyncPiece : s.piece));
    };
    auto record = [&](const UringStep& s, int r) {
        if (s.kind == UringStep::Kind::Fsync) out[s.op].sync_err = r < 0 ? -r : 0;
        else res[s.op][s.piece] = r;
    };
    for (const UringWave& w : waves) {
        if (w.one_at_a_time) {
            bool broke = false;
            for (const UringStep& s : w.steps) {
                if (broke) {
                    if (s.kind == UringStep::Kind::Fsync) out[s.op].sync_err = ECANCELED;
                    continue;
                }
                prep(s);
                io_uring_submit(ring);
                io_uring_cqe* cqe = nullptr;
                while (io_uring_wait_cqe(ring, &cqe) == -EINTR) {}
                record(s, cqe->res);
                io_uring_cqe_seen(ring, cqe);
                if (s.kind == UringStep::Kind::Writev && (cqe->res < 0 || static_cast<uint64_t>(cqe->res) < s.bytes))
                    broke = true;
            }
            continue;
        }
        for (const UringStep& s : w.steps) prep(s);
        unsigned inflight = static_cast<unsigned>(w.steps.size());
        int sub;
        while ((sub = io_uring_submit(ring)) == -EINTR || sub == -EAGAIN) {}
        while (inflight > 0) {
            io_uring_cqe* cqe = nullptr;
            const int r = io_uring_wait_cqe(ring, &cqe);
            if (r == -EINTR) continue;
            if (r < 0) break;  // cannot happen with a valid ring; leaves the rest as unsynced
            const uint64_t ud = io_uring_cqe_get_data64(cqe);
            const size_t i = static_cast<size_t>(ud >> 20), p = static_cast<size_t>(ud & kSyncPiece);
            if (p == kSyncPiece) out[i].sync_err = cqe->res < 0 ? -cqe->res : 0;
            else res[i][p] = cqe->res;
            io_uring_cqe_seen(ring, cqe);
            --inflight;
        }
    }
    // Bytes written in order; the first short or failed piece ends the count.
    for (size_t i = 0; i < ops.size(); ++i) {
        for (size_t p = 0; p < res[i].size(); ++p) {
            const int64_t r = res[i][p];
            if (r < 0) {
                // -ECANCELED: an earlier piece broke the chain; it reported the cause.
                if (r != -ECANCELED || out[i].write_err == 0) out[i].write_err = static_cast<int>(-r);
                break;
            }
            out[i].written += static_cast<uint64_t>(r);
            if (static_cast<uint64_t>(r) < want[i][p]) break;  // short: the rest was cancelled
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
