// The prefill and decode workers: each is one process's loop over the shared
// instance. Prefill takes QUEUED requests (prompt + any output already produced,
// so a re-driven request continues where it stopped), runs the forward pass in
// chunks, samples the next token and hands the request and its KV blocks to
// decode (shm/handoff.h: no copy, no crash window). Decode runs every request it
// holds one token per step in one batched forward pass, or a verify row of drafted
// tokens (engine/decode_scheduler.h; continuous batching: a new request joins at the
// next step boundary), until end of generation, max_tokens or cancel. Output tokens go into the request slot; sampling is keyed by (seed,
// output index), so a re-driven stream is the same stream.
#pragma once
//
// worker_base.h: what both share; prefill_worker.h (and handoff_out.cpp: its side
// of hand-offs); decode_worker.h.

#include "roles/decode_worker.h"
#include "roles/prefill_worker.h"
#include "roles/worker_base.h"
