// A whole file's bytes (test helper; empty when it cannot be opened).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

inline std::vector<uint8_t> read_file_bytes(const std::string& path) {
    std::vector<uint8_t> b;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return b;
    struct stat st {};
    ::fstat(fd, &st);
    b.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < b.size()) {
        const ssize_t r = ::pread(fd, b.data() + got, b.size() - got, static_cast<off_t>(got));
        if (r <= 0) break;
        got += static_cast<size_t>(r);
    }
    b.resize(got);
    ::close(fd);
    return b;
}
