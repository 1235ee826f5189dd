#include "base/trace.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>

#if DUET_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace duet::trace {

namespace {

constexpr size_t kFlushBytes = 64 << 10;
constexpr uint64_t kFlushNs = 200'000'000;
constexpr const char* kOpening = "[\n";

// The process's trace file: its fd, its buffer of whole lines, and the tracks of
// events measured elsewhere. `on` is read without the lock by every Range.
struct Sink {
    std::atomic<bool> on{false};
    std::mutex mu;
    int fd = -1;
    std::string buf;
    uint64_t flushed_ns = 0;
    std::map<std::string, uint32_t> tracks;
    bool atexit_set = false;
};

Sink& sink() {
    static Sink* s = new Sink;  // never destroyed: ranges may end during exit
    return *s;
}

// Writes all of data, retrying short writes and EINTR; false on an error.
bool write_all(int fd, const char* data, size_t n) {
    while (n > 0) {
        const ssize_t w = ::write(fd, data, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        data += w;
        n -= static_cast<size_t>(w);
    }
    return true;
}

// Appends buf to the file in one write (the lines of one process stay together) and
// empties it. Called with the lock held.
void flush_locked(Sink& s, uint64_t now) {
    if (s.fd >= 0 && !s.buf.empty()) (void)write_all(s.fd, s.buf.data(), s.buf.size());
    s.buf.clear();
    s.flushed_ns = now;
}

// ts / dur in microseconds with nanosecond digits, as the format takes them.
void put_us(std::string& out, uint64_t ns) {
    char b[32];
    const int n = std::snprintf(b, sizeof b, "%llu.%03llu", static_cast<unsigned long long>(ns / 1000),
                                static_cast<unsigned long long>(ns % 1000));
    out.append(b, static_cast<size_t>(n));
}

// A JSON string's characters: printable ASCII as it is, '"' and '\\' and control
// characters escaped, any other byte '?' (process names are ASCII; a byte of a UTF-8
// sequence alone would make the file invalid JSON).
void put_json_string(std::string& out, const std::string& s) {
    out += '"';
    for (const char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            char b[8];
            std::snprintf(b, sizeof b, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
            out += b;
        } else if (static_cast<unsigned char>(c) >= 0x7F) {
            out += '?';
        } else {
            out += c;
        }
    }
    out += '"';
}

// A complete event into the buffer, which is written out when due (kFlushBytes,
// kFlushNs). Called with the lock held.
void add_complete(Sink& s, const char* what, uint64_t t0, uint64_t t1, long tid) {
    std::string& o = s.buf;
    o += "{\"name\":\"";
    o += what;
    o += "\",\"ph\":\"X\",\"ts\":";
    put_us(o, t0);
    o += ",\"dur\":";
    put_us(o, t1 - t0);
    o += ",\"pid\":";
    o += std::to_string(::getpid());
    o += ",\"tid\":";
    o += std::to_string(tid);
    o += "},\n";
    const uint64_t now = now_ns();
    if (o.size() >= kFlushBytes || now - s.flushed_ns >= kFlushNs) flush_locked(s, now);
}

void add_metadata(Sink& s, const char* kind, long tid, const std::string& name) {
    std::string& o = s.buf;
    o += "{\"name\":\"";
    o += kind;
    o += "\",\"ph\":\"M\",\"pid\":";
    o += std::to_string(::getpid());
    o += ",\"tid\":";
    o += std::to_string(tid);
    o += ",\"args\":{\"name\":";
    put_json_string(o, name);
    o += "}},\n";
}

long this_tid() {
    thread_local const long tid = static_cast<long>(::syscall(SYS_gettid));
    return tid;
}

// Creates path holding the array's opening unless it exists: the opening is written
// to a file of this process's own, which is then linked into place, so that of
// processes starting at once none can append before the opening is there.
Status create_file(const std::string& path) {
    const std::string tmp = path + ".opening." + std::to_string(::getpid());
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return make_error("trace file {}: {}", tmp, std::strerror(errno));
    const bool ok = write_all(fd, kOpening, std::strlen(kOpening));
    const int e = errno;
    ::close(fd);
    if (!ok) {
        ::unlink(tmp.c_str());
        return make_error("trace file {}: {}", tmp, std::strerror(e));
    }
    const int linked = ::link(tmp.c_str(), path.c_str());
    const int le = errno;
    ::unlink(tmp.c_str());
    if (linked != 0 && le != EEXIST) return make_error("trace file {}: {}", path, std::strerror(le));
    return {};
}

// Opens path for appending, created with the array's opening if it is not there.
Result<int> open_file(const std::string& path) {
    if (Status st = create_file(path); !st) return st.error();
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd < 0) return make_error("trace file {}: {}", path, std::strerror(errno));
    return fd;
}

}  // namespace

uint64_t now_ns() {
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

#if DUET_NVTX
bool compiled_in() { return true; }
#else
bool compiled_in() { return false; }
#endif

Range::Range(const char* what) : what_(what) {
#if DUET_NVTX
    nvtxRangePushA(what);
#endif
    if (sink().on.load(std::memory_order_relaxed)) t0_ = now_ns();
}

Range::~Range() {
#if DUET_NVTX
    nvtxRangePop();
#endif
    if (t0_ != 0) span(what_, t0_, now_ns());
}

Status start_file(const std::string& path) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
        return make_error("trace file {}: {}", path, std::strerror(errno));
    return create_file(path);
}

Status open(const std::string& path, const std::string& process) {
    auto fd = open_file(path);
    if (!fd) return fd.error();
    Sink& s = sink();
    {
        std::lock_guard<std::mutex> l(s.mu);
        flush_locked(s, now_ns());
        if (s.fd >= 0) ::close(s.fd);
        s.fd = *fd;
        s.tracks.clear();
        add_metadata(s, "process_name", static_cast<long>(::getpid()), process);
        flush_locked(s, now_ns());
        if (!s.atexit_set) {
            s.atexit_set = true;
            std::atexit([] { flush(); });
        }
    }
    s.on.store(true, std::memory_order_relaxed);
    return {};
}

Status open_from_env(const std::string& process) {
    const char* path = std::getenv("DUET_TRACE");
    if (path == nullptr || *path == '\0') return {};
    return open(path, process);
}

bool active() { return sink().on.load(std::memory_order_relaxed); }

void span(const char* what, uint64_t start_ns, uint64_t end_ns) {
    Sink& s = sink();
    if (!s.on.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> l(s.mu);
    if (s.fd < 0) return;
    add_complete(s, what, start_ns, end_ns, this_tid());
}

void event(const char* what, uint64_t start_ns, uint64_t dur_ns, const char* track) {
    Sink& s = sink();
    if (!s.on.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> l(s.mu);
    if (s.fd < 0) return;
    auto [it, fresh] = s.tracks.emplace(track, static_cast<uint32_t>(s.tracks.size()));
    // Tracks of measured events: tids no thread of a process has (above pid_max).
    const long tid = (1L << 22) + 1 + static_cast<long>(it->second);
    if (fresh) add_metadata(s, "thread_name", tid, track);
    add_complete(s, what, start_ns, start_ns + dur_ns, tid);
}

void flush() {
    Sink& s = sink();
    std::lock_guard<std::mutex> l(s.mu);
    flush_locked(s, now_ns());
}

Status finish_file(const std::string& path) {
    {
        Sink& s = sink();  // this process writes no more to any file
        s.on.store(false, std::memory_order_relaxed);
        std::lock_guard<std::mutex> l(s.mu);
        flush_locked(s, now_ns());
        if (s.fd >= 0) ::close(s.fd);
        s.fd = -1;
    }
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd < 0) return make_error("trace file {}: {}", path, std::strerror(errno));
    std::string end = "{\"name\":\"trace end\",\"ph\":\"i\",\"s\":\"g\",\"ts\":";
    put_us(end, now_ns());
    end += ",\"pid\":" + std::to_string(::getpid()) + ",\"tid\":" + std::to_string(this_tid()) + "}\n]\n";
    const bool ok = write_all(fd, end.data(), end.size());
    const int e = errno;
    ::close(fd);
    if (!ok) return make_error("trace file {}: {}", path, std::strerror(e));
    return {};
}

}  // namespace duet::trace
