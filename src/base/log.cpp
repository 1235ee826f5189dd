#include "base/log.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace duet::log {

namespace {

struct Sink {
    std::mutex mu;
    std::string name;  // "decode", or empty
    int journal = -2;  // the journal's socket; -1: stderr; -2: not decided yet

    // JOURNAL_STREAM is "<dev>:<ino>" of the stream systemd connected stdout and
    // stderr to; it only counts when stderr is still that stream (a child whose
    // stderr was redirected inherits the variable).
    void decide() {
        journal = -1;
        const char* js = std::getenv("JOURNAL_STREAM");
        if (!js) return;
        unsigned long long dev = 0, ino = 0;
        if (std::sscanf(js, "%llu:%llu", &dev, &ino) != 2) return;
        struct stat st {};
        if (fstat(STDERR_FILENO, &st) != 0 || st.st_dev != dev || st.st_ino != ino) return;
        const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (fd < 0) return;
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        std::strncpy(a.sun_path, "/run/systemd/journal/socket", sizeof(a.sun_path) - 1);
        if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
            close(fd);
            return;
        }
        journal = fd;
    }
};

Sink& sink() {
    static Sink s;
    return s;
}

// journald's native protocol: "NAME=value\n", or for a value with a newline
// "NAME\n" + its length as 64-bit little endian + the value + "\n".
void field(std::string& out, std::string_view name, std::string_view value) {
    out.append(name);
    if (value.find('\n') == std::string_view::npos) {
        out.push_back('=');
        out.append(value);
    } else {
        out.push_back('\n');
        uint64_t n = value.size();
        for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
        out.append(value);
    }
    out.push_back('\n');
}

}  // namespace

void set_name(std::string_view name) {
    Sink& s = sink();
    std::lock_guard lock(s.mu);
    s.name = std::string(name);
}

void line(Level level, std::string_view message, std::initializer_list<Field> fields) {
    Sink& s = sink();
    std::lock_guard lock(s.mu);
    if (s.journal == -2) s.decide();
    const std::string who = s.name.empty() ? std::string("duet") : "duet " + s.name;
    if (s.journal >= 0) {
        std::string d;
        field(d, "MESSAGE", std::string(who) + ": " + std::string(message));
        field(d, "PRIORITY", std::to_string(static_cast<int>(level)));
        field(d, "SYSLOG_IDENTIFIER", s.name.empty() ? std::string("duet") : "duet-" + s.name);
        for (const Field& f : fields)
            if (!f.second.empty()) field(d, f.first, f.second);  // an empty value: the field does not apply
        // A datagram journald refuses (too large: it then wants the data in a memfd)
        // is written to stderr, which is the journal too.
        if (send(s.journal, d.data(), d.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(d.size())) return;
    }
    std::fprintf(stderr, "%s: %.*s\n", who.c_str(), static_cast<int>(message.size()), message.data());
}

}  // namespace duet::log
