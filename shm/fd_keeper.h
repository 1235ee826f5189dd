// Keeps file descriptors for the processes of an instance and hands them out over a
// Unix socket (SCM_RIGHTS). This is how a GPU KV arena reaches every process that
// maps it: the worker that creates it (cuMemCreate with a POSIX-fd handle type,
// exported with cuMemExportToShareableHandle) deposits the fd here, the others, and
// any restarted process, fetch it. Memory behind such an fd is freed only when
// every descriptor and mapping of it is gone, so with the keeper (in the launcher)
// holding one for the instance's life, the arena survives the death of any process
// that maps it. (pidfd_getfd would need ptrace rights, which container profiles
// often deny; FACTS.md, CUDA IPC.)
//
// The socket lives in the abstract namespace, "\0duet.<instance>.fds": nothing to
// leave behind in the file system, gone with the keeper. Only processes of the
// keeper's user are served (SO_PEERCRED). One request per connection; SEQPACKET
// keeps message boundaries; every wait has a timeout.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "base/result.h"

namespace duet::shm {

inline constexpr size_t kFdKeyBytes = 64;    // key length limit (incl. NUL)
inline constexpr size_t kFdMetaBytes = 192;  // what travels with an fd (size, device, ...)

class FdKeeper {
public:
    // Binds the instance's socket (an error if another keeper has it) and serves on
    // a thread of its own.
    static Result<std::unique_ptr<FdKeeper>> start(const std::string& instance);
    ~FdKeeper();  // stops serving, closes every kept descriptor
    FdKeeper(const FdKeeper&) = delete;
    FdKeeper& operator=(const FdKeeper&) = delete;

    size_t size() const;  // descriptors kept
    uint64_t refused() const { return refused_.load(); }  // malformed or foreign requests answered with an error

private:
    FdKeeper() = default;
    void serve();
    void handle(int conn);

    int listen_fd_ = -1;
    int stop_fd_ = -1;  // eventfd: wakes the thread to stop
    std::thread thread_;
    mutable std::atomic<size_t> size_{0};
    std::atomic<uint64_t> refused_{0};
    struct Kept {
        int fd;
        std::string meta;
    };
    std::map<std::string, Kept> kept_;  // the serving thread's alone
};

// A descriptor received from the keeper (the caller owns it) and its metadata.
struct KeptFd {
    int fd = -1;
    std::string meta;
};

// Deposits fd under key (the keeper keeps a duplicate; the caller's fd stays its
// own) and returns what the keeper holds for key: the one deposited, or the one
// somebody deposited first (so two processes racing to create an arena agree on
// one, and the loser frees its own).
Result<KeptFd> fd_put(const std::string& instance, const std::string& key, int fd, const std::string& meta,
                      int timeout_ms = 2000);
// What the keeper holds for key. An error that says "not kept" when nobody has
// deposited it, and "no fd keeper" when the instance has none running.
Result<KeptFd> fd_get(const std::string& instance, const std::string& key, int timeout_ms = 2000);

}  // namespace duet::shm
