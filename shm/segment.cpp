#include "shm/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

namespace duet::shm {

namespace {

constexpr long kHugetlbfsMagic = 0x958458f6;
constexpr size_t kHugePage = 2u << 20;
const char* const kShmDir = "/dev/shm/";
const char* const kHugeDir = "/dev/hugepages/";

std::string errno_str(int e) { return std::strerror(e); }

bool valid_name(const std::string& n) {
    if (n.empty() || n.size() > 200 || n[0] == '.') return false;
    for (char c : n)
        if (!(isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
    return true;
}

// OFD locks on byte 0: owned by the open file description, dropped when the last fd
// of it closes (so at process death), converted atomically between read and write.
bool lock_byte0(int fd, short type) {
    struct flock fl {};
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = 0;
    fl.l_len = 1;
    return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}

size_t read_size_t(const char* path) {
    std::ifstream f(path);
    size_t v = 0;
    f >> v;
    return f ? v : 0;
}

bool hugetlbfs_fits(size_t bytes) {
    struct statfs st {};
    if (statfs(kHugeDir, &st) != 0 || st.f_type != kHugetlbfsMagic) return false;
    if (access(kHugeDir, W_OK) != 0) return false;
    size_t free_pages = read_size_t("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages");
    return free_pages * kHugePage >= bytes;
}

bool shmem_thp_enabled() {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
    std::string line;
    std::getline(f, line);
    for (const char* m : {"[always]", "[within_size]", "[advise]", "[force]"})
        if (line.find(m) != std::string::npos) return true;
    return false;
}

uint64_t unix_ns() {
    timespec ts{};
    clock_gettime(CLOCK_REALTIME, &ts);
    return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Reads the creator pid of a segment file for messages; -1 when unreadable.
int creator_pid_of(int fd) {
    SegmentHeader h{};
    if (pread(fd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h) || h.magic != kSegmentMagic) return -1;
    return h.creator_pid;
}

// The name still refers to the file open as fd (nobody replaced it meanwhile).
bool same_file(int fd, const std::string& path) {
    struct stat a {}, b {};
    return fstat(fd, &a) == 0 && ::stat(path.c_str(), &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

// Segments are trusted memory: refuse one that another user made or can write.
Status check_owner(int fd, const std::string& path) {
    struct stat st {};
    if (fstat(fd, &st) != 0) return make_error("cannot stat {}: {}", path, errno_str(errno));
    if (st.st_uid != geteuid())
        return make_error("{} belongs to uid {}, not to this process's uid {}: refusing it", path, st.st_uid,
                          geteuid());
    if (st.st_mode & S_IWOTH) return make_error("{} is writable by other users (mode {:o}): refusing it", path,
                                                st.st_mode & 07777);
    return {};
}

// Either removes `path` as stale (no process holds a lock on it) or reports that it is
// live. ENOENT counts as removed.
Status clear_if_stale(const std::string& path, bool* replaced) {
    for (int attempt = 0; attempt < 8; ++attempt) {
        int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) {
            if (errno == ENOENT) return {};
            return make_error("cannot open existing segment {}: {}", path, errno_str(errno));
        }
        if (Status st = check_owner(fd, path); !st) {
            ::close(fd);
            return st;
        }
        if (!lock_byte0(fd, F_WRLCK)) {
            int pid = creator_pid_of(fd);
            ::close(fd);
            return make_error("shared-memory segment {} is in use by a live instance (created by pid {}); "
                              "stop that instance or choose another instance name",
                              path, pid);
        }
        // Another creator may have replaced the stale file with a live one between our
        // open and our lock: then the lock we hold is on the old file. Look again.
        if (!same_file(fd, path)) {
            ::close(fd);
            continue;
        }
        // Nobody is attached: a dead instance's segment. Never reuse it.
        int rc = ::unlink(path.c_str());
        int e = errno;
        ::close(fd);
        if (rc != 0 && e != ENOENT) return make_error("cannot remove the stale segment {}: {}", path, errno_str(e));
        *replaced = true;
        return {};
    }
    return make_error("{} keeps being replaced by other processes; try again", path);
}

// Removes `.<name>.tmp.<pid>` files that creators died with (no lock held on them).
void clear_stale_tmp(const char* dir, const std::string& name) {
    DIR* d = opendir(dir);
    if (!d) return;
    const std::string prefix = "." + name + ".tmp.";
    while (dirent* e = readdir(d)) {
        std::string f = e->d_name;
        if (f.rfind(prefix, 0) != 0) continue;
        std::string path = std::string(dir) + f;
        int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        if (check_owner(fd, path).ok() && lock_byte0(fd, F_WRLCK) && same_file(fd, path)) ::unlink(path.c_str());
        ::close(fd);
    }
    closedir(d);
}

}  // namespace

const char* page_mode_name(PageMode m) {
    switch (m) {
    case PageMode::Small: return "4 KiB pages";
    case PageMode::TransparentHuge: return "transparent huge pages";
    case PageMode::HugeTlb: return "hugetlbfs 2 MiB pages";
    }
    return "?";
}

Segment::~Segment() { reset(); }

void Segment::reset() {
    if (base_) munmap(base_, size_);
    if (fd_ >= 0) ::close(fd_);
    base_ = nullptr;
    fd_ = -1;
}

Segment::Segment(Segment&& o) noexcept { *this = std::move(o); }

Segment& Segment::operator=(Segment&& o) noexcept {
    if (this != &o) {
        reset();
        name_ = std::move(o.name_);
        path_ = std::move(o.path_);
        fd_ = o.fd_;
        base_ = o.base_;
        size_ = o.size_;
        page_mode_ = o.page_mode_;
        replaced_stale_ = o.replaced_stale_;
        o.fd_ = -1;
        o.base_ = nullptr;
    }
    return *this;
}

Result<Segment> Segment::create(const std::string& name, const SegmentOptions& opts) {
    if (!valid_name(name))
        return make_error("bad segment name '{}': expected 1-200 characters of [A-Za-z0-9._-], not starting with '.'",
                          name);
    Segment s;
    s.name_ = name;
    for (const char* dir : {kShmDir, kHugeDir}) {
        if (Status st = clear_if_stale(std::string(dir) + name, &s.replaced_stale_); !st) return st.error();
        clear_stale_tmp(dir, name);
    }

    const size_t small_size = (kSegmentHeaderBytes + opts.payload_bytes + 4095) / 4096 * 4096;
    const size_t huge_size = (small_size + kHugePage - 1) / kHugePage * kHugePage;
    bool try_hugetlb = opts.huge_pages && hugetlbfs_fits(huge_size);
    std::string tmp;
    size_t size = 0;
    auto fail = [&](std::string what) -> Result<Segment> {
        int e = errno;
        ::unlink(tmp.c_str());
        return make_error("{} {}: {}", what, tmp, errno_str(e));
    };
    for (;;) {
        const char* dir = try_hugetlb ? kHugeDir : kShmDir;
        size = try_hugetlb ? huge_size : small_size;
        s.page_mode_ = try_hugetlb ? PageMode::HugeTlb
                       : (opts.huge_pages && shmem_thp_enabled()) ? PageMode::TransparentHuge
                                                                  : PageMode::Small;
        // Built under a private name and linked into place only when ready, so the
        // public name never shows a half-initialized segment.
        tmp = std::string(dir) + "." + name + ".tmp." + std::to_string(getpid());
        s.path_ = std::string(dir) + name;
        ::unlink(tmp.c_str());
        s.fd_ = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, opts.mode);
        if (s.fd_ < 0) return make_error("cannot create {}: {}", tmp, errno_str(errno));
        if (fchmod(s.fd_, opts.mode) != 0) return fail("cannot set the mode of");
        if (!lock_byte0(s.fd_, F_WRLCK)) return fail("cannot lock");
        bool ok = ftruncate(s.fd_, static_cast<off_t>(size)) == 0;
        if (ok) {
            s.base_ = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd_, 0);
            ok = s.base_ != MAP_FAILED;
            if (!ok) s.base_ = nullptr;
        }
        if (ok) break;
        if (!try_hugetlb) return fail("cannot size or map");
        // Huge pages taken by someone else since we looked: fall back to tmpfs.
        ::unlink(tmp.c_str());
        ::close(s.fd_);
        s.fd_ = -1;
        try_hugetlb = false;
    }
    s.size_ = size;
    if (s.page_mode_ == PageMode::TransparentHuge && madvise(s.base_, size, MADV_HUGEPAGE) != 0)
        s.page_mode_ = PageMode::Small;

    if (opts.init) {
        if (Status st = opts.init(s.payload(), s.payload_bytes()); !st) {
            ::unlink(tmp.c_str());
            return st.error();
        }
    }
    auto* h = static_cast<SegmentHeader*>(s.base_);
    h->layout_version = opts.layout_version;
    h->header_bytes = kSegmentHeaderBytes;
    h->config_fingerprint = opts.config_fingerprint;
    h->total_bytes = size;
    h->creator_pid = getpid();
    h->created_unix_ns = unix_ns();
    // Pairs with the acquire load in open(): everything above is visible to an
    // opener that sees the magic.
    std::atomic_ref<uint64_t>(h->magic).store(kSegmentMagic, std::memory_order_release);
    if (!lock_byte0(s.fd_, F_RDLCK)) return fail("cannot downgrade the lock of");
    if (::link(tmp.c_str(), s.path_.c_str()) != 0) {
        int e = errno;
        ::unlink(tmp.c_str());
        if (e == EEXIST)
            return make_error("shared-memory segment {} was created by another process at the same time", s.path_);
        return make_error("cannot link {} to {}: {}", tmp, s.path_, errno_str(e));
    }
    ::unlink(tmp.c_str());
    return s;
}

Result<Segment> Segment::open(const std::string& name, uint32_t layout_version, uint64_t config_fingerprint,
                              bool check_fingerprint) {
    if (!valid_name(name)) return make_error("bad segment name '{}'", name);
    Segment s;
    s.name_ = name;
    for (const char* dir : {kShmDir, kHugeDir}) {
        s.path_ = std::string(dir) + name;
        s.fd_ = ::open(s.path_.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (s.fd_ >= 0) {
            s.page_mode_ = dir == kHugeDir ? PageMode::HugeTlb : PageMode::Small;
            break;
        }
    }
    if (s.fd_ < 0)
        return make_error("no shared-memory segment named {} (in {} or {}): is the instance running?", name, kShmDir,
                          kHugeDir);
    if (Status st = check_owner(s.fd_, s.path_); !st) return st.error();
    // A write lock we can take means nobody is attached: a dead instance's segment.
    if (lock_byte0(s.fd_, F_WRLCK))
        return make_error("shared-memory segment {} is stale: the instance that made it (pid {}) is gone", s.path_,
                          creator_pid_of(s.fd_));
    // Read locks conflict only with a moment's write lock of a staleness check.
    bool locked = false;
    for (int i = 0; i < 1000 && !(locked = lock_byte0(s.fd_, F_RDLCK)); ++i)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (!locked) return make_error("cannot lock {}: {}", s.path_, errno_str(errno));
    struct stat a {}, b {};
    if (fstat(s.fd_, &a) != 0 || ::stat(s.path_.c_str(), &b) != 0 || a.st_ino != b.st_ino)
        return make_error("shared-memory segment {} was replaced while attaching; try again", s.path_);
    if (static_cast<size_t>(a.st_size) < kSegmentHeaderBytes)
        return make_error("{} is {} bytes, smaller than a segment header", s.path_, a.st_size);
    s.size_ = static_cast<size_t>(a.st_size);
    s.base_ = mmap(nullptr, s.size_, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd_, 0);
    if (s.base_ == MAP_FAILED) {
        s.base_ = nullptr;
        return make_error("cannot map {}: {}", s.path_, errno_str(errno));
    }
    auto* h = static_cast<SegmentHeader*>(s.base_);
    // Pairs with the release store in create().
    uint64_t magic = std::atomic_ref<uint64_t>(h->magic).load(std::memory_order_acquire);
    if (magic != kSegmentMagic)
        return make_error("{} is not a duet segment (magic {:#x}, expected {:#x})", s.path_, magic, kSegmentMagic);
    if (h->layout_version != layout_version)
        return make_error("{} has layout version {}, this build expects {}: restart the instance with this build",
                          s.path_, h->layout_version, layout_version);
    if (check_fingerprint && h->config_fingerprint != config_fingerprint)
        return make_error("{} was made with config fingerprint {:#018x}, this process has {:#018x}: "
                          "start it with the instance's configuration",
                          s.path_, h->config_fingerprint, config_fingerprint);
    if (h->total_bytes != s.size_)
        return make_error("{} is {} bytes but its header says {}", s.path_, s.size_, h->total_bytes);
    if (s.page_mode_ == PageMode::Small && shmem_thp_enabled()) s.page_mode_ = PageMode::TransparentHuge;
    return s;
}

Status Segment::unlink(const std::string& name) {
    if (!valid_name(name)) return make_error("bad segment name '{}'", name);
    for (const char* dir : {kShmDir, kHugeDir}) {
        std::string p = std::string(dir) + name;
        if (::unlink(p.c_str()) != 0 && errno != ENOENT) return make_error("cannot remove {}: {}", p, errno_str(errno));
    }
    return {};
}

Result<bool> Segment::remove_if_stale(const std::string& name) {
    if (!valid_name(name)) return make_error("bad segment name '{}'", name);
    bool removed = false;
    for (const char* dir : {kShmDir, kHugeDir}) {
        Status st = clear_if_stale(std::string(dir) + name, &removed);
        if (!st) {
            if (st.error().message.find("in use by a live instance") != std::string::npos) return false;
            return st.error();
        }
        clear_stale_tmp(dir, name);
    }
    return removed;
}

bool Segment::in_use(const std::string& name) {
    if (!valid_name(name)) return false;
    for (const char* dir : {kShmDir, kHugeDir}) {
        std::string p = std::string(dir) + name;
        int fd = ::open(p.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        bool live = !lock_byte0(fd, F_WRLCK);
        ::close(fd);
        if (live) return true;
    }
    return false;
}

}  // namespace duet::shm
