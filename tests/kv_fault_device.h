// A fault-injecting LogDevice for the KV log tests: it does the real I/O (pwritev
// and fdatasync of the real file) and, on cue, breaks it the ways a disk and a
// kernel do: a short write, ENOSPC after a prefix, a failed fdatasync whose pages
// the kernel drops, or a crash with the last write unsynced. It tracks per file
// what is durable (the content as of the last successful fdatasync), so a test can
// build the images a power loss could leave: the durable bytes plus none, a torn
// prefix, or any subset of the 512-byte sectors of what was written since.
#pragma once

#include "file_bytes.h"
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kv/log_device.h"

namespace duet::kvtest {

enum class FaultKind {
    None,
    Short,    // the write stops after `keep` bytes (no error): written < requested, sync ECANCELED
    NoSpace,  // the write stops after `keep` bytes with ENOSPC, sync ECANCELED
    SyncEio,  // the write completes, fdatasync fails with EIO
    Crash,    // `keep` bytes of the write reach the page cache, nothing is synced, and the
              // process is dead from here: every later op does nothing (and reports EIO)
};

struct Fault {
    FaultKind kind = FaultKind::None;
    uint64_t keep = UINT64_MAX;  // bytes of the op's write that reach the file (clamped to its size)
    bool drop = true;            // SyncEio: the kernel drops the unsynced pages (a re-read shows them gone)
};

class FaultLogDevice final : public LogDevice {
public:
    static constexpr uint64_t kSector = 512;

    // The fault for the n-th op this device is handed (0-based, counting every op of every call).
    void fault_op(uint64_t n, Fault f) {
        std::lock_guard lk(mu_);
        by_op_[n] = f;
    }
    // The fault for the next op on the file at `path`.
    void fault_next(const std::string& path, Fault f) {
        std::lock_guard lk(mu_);
        by_path_[path].push_back(f);
    }
    // A disk with `bytes` bytes free: a write past them stops there with ENOSPC.
    void set_space(uint64_t bytes) {
        std::lock_guard lk(mu_);
        space_ = bytes;
    }
    void unlimited_space() { set_space(UINT64_MAX); }
    // Every write stops after this many bytes (a short write; 0: none).
    void set_max_write(uint64_t bytes) {
        std::lock_guard lk(mu_);
        max_write_ = bytes;
    }
    uint64_t ops_seen() const {
        std::lock_guard lk(mu_);
        return ops_seen_;
    }
    uint64_t faults_fired() const {
        std::lock_guard lk(mu_);
        return fired_;
    }
    uint64_t calls() const {
        std::lock_guard lk(mu_);
        return calls_;
    }
    bool crashed() const {
        std::lock_guard lk(mu_);
        return crashed_;
    }

    // What a power loss can leave of `path`: its durable bytes, then of the bytes
    // written since the last successful sync ([unsynced_lo, file end)) either
    // nothing, a prefix (torn), or a subset of their 512-byte sectors.
    std::vector<uint8_t> durable(const std::string& path) const {
        std::lock_guard lk(mu_);
        auto it = files_.find(path);
        return it == files_.end() ? std::vector<uint8_t>() : it->second.durable;
    }
    // [lo, hi): the bytes written since the last successful sync (lo == hi: none).
    std::pair<uint64_t, uint64_t> unsynced(const std::string& path) const {
        std::lock_guard lk(mu_);
        auto it = files_.find(path);
        if (it == files_.end() || it->second.dirty_lo == UINT64_MAX) return {0, 0};
        const uint64_t hi = current_size(path);
        return {std::min(it->second.dirty_lo, hi), hi};
    }
    // The durable bytes with the first t unsynced bytes on top.
    std::vector<uint8_t> image_torn(const std::string& path, uint64_t t) const {
        const auto [lo, hi] = unsynced(path);
        std::vector<uint8_t> img = durable(path);
        const std::vector<uint8_t> cur = read_all(path);
        const uint64_t end = std::min(hi, lo + t);
        if (img.size() < end) img.resize(end, 0);
        std::copy(cur.begin() + lo, cur.begin() + end, img.begin() + lo);
        return img;
    }
    // The durable bytes with the unsynced bytes of the sectors keep[i] says on top
    // (sector i: file offsets [512 (lo / 512 + i), +512)); a dropped sector holds
    // what it held at the last sync (zeros past the durable end). cut_tail: the
    // file ends after the last kept sector (the size did not reach the disk either).
    size_t unsynced_sectors(const std::string& path) const {
        const auto [lo, hi] = unsynced(path);
        return hi > lo ? static_cast<size_t>((hi + kSector - 1) / kSector - lo / kSector) : 0;
    }
    std::vector<uint8_t> image_sectors(const std::string& path, const std::vector<bool>& keep, bool cut_tail) const {
        const auto [lo, hi] = unsynced(path);
        std::vector<uint8_t> img = durable(path);
        const uint64_t dur = img.size();
        const std::vector<uint8_t> cur = read_all(path);
        if (img.size() < hi) img.resize(hi, 0);
        uint64_t end = dur;
        for (size_t i = 0; i < keep.size(); ++i) {
            const uint64_t s = (lo / kSector + i) * kSector;
            const uint64_t a = std::max(lo, s), b = std::min(hi, s + kSector);
            if (a >= b || !keep[i]) continue;
            std::copy(cur.begin() + a, cur.begin() + b, img.begin() + a);
            end = std::max(end, b);
        }
        if (cut_tail) img.resize(end);
        return img;
    }

    void write_sync(std::span<const LogWrite> ops, std::span<LogWriteResult> out) override {
        std::lock_guard lk(mu_);
        ++calls_;
        for (size_t i = 0; i < ops.size(); ++i) {
            out[i] = {};
            const LogWrite& w = ops[i];
            uint64_t total = 0;
            for (const iovec& v : w.iov) total += v.iov_len;
            File& f = file_for(w.fd);
            Fault fault;
            if (auto it = by_op_.find(ops_seen_); it != by_op_.end()) {
                fault = it->second;
                by_op_.erase(it);
            } else if (auto q = by_path_.find(f.path); q != by_path_.end() && !q->second.empty()) {
                fault = q->second.front();
                q->second.pop_front();
            }
            ++ops_seen_;
            if (crashed_) {  // the process is dead: nothing more reaches the file
                out[i].written = total;
                out[i].sync_err = EIO;
                continue;
            }
            FaultKind kind = fault.kind;
            uint64_t allow = total;
            if (kind == FaultKind::Short || kind == FaultKind::NoSpace || kind == FaultKind::Crash)
                allow = std::min(total, fault.keep);
            if (kind == FaultKind::Short && allow == total) kind = FaultKind::None;  // nothing to cut
            if (kind == FaultKind::None && max_write_ > 0 && max_write_ < total) {
                kind = FaultKind::Short;
                allow = max_write_;
            }
            if (kind != FaultKind::Crash && allow > space_) {
                allow = space_;
                kind = FaultKind::NoSpace;
            }
            if (kind != FaultKind::None) ++fired_;
            uint64_t done = 0;
            if (int e = pwrite_prefix(w, allow, &done); e != 0) {
                out[i].written = done;
                out[i].write_err = e;
                out[i].sync_err = ECANCELED;
                f.dirty_lo = std::min(f.dirty_lo, w.offset);
                continue;
            }
            if (space_ != UINT64_MAX) space_ -= allow;
            if (allow > 0) f.dirty_lo = std::min(f.dirty_lo, w.offset);
            switch (kind) {
                case FaultKind::None:
                    out[i].written = total;
                    if (::fdatasync(w.fd) != 0) {
                        out[i].sync_err = errno;
                    } else {
                        f.durable = read_all(f.path);
                        f.dirty_lo = UINT64_MAX;
                    }
                    break;
                case FaultKind::Short:
                    out[i].written = allow;
                    out[i].sync_err = ECANCELED;
                    break;
                case FaultKind::NoSpace:
                    out[i].written = allow;
                    out[i].write_err = ENOSPC;
                    out[i].sync_err = ECANCELED;
                    break;
                case FaultKind::SyncEio:
                    out[i].written = total;
                    out[i].sync_err = EIO;
                    if (fault.drop) {
                        // The kernel marks the pages it could not write clean and
                        // drops them: a re-read shows the content of the last sync
                        // (zeros past its end, the size having reached the disk).
                        drop_unsynced(f, w.fd);
                    }
                    break;
                case FaultKind::Crash:
                    out[i].written = total;
                    out[i].sync_err = EIO;
                    crashed_ = true;
                    break;
            }
        }
    }

private:
    struct File {
        int fd = -1;
        ino_t ino = 0;
        std::string path;
        std::vector<uint8_t> durable;   // the content at the last successful sync
        uint64_t dirty_lo = UINT64_MAX;  // the lowest offset written since
    };

    static uint64_t current_size(const std::string& path) {
        struct stat st {};
        return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    }
    static std::vector<uint8_t> read_all(const std::string& path) { return read_file_bytes(path); }
    static std::string path_of(int fd) {
        char link[64], buf[PATH_MAX];
        std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        const ssize_t n = ::readlink(link, buf, sizeof buf - 1);
        return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
    }
    // The file's tracking. A file first seen here is durable as it is: the log hands
    // over only files it created or recovered and synced.
    // A file seen again through another fd, as another inode, or cut shorter than
    // its durable bytes behind the device's back (recovery cut a torn tail) starts over.
    File& file_for(int fd) {
        const std::string path = path_of(fd);
        struct stat st {};
        ::fstat(fd, &st);
        File& f = files_[path];
        if (f.fd != fd || f.ino != st.st_ino || static_cast<uint64_t>(st.st_size) < f.durable.size()) {
            f.fd = fd;
            f.ino = st.st_ino;
            f.path = path;
            f.durable = read_all(path);
            f.dirty_lo = UINT64_MAX;
        }
        return f;
    }
    // pwritev of the first `n` bytes of the op's iov (continuing the kernel's own
    // short writes); 0 or the errno that stopped it.
    static int pwrite_prefix(const LogWrite& w, uint64_t n, uint64_t* done) {
        std::vector<iovec> iov;
        uint64_t left = n;
        for (const iovec& v : w.iov) {
            if (left == 0) break;
            const size_t k = static_cast<size_t>(std::min<uint64_t>(left, v.iov_len));
            if (k > 0) iov.push_back({v.iov_base, k});
            left -= k;
        }
        size_t first = 0;
        while (*done < n) {
            const int cnt = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
            const ssize_t r = ::pwritev(w.fd, iov.data() + first, cnt, static_cast<off_t>(w.offset + *done));
            if (r < 0) {
                if (errno == EINTR) continue;
                return errno;
            }
            *done += static_cast<uint64_t>(r);
            size_t adv = static_cast<size_t>(r);
            while (adv > 0) {
                if (adv >= iov[first].iov_len) {
                    adv -= iov[first].iov_len;
                    ++first;
                } else {
                    iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + adv;
                    iov[first].iov_len -= adv;
                    adv = 0;
                }
            }
        }
        return 0;
    }
    void drop_unsynced(File& f, int fd) {
        if (f.dirty_lo == UINT64_MAX) return;
        const uint64_t hi = current_size(f.path);
        std::vector<uint8_t> old(hi > f.dirty_lo ? hi - f.dirty_lo : 0, 0);
        for (uint64_t o = f.dirty_lo; o < hi && o < f.durable.size(); ++o) old[o - f.dirty_lo] = f.durable[o];
        if (!old.empty() && ::pwrite(fd, old.data(), old.size(), static_cast<off_t>(f.dirty_lo)) !=
                                static_cast<ssize_t>(old.size()))
            std::abort();
        if (::fdatasync(fd) != 0) std::abort();
        f.durable = read_all(f.path);
        f.dirty_lo = UINT64_MAX;
    }

    mutable std::mutex mu_;
    std::map<std::string, File> files_;
    std::map<uint64_t, Fault> by_op_;
    std::map<std::string, std::deque<Fault>> by_path_;
    uint64_t space_ = UINT64_MAX;
    uint64_t max_write_ = 0;
    uint64_t ops_seen_ = 0, fired_ = 0, calls_ = 0;
    bool crashed_ = false;
};

}  // namespace duet::kvtest
