// A named shared-memory segment: /dev/shm/<name> (or /dev/hugepages/<name> when
// explicit huge pages are available), with a header that says what it holds.
//
// Why shm_open + mmap and not Boost.Interprocess: we need the page mode (hugetlbfs,
// transparent huge pages), the file mode, and open-file-description locks on the
// segment's own fd for liveness, and we use none of Boost's allocators or mutexes
// (a process dying inside a Boost.Interprocess mutex wedges every other user).
//
// Liveness: every process that has the segment mapped holds an OFD read lock on
// byte 0 of its file; the creator holds a write lock while it initializes, then
// converts it to a read lock (atomic for fcntl locks). The kernel drops the lock
// when the process dies, however it dies. A segment whose byte 0 can be
// write-locked has no live user: create() replaces it (never reuses it), open()
// refuses it as stale. Segments must belong to this process's user and not be
// writable by others: their contents are trusted.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "base/result.h"

namespace duet::shm {

inline constexpr uint64_t kSegmentMagic = 0x3174656d67657364ull;  // "dsegmet1"
inline constexpr size_t kSegmentHeaderBytes = 4096;               // payload starts here

enum class PageMode { Small, TransparentHuge, HugeTlb };
const char* page_mode_name(PageMode m);

struct SegmentHeader {
    uint64_t magic;  // written last, with release order, when the segment is ready
    uint32_t layout_version;
    uint32_t header_bytes;
    uint64_t config_fingerprint;
    uint64_t total_bytes;
    int32_t creator_pid;
    uint32_t reserved;
    uint64_t created_unix_ns;
};

struct SegmentOptions {
    size_t payload_bytes = 0;  // bytes after the header
    uint32_t layout_version = 0;
    uint64_t config_fingerprint = 0;
    bool huge_pages = true;  // try hugetlbfs, then transparent huge pages, then 4 KiB pages
    mode_t mode = 0600;
    // Formats the payload before the segment gets its public name, so nobody can
    // attach to a half-made one. May be empty.
    std::function<Status(uint8_t* payload, size_t bytes)> init;
};

class Segment {
public:
    // Creates the segment. A stale one of the same name (no live process attached)
    // is replaced; a live one is an error naming its creator's pid.
    static Result<Segment> create(const std::string& name, const SegmentOptions& opts);
    // Attaches to a ready segment made with this layout version and fingerprint
    // (any fingerprint when check_fingerprint is false: for tools that read the
    // configuration from the segment itself).
    static Result<Segment> open(const std::string& name, uint32_t layout_version, uint64_t config_fingerprint,
                                bool check_fingerprint = true);
    // Removes the name (mappings stay valid until unmapped). Missing is not an error.
    static Status unlink(const std::string& name);
    // True when a segment of this name exists and a live process is attached to it.
    static bool in_use(const std::string& name);
    // Removes the segment (from /dev/shm and /dev/hugepages) and any half-made
    // temporary of it, if no live process is attached. True if something was removed.
    static Result<bool> remove_if_stale(const std::string& name);

    Segment() = default;
    ~Segment();
    Segment(Segment&& o) noexcept;
    Segment& operator=(Segment&& o) noexcept;
    Segment(const Segment&) = delete;
    Segment& operator=(const Segment&) = delete;

    const std::string& name() const { return name_; }
    const std::string& path() const { return path_; }
    PageMode page_mode() const { return page_mode_; }
    const SegmentHeader& header() const { return *static_cast<const SegmentHeader*>(base_); }
    uint8_t* payload() const { return static_cast<uint8_t*>(base_) + kSegmentHeaderBytes; }
    size_t payload_bytes() const { return size_ - kSegmentHeaderBytes; }
    bool replaced_stale() const { return replaced_stale_; }

private:
    void reset();

    std::string name_;
    std::string path_;
    int fd_ = -1;
    void* base_ = nullptr;
    size_t size_ = 0;
    PageMode page_mode_ = PageMode::Small;
    bool replaced_stale_ = false;
};

}  // namespace duet::shm
