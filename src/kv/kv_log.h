// The KV append log: one file per context holding its KV as records, written with
// group commit through a LogDevice (io_uring), recovered by the rules of KVLOG.md.
//
//   <dir>/<context>.kvlog          the log: a 128-byte header, then records
//   <dir>/<context>.<gen>.kvblob   the checkpoint the log's first record names (after compaction)
//
// A record is a 48-byte header, its payload, and zero padding to 8 bytes:
//   u32 magic 'KVRC' | u16 type | u16 0 | u64 seq | u64 batch_seq | u64 payload_bytes |
//   u32 payload_crc | u32 prev_crc | u32 0 | u32 header_crc
// header_crc = CRC32C(salt, header bytes 0..43): it covers payload_crc and prev_crc
// (the previous record's header_crc, the file header's CRC for the first record),
// so the checksums chain through the whole log and a record from another log or an
// older incarnation of this one (another salt) never validates.
//   APPEND      u64 start | u64 n | n x i32 tokens | the n positions' KV rows in blob order
//   TRUNCATE    u64 new_length
//   CHECKPOINT  u64 n_tokens | u32 blob data_crc | u32 name length | blob file name
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "base/result.h"
#include "kv/blob.h"
#include "kv/kv_pool.h"
#include "kv/log_device.h"

namespace duet {

constexpr size_t kLogHeaderBytes = 128;     // versions 1 and 2
constexpr size_t kLogHeaderBytesV3 = 192;   // version 3: room for a 64-character name
constexpr size_t kLogHeaderBytesMax = 192;
constexpr size_t kRecordHeaderBytes = 48;
// Version 2: an APPEND may start before the context's end (an edit: it replaces the
// positions from its start). Version 1 files, which never do, are read as they are.
// Version 3: a 192-byte header whose context name is up to 64 characters of
// [A-Za-z0-9_.-] (versions 1 and 2: 31 of [A-Za-z0-9_-]); records as version 2.
constexpr uint32_t kLogVersion = 3;
constexpr uint32_t kLogVersionMin = 1;
constexpr uint32_t kRecordMagic = 0x4352564b;  // "KVRC" little-endian

enum class LogRecordType : uint16_t { Append = 1, Truncate = 2, Checkpoint = 3 };
const char* log_record_type_name(uint16_t t);

struct LogHeader {
    uint32_t version = kLogVersion;
    KvIdentity id;
    KvLayout layout;
    uint64_t salt = 0;
    uint64_t generation = 0;  // compactions so far: the checkpoint blob is <context>.<generation>.kvblob
    std::string context;      // 1..64 of [A-Za-z0-9_.-] (versions 1, 2: 1..31 of [A-Za-z0-9_-])
    uint32_t crc = 0;         // header CRC: the chain's seed
    size_t bytes() const { return version >= 3 ? kLogHeaderBytesV3 : kLogHeaderBytes; }  // where record 0 starts
};
Status check_context_name(const std::string& name);
// The context a file of a contexts directory belongs to, "" for none: <c>.kvlog and
// its <c>.kvlog.tmp, a checkpoint blob <c>.<generation>.kvblob and its
// <c>.<generation>.kvblob.tmp.<pid>, a pin <c>.pin. Names may hold dots; a blob's
// generation is the digits after its last dot, so "a.5.kvblob" is context a's and
// "a.5.7.kvblob" context a.5's.
std::string context_of_file(const std::string& file);

// What recovery found (duet kv inspect prints it).
struct LogRecordInfo {
    uint64_t offset = 0;
    uint16_t type = 0;
    uint64_t seq = 0, batch_seq = 0, payload_bytes = 0;
    uint64_t start = 0, n = 0;  // APPEND: positions; TRUNCATE: n = new length; CHECKPOINT: n = tokens
    std::string blob;           // CHECKPOINT: the blob's file name
};
struct LogScan {
    LogHeader header;
    std::vector<LogRecordInfo> records;  // the valid ones, in order
    uint64_t valid_end = 0;              // file offset just past the last valid record
    uint64_t file_size = 0;
    bool torn = false;  // bytes after valid_end were cut (or are to be cut): a torn tail
    std::string torn_reason;
    std::vector<int32_t> tokens;  // the context's tokens at its last durable state
    uint64_t n_tokens() const { return tokens.size(); }
    uint32_t last_crc = 0;   // header_crc of the last valid record (the header's when none)
    uint64_t next_seq = 0;
    uint64_t live_checkpoint_gen = 0;  // the generation of the blob the log names (0: none)
    bool has_checkpoint = false;
};

// Reads the log at path by the rules of KVLOG.md. With a pool, the KV is replayed
// straight into `seq` (empty on entry): each record's rows are read into its blocks
// and checked by the payload CRC before the next record; on an Error seq is
// released. Without one only the checksums are read. `want` (optional) must match
// the header's fingerprints and, with a pool, its layout including the dtype.
// Errors: a bad file header, mid-log corruption (a bad record followed by a valid
// record of a later commit), a valid record that makes no sense (an APPEND not at
// the context's end, a TRUNCATE beyond it, a CHECKPOINT not first or whose blob
// fails): the context is refused and the files are left as they are. A torn tail
// is not an Error: `torn` says so and valid_end is where the log ends.
Result<LogScan> kv_log_scan(const std::string& path, const KvIdentity* want = nullptr, KvPool* pool = nullptr,
                            KvSeq* seq = nullptr);

class KvLog;

// Group commit over any number of logs: the first appender that finds no commit
// running becomes the leader, takes every queued record (of all logs), writes each
// log's records with one write linked to one fdatasync, every log's pair in one
// batch, and wakes the appenders whose records are durable; the next queued wait
// for the following batch. With group == false every record is its own batch
// (one fdatasync per append: the benchmark's reference).
class KvLogSync {
public:
    explicit KvLogSync(LogDevice& dev, bool group = true) : dev_(dev), group_(group) {}
    LogDevice& device() { return dev_; }

private:
    friend class KvLog;
    struct Pending;
    Status submit(Pending& p);
    void commit(std::vector<Pending*>& batch);

    LogDevice& dev_;
    bool group_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<Pending*> queue_;
    bool leader_ = false;
};

struct KvLogOptions {
    // Compact when the log's bytes exceed compact_factor x the live KV's bytes and
    // compact_min_bytes (KvLog::should_compact).
    double compact_factor = 2.0;
    uint64_t compact_min_bytes = 1 << 20;
};

// One context's log. Calls for one log are made by one thread at a time (the
// context's owner); appends of different logs may run concurrently and share syncs.
class KvLog {
public:
    // Creates <dir>/<context>.kvlog for an empty context: header written to a
    // temporary file, fsynced, renamed into place, directory fsynced. Refuses an
    // existing log.
    static Result<std::unique_ptr<KvLog>> create(KvLogSync& sync, const std::string& dir, const std::string& context,
                                                 const KvIdentity& id, const KvLayout& layout,
                                                 const KvLogOptions& o = {});
    // Opens and recovers an existing log (kv_log_scan, replaying into seq when pool
    // is given); a torn tail is cut (ftruncate + fsync) before anything is appended,
    // and leftovers of an interrupted compaction are removed. `scan` (optional)
    // receives what recovery found.
    static Result<std::unique_ptr<KvLog>> open(KvLogSync& sync, const std::string& dir, const std::string& context,
                                               const KvIdentity& want, KvPool* pool, KvSeq* seq,
                                               LogScan* scan = nullptr, const KvLogOptions& o = {});
    ~KvLog();
    KvLog(const KvLog&) = delete;
    KvLog& operator=(const KvLog&) = delete;

    // Durably appends positions [start, start + n) of seq: tokens[start..] and the
    // rows, gathered straight from the arena. start is at most the log's length: one
    // before it is an edit, one record that drops the positions from start and
    // appends these (atomic: after a crash the log holds the context before or after
    // it, never truncated and not appended).
    // Returns once the record's write and fdatasync completed. On an Error the log
    // keeps its last durable state (ENOSPC and other write errors: the partial
    // write is cut off again), or is poisoned (an fdatasync error: every later call
    // fails until the context is reopened from disk).
    Status append(KvPool& pool, const KvSeq& seq, std::span<const int32_t> tokens, uint64_t start, uint64_t n);
    // Durably records that the context now has new_length positions.
    Status truncate(uint64_t new_length);
    // Compaction: a checkpoint blob of positions [0, n_tokens()) from seq, then a new
    // log (new salt, generation + 1) whose first record names it, renamed over the
    // old one; the old blob is removed only after both are durable.
    Status compact(KvPool& pool, const KvSeq& seq, std::span<const int32_t> tokens);
    bool should_compact() const;

    uint64_t n_tokens() const;   // positions at the last durable record
    uint64_t file_bytes() const;
    bool poisoned() const;
    const std::string& path() const { return path_; }
    const LogHeader& header() const { return header_; }

private:
    KvLog() = default;
    Status enqueue(LogRecordType type, std::vector<iovec> payload, uint64_t new_length, uint64_t start);
    friend class KvLogSync;

    KvLogSync* sync_ = nullptr;
    KvLogOptions opts_;
    std::string dir_, path_;
    LogHeader header_;
    int fd_ = -1;
    // Owned by the commit leader (under KvLogSync::mu_ between batches):
    uint64_t size_ = 0;       // durable file size: where the next batch is written
    uint64_t next_seq_ = 0;
    uint32_t prev_crc_ = 0;
    uint64_t n_tokens_ = 0;   // the context's length after the last durable record
    bool poisoned_ = false;
    std::string poison_reason_;
};

// Encodes a log file header (also used by tests to build hostile files).
void log_header_encode(const LogHeader& h, uint8_t out[kLogHeaderBytesMax]);  // writes h.bytes()
Result<LogHeader> log_header_decode(const uint8_t* p, size_t n);

}  // namespace duet
