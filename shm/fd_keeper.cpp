#include "shm/fd_keeper.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <vector>

namespace duet::shm {

namespace {

constexpr uint32_t kFdMagic = 0x6b646664;  // "dfdk"
enum : uint32_t { kOpPut = 1, kOpGet = 2 };
enum : uint32_t { kOk = 0, kNotKept = 1, kBad = 2 };

struct FdMsg {
    uint32_t magic;
    uint32_t op;  // request: kOpPut / kOpGet; reply: kOk / kNotKept / kBad
    uint32_t meta_len;
    uint32_t pad;
    char key[kFdKeyBytes];
    char meta[kFdMetaBytes];
};

Result<sockaddr_un> address(const std::string& instance, socklen_t* len) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string name = "duet." + instance + ".fds";
    if (name.size() + 1 > sizeof a.sun_path)
        return make_error("instance name '{}' is too long for an fd keeper socket", instance);
    std::memcpy(a.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract namespace
    *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return a;
}

void set_timeouts(int fd, int timeout_ms) {
    timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// Sends m, with `fd` attached when >= 0.
bool send_msg(int sock, const FdMsg& m, int fd) {
    iovec iov{const_cast<FdMsg*>(&m), sizeof m};
    msghdr h{};
    h.msg_iov = &iov;
    h.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    if (fd >= 0) {
        h.msg_control = control;
        h.msg_controllen = sizeof control;
        cmsghdr* c = CMSG_FIRSTHDR(&h);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    return sendmsg(sock, &h, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof m);
}

// Receives one message and the descriptors that came with it (all of them, so that
// none leaks when the message is refused). Returns the bytes read, or -1.
ssize_t recv_msg(int sock, FdMsg& m, std::vector<int>& fds) {
    iovec iov{&m, sizeof m};
    msghdr h{};
    h.msg_iov = &iov;
    h.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
    h.msg_control = control;
    h.msg_controllen = sizeof control;
    const ssize_t n = recvmsg(sock, &h, MSG_CMSG_CLOEXEC);
    if (n < 0) return -1;
    for (cmsghdr* c = CMSG_FIRSTHDR(&h); c; c = CMSG_NXTHDR(&h, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; ++i) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            fds.push_back(fd);
        }
    }
    if (h.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) return -1;  // more than a message holds: refused
    return n;
}

FdMsg reply(uint32_t status, const std::string& key = {}, const std::string& meta = {}) {
    FdMsg m{};
    m.magic = kFdMagic;
    m.op = status;
    std::memcpy(m.key, key.data(), std::min(key.size(), kFdKeyBytes - 1));
    m.meta_len = static_cast<uint32_t>(std::min(meta.size(), kFdMetaBytes));
    std::memcpy(m.meta, meta.data(), m.meta_len);
    return m;
}

Result<KeptFd> exchange(const std::string& instance, uint32_t op, const std::string& key, int fd,
                        const std::string& meta, int timeout_ms) {
    if (key.empty() || key.size() >= kFdKeyBytes)
        return make_error("fd key '{}': 1 to {} bytes", key, kFdKeyBytes - 1);
    if (meta.size() > kFdMetaBytes) return make_error("fd metadata of {} bytes: at most {}", meta.size(), kFdMetaBytes);
    socklen_t len = 0;
    auto addr = address(instance, &len);
    if (!addr) return addr.error();
    const int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) return make_error("socket: {}", std::strerror(errno));
    set_timeouts(s, timeout_ms);
    auto fail = [&](std::string why) {
        close(s);
        return make_error("fd keeper of instance {}: {}", instance, why);
    };
    if (connect(s, reinterpret_cast<const sockaddr*>(&*addr), len) != 0) {
        if (errno == ECONNREFUSED || errno == ENOENT) return fail("no fd keeper is running");
        return fail(fmt::format("connect: {}", std::strerror(errno)));
    }
    FdMsg m = reply(op, key, meta);
    if (!send_msg(s, m, fd)) return fail(fmt::format("send: {}", std::strerror(errno)));
    FdMsg r{};
    std::vector<int> fds;
    const ssize_t n = recv_msg(s, r, fds);
    const int err = errno;
    close(s);
    auto drop = [&] {
        for (int f : fds) close(f);
    };
    if (n < 0) {
        drop();
        return make_error("fd keeper of instance {}: {}", instance,
                          err == EAGAIN ? fmt::format("no answer within {} ms", timeout_ms) : std::strerror(err));
    }
    if (n != static_cast<ssize_t>(sizeof r) || r.magic != kFdMagic || r.meta_len > kFdMetaBytes) {
        drop();
        return make_error("fd keeper of instance {}: malformed answer", instance);
    }
    if (r.op == kNotKept) {
        drop();
        return make_error("fd keeper of instance {}: '{}' is not kept", instance, key);
    }
    if (r.op != kOk || fds.size() != 1) {
        drop();
        return make_error("fd keeper of instance {}: request for '{}' refused", instance, key);
    }
    return KeptFd{fds[0], std::string(r.meta, r.meta_len)};
}

}  // namespace

Result<std::unique_ptr<FdKeeper>> FdKeeper::start(const std::string& instance) {
    socklen_t len = 0;
    auto addr = address(instance, &len);
    if (!addr) return addr.error();
    std::unique_ptr<FdKeeper> k(new FdKeeper());
    k->listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (k->listen_fd_ < 0) return make_error("socket: {}", std::strerror(errno));
    if (bind(k->listen_fd_, reinterpret_cast<const sockaddr*>(&*addr), len) != 0)
        return make_error("fd keeper of instance {}: {}", instance,
                          errno == EADDRINUSE ? std::string("another keeper is running") : std::strerror(errno));
    if (listen(k->listen_fd_, 64) != 0) return make_error("listen: {}", std::strerror(errno));
    k->stop_fd_ = eventfd(0, EFD_CLOEXEC);
    if (k->stop_fd_ < 0) return make_error("eventfd: {}", std::strerror(errno));
    k->thread_ = std::thread([p = k.get()] { p->serve(); });
    return k;
}

FdKeeper::~FdKeeper() {
    if (thread_.joinable()) {
        const uint64_t one = 1;
        (void)!write(stop_fd_, &one, sizeof one);
        thread_.join();
    }
    for (auto& [key, k] : kept_) close(k.fd);
    if (listen_fd_ >= 0) close(listen_fd_);
    if (stop_fd_ >= 0) close(stop_fd_);
}

size_t FdKeeper::size() const { return size_.load(); }

void FdKeeper::serve() {
    for (;;) {
        pollfd p[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return;
        }
        if (p[1].revents) return;
        if (!(p[0].revents & POLLIN)) continue;
        const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (conn < 0) continue;
        handle(conn);
        close(conn);
    }
}

void FdKeeper::handle(int conn) {
    set_timeouts(conn, 1000);  // a client that connects and says nothing holds no one up for long
    ucred who{};
    socklen_t wl = sizeof who;
    FdMsg m{};
    std::vector<int> fds;
    const ssize_t n = recv_msg(conn, m, fds);
    const bool same_user = getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &who, &wl) == 0 && who.uid == getuid();
    const bool well_formed = n == static_cast<ssize_t>(sizeof m) && m.magic == kFdMagic && m.meta_len <= kFdMetaBytes &&
                             std::memchr(m.key, 0, kFdKeyBytes) != nullptr && m.key[0] != 0 &&
                             ((m.op == kOpPut && fds.size() == 1) || (m.op == kOpGet && fds.empty()));
    if (!same_user || !well_formed) {
        for (int f : fds) close(f);
        refused_.fetch_add(1);
        (void)send_msg(conn, reply(kBad), -1);
        return;
    }
    const std::string key(m.key);
    auto it = kept_.find(key);
    if (m.op == kOpPut) {
        if (it == kept_.end()) {  // the first deposit wins; a later one gets it back
            it = kept_.emplace(key, Kept{fds[0], std::string(m.meta, m.meta_len)}).first;
            size_.store(kept_.size());
        } else {
            close(fds[0]);
        }
    }
    if (it == kept_.end()) {
        (void)send_msg(conn, reply(kNotKept, key), -1);
        return;
    }
    (void)send_msg(conn, reply(kOk, key, it->second.meta), it->second.fd);
}

Result<KeptFd> fd_put(const std::string& instance, const std::string& key, int fd, const std::string& meta,
                      int timeout_ms) {
    if (fd < 0) return make_error("fd_put '{}': no descriptor", key);
    return exchange(instance, kOpPut, key, fd, meta, timeout_ms);
}

Result<KeptFd> fd_get(const std::string& instance, const std::string& key, int timeout_ms) {
    return exchange(instance, kOpGet, key, -1, {}, timeout_ms);
}

}  // namespace duet::shm
