// Result<T>: a value or an error message, for functions that can fail.
// GCC 12 / Clang 14 do not both ship <expected> in C++20 mode, so this is the
// small subset of std::expected the engine uses.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace duet {

// What kind of failure an Error is, where a caller acts differently on it: a pass
// that found no KV blocks is a planned outcome (wait, shrink the batch, preempt), a
// device fault is not.
enum class ErrorKind : uint8_t {
    Other = 0,
    NoKvBlocks = 1,  // the KV arena has too few free blocks for what was asked
    Device = 2,      // the compute device failed (a CUDA error)
    NotFound = 3,    // no such thing (a context id): HTTP 404
    Exists = 4,      // the name is taken (a context id): HTTP 409
    Invalid = 5,     // the request itself is wrong (a position past the end): HTTP 400
    Limit = 6,       // a configured limit is reached (contexts, disk): HTTP 429
    Interrupted = 7,  // stopped on purpose before the end (Backend::set_interrupt); nothing changed
    NoSpace = 8,      // the disk is full (ENOSPC, EDQUOT); nothing changed: HTTP 507
};

struct Error {
    std::string message;
    ErrorKind kind = ErrorKind::Other;
};

// The kind of a failed system call's errno: NoSpace for ENOSPC and EDQUOT.
inline ErrorKind errno_kind(int e) { return e == ENOSPC || e == EDQUOT ? ErrorKind::NoSpace : ErrorKind::Other; }

template <typename... Args>
Error make_error(fmt::format_string<Args...> f, Args&&... args) {
    return Error{fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Error make_error(ErrorKind kind, fmt::format_string<Args...> f, Args&&... args) {
    return Error{fmt::format(f, std::forward<Args>(args)...), kind};
}

template <typename T>
class [[nodiscard]] Result {
public:
    Result(T value) : v_(std::move(value)) {}
    Result(Error e) : v_(std::move(e)) {}

    bool ok() const { return v_.index() == 0; }
    explicit operator bool() const { return ok(); }

    T& value() & { check(); return std::get<0>(v_); }
    const T& value() const& { check(); return std::get<0>(v_); }
    T&& value() && { check(); return std::get<0>(std::move(v_)); }
    T& operator*() & { return value(); }
    const T& operator*() const& { return value(); }
    T* operator->() { return &value(); }
    const T* operator->() const { return &value(); }

    const Error& error() const { return std::get<1>(v_); }

private:
    void check() const {
        if (!ok()) {
            std::fprintf(stderr, "duet: value() on an error result: %s\n",
                         std::get<1>(v_).message.c_str());
            std::abort();
        }
    }
    std::variant<T, Error> v_;
};

// Status: a Result with no value.
class [[nodiscard]] Status {
public:
    Status() = default;
    Status(Error e) : err_(std::move(e)), ok_(false) {}
    bool ok() const { return ok_; }
    explicit operator bool() const { return ok_; }
    const Error& error() const { return err_; }
    ErrorKind kind() const { return err_.kind; }

private:
    Error err_;
    bool ok_ = true;
};

}  // namespace duet
