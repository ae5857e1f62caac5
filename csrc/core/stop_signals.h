// Cleanup when SIGTERM or SIGHUP stops the process (torchrun stops the other
// workers of a failed job with SIGTERM; a closed terminal sends SIGHUP).
//
// While anything is registered here, and only where the signal's disposition
// was the default (terminate), a handler is installed that, inside the
// signal handler and with async-signal-safe calls only:
//   1. unlinks every registered shared-memory name (a segment still being
//      set up, a symmetric allocation before every rank mapped it), so
//      nothing is left in /dev/shm;
//   2. calls every registered stop action (the shm transport marks its
//      segment aborted with "rank R was stopped by SIGTERM", so that peers
//      fail with that reason at once instead of at the timeout);
//   3. restores the default disposition and re-raises the signal, so the
//      process ends as it would have without pycomm (exit status included).
// When the last registration goes, the default disposition comes back, unless
// someone has installed another handler since (which then stays). A handler
// the user installed before is never replaced: it owns the cleanup.
#pragma once

#include <string>

namespace pycomm {

// A shared-memory object name to unlink if the process is stopped. Returns a
// token for unwatch_name (-1 when every slot is taken: nothing is watched).
int watch_name(const std::string& name);
void unwatch_name(int token);

// `fn(ctx, signo)` runs inside the handler: it must be async-signal-safe.
using StopAction = void (*)(void* ctx, int signo);
int watch_stop(StopAction fn, void* ctx);
void unwatch_stop(int token);

// Writes "rank <rank> was stopped by SIG<name>" into `out` (async-signal-safe).
void stop_reason(char* out, size_t cap, int rank, int signo);

}  // namespace pycomm
