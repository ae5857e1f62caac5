#include "stop_signals.h"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace pycomm {
namespace {

constexpr int kSlots = 64;
constexpr size_t kNameBytes = 256;
constexpr int kSignals[] = {SIGTERM, SIGHUP};

// A slot is written under g_mutex and published by `used` (release); the
// handler reads only slots whose `used` it sees set (acquire).
struct NameSlot {
  std::atomic<bool> used{false};
  char name[kNameBytes];
};
struct StopSlot {
  std::atomic<bool> used{false};
  StopAction fn = nullptr;
  void* ctx = nullptr;
};

NameSlot g_names[kSlots];
StopSlot g_stops[kSlots];
std::mutex g_mutex;
int g_registered = 0;  // under g_mutex
bool g_installed[2] = {false, false};

void on_stop(int signo) {
  for (auto& s : g_names) {
    if (s.used.load(std::memory_order_acquire)) shm_unlink(s.name);
  }
  for (auto& s : g_stops) {
    if (s.used.load(std::memory_order_acquire)) s.fn(s.ctx, signo);
  }
  // 3: the default action, as if pycomm had never been here.
  struct sigaction dfl{};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(signo, &dfl, nullptr);
  raise(signo);
}

// Installs on_stop where the disposition is the default (under g_mutex).
void install() {
  for (int i = 0; i < 2; ++i) {
    struct sigaction old{};
    if (g_installed[i] || sigaction(kSignals[i], nullptr, &old) != 0) continue;
    if ((old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL) continue;  // the user's
    struct sigaction act{};
    act.sa_handler = on_stop;
    sigemptyset(&act.sa_mask);
    for (int s : kSignals) sigaddset(&act.sa_mask, s);  // one cleanup at a time
    g_installed[i] = sigaction(kSignals[i], &act, nullptr) == 0;
  }
}

// Restores the default where on_stop is still the handler (under g_mutex).
void uninstall() {
  for (int i = 0; i < 2; ++i) {
    struct sigaction cur{};
    if (!g_installed[i] || sigaction(kSignals[i], nullptr, &cur) != 0) continue;
    g_installed[i] = false;
    if (!(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == on_stop) {
      struct sigaction dfl{};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      sigaction(kSignals[i], &dfl, nullptr);
    }
  }
}

template <typename Slot, typename Fill>
int take_slot(Slot (&slots)[kSlots], Fill fill) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (int i = 0; i < kSlots; ++i) {
    if (slots[i].used.load(std::memory_order_relaxed)) continue;
    fill(slots[i]);
    slots[i].used.store(true, std::memory_order_release);
    if (g_registered++ == 0) install();
    return i;
  }
  return -1;
}

template <typename Slot>
void free_slot(Slot (&slots)[kSlots], int token) {
  if (token < 0 || token >= kSlots) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!slots[token].used.exchange(false, std::memory_order_acq_rel)) return;
  if (--g_registered == 0) uninstall();
}

const char* signal_name(int signo) {
  switch (signo) {
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
  }
}

}  // namespace

int watch_name(const std::string& name) {
  if (name.size() >= kNameBytes) return -1;
  return take_slot(g_names,
                   [&](NameSlot& s) { std::memcpy(s.name, name.c_str(), name.size() + 1); });
}

void unwatch_name(int token) { free_slot(g_names, token); }

int watch_stop(StopAction fn, void* ctx) {
  return take_slot(g_stops, [&](StopSlot& s) {
    s.fn = fn;
    s.ctx = ctx;
  });
}

void unwatch_stop(int token) { free_slot(g_stops, token); }

void stop_reason(char* out, size_t cap, int rank, int signo) {
  if (cap == 0) return;
  char digits[16];
  int n = 0;
  unsigned v = rank < 0 ? 0u : static_cast<unsigned>(rank);
  do {
    digits[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0 && n < 15);
  size_t at = 0;
  auto put = [&](const char* s) {
    for (; *s && at + 1 < cap; ++s) out[at++] = *s;
  };
  put("rank ");
  while (n > 0 && at + 1 < cap) out[at++] = digits[--n];
  put(" was stopped by ");
  put(signal_name(signo));
  out[at] = 0;
}

}  // namespace pycomm
