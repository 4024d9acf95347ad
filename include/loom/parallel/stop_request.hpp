#pragma once
//! \file Stopping a training run early without losing it: StopSignals records a SIGINT, SIGTERM
//! or SIGUSR1 instead of dying on it, TimeLimit says when the next step would end past a
//! wall-clock budget, and agree_to_stop turns what each rank saw into one answer for the mesh,
//! so every rank stops after the same step and can save (Megatron-LM's `--exit-signal-handler`
//! and `--exit-duration-in-mins`).

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include "loom/comm/concepts.hpp"
#include "loom/core/error.hpp"

namespace loom {

//! "SIGTERM", "SIGINT", ...; "signal N" for one without a name here.
inline std::string signal_name(int signo) {
  switch (signo) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGHUP: return "SIGHUP";
    case SIGQUIT: return "SIGQUIT";
    default: return "signal " + std::to_string(signo);
  }
}

namespace detail {

//! The process-wide state behind StopSignals: what a signal handler may touch is fixed-size
//! and lock-free, set up before the handler is installed.
struct StopSignalState {
  static constexpr int capacity = 8;
  static constexpr std::size_t notice_bytes = 256;
  std::atomic<int> received{0};   //!< the first signal caught, 0 before
  std::atomic<bool> installed{false};
  int count = 0;
  int signals[capacity] = {};
  struct sigaction previous[capacity] = {};
  char notices[capacity][notice_bytes] = {};  //!< the line written for each signal
  std::size_t notice_lengths[capacity] = {};
};

inline StopSignalState& stop_signal_state() {
  static StopSignalState state;
  return state;
}

static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");

//! Records the first signal, writes its notice, and hands every handled signal back to its
//! default action, so that a second one ends the process at once. Only async-signal-safe calls,
//! and errno as the interrupted code left it.
inline void stop_signal_handler(int signo) {
  const int interrupted_errno = errno;
  StopSignalState& s = stop_signal_state();
  int expected = 0;
  if (!s.received.compare_exchange_strong(expected, signo)) {
    errno = interrupted_errno;
    return;
  }
  for (int i = 0; i < s.count; ++i) {
    if (s.signals[i] == signo && s.notice_lengths[i] > 0) {
      const ssize_t ignored = ::write(STDERR_FILENO, s.notices[i], s.notice_lengths[i]);
      (void)ignored;
    }
  }
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  for (int i = 0; i < s.count; ++i) ::sigaction(s.signals[i], &fallback, nullptr);
  errno = interrupted_errno;
}

}  // namespace detail

//! While it lives, the first of `signals` the process receives is recorded (received()) instead
//! of ending the process: a training loop polls it between steps, stops after the step under way
//! and saves. The handler writes "<program>: got SIGTERM; <notice>" to stderr and restores the
//! default action of every signal it handles, so a second signal (Ctrl-C twice) ends the process
//! at once. The state is the process's: at most one StopSignals lives at a time, and every
//! thread (each thread rank) sees the same received(). The destructor restores the actions
//! that were there before.
class StopSignals {
 public:
  //! SIGINT (Ctrl-C), SIGTERM (what schedulers such as Slurm send before a job's time is up) and
  //! SIGUSR1 (which OpenMPI's mpirun forwards to every process, where its SIGTERM and SIGINT end
  //! the job).
  static std::vector<int> default_signals() { return {SIGINT, SIGTERM, SIGUSR1}; }

  //! Installs the handler for `signals` (1 to 8 distinct signal numbers that may be caught).
  StopSignals(std::string_view program, std::string_view notice, std::vector<int> signals = default_signals()) {
    detail::StopSignalState& s = detail::stop_signal_state();
    LOOM_CHECK(signals.size() >= 1 && signals.size() <= detail::StopSignalState::capacity, "StopSignals: signals",
               signals.size(), "must name 1 to 8 signals");
    for (std::size_t i = 0; i < signals.size(); ++i) {
      LOOM_CHECK(signals[i] > 0 && signals[i] < NSIG && signals[i] != SIGKILL && signals[i] != SIGSTOP,
                 "StopSignals: signal", signals[i], "must be a signal number that can be caught");
      for (std::size_t j = 0; j < i; ++j)
        LOOM_CHECK(signals[j] != signals[i], "StopSignals: signal", signal_name(signals[i]), "is named twice");
    }
    bool expected = false;
    LOOM_CHECK(s.installed.compare_exchange_strong(expected, true), "StopSignals", "a second one",
               "one is already installed in this process; the signal state is the process's");
    s.received.store(0);
    s.count = static_cast<int>(signals.size());
    for (int i = 0; i < s.count; ++i) {
      s.signals[i] = signals[static_cast<std::size_t>(i)];
      const std::string line =
          std::string(program) + ": got " + signal_name(s.signals[i]) + "; " + std::string(notice) + "\n";
      const std::size_t n = std::min(line.size(), detail::StopSignalState::notice_bytes);
      std::memcpy(s.notices[i], line.data(), n);
      s.notices[i][n - 1] = '\n';  // a notice cut to fit still ends its line
      s.notice_lengths[i] = n;
    }
    struct sigaction action {};
    action.sa_handler = detail::stop_signal_handler;
    sigemptyset(&action.sa_mask);
    for (int i = 0; i < s.count; ++i) sigaddset(&action.sa_mask, s.signals[i]);  // one handler at a time
    action.sa_flags = SA_RESTART;  // reads, writes and waits go on; the loop polls between steps
    for (int i = 0; i < s.count; ++i) {
      if (::sigaction(s.signals[i], &action, &s.previous[i]) != 0) {
        const std::string why = std::strerror(errno);
        for (int j = 0; j < i; ++j) ::sigaction(s.signals[j], &s.previous[j], nullptr);
        s.installed.store(false);
        throw Error("StopSignals: sigaction", signal_name(s.signals[i]), why);
      }
    }
  }

  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  ~StopSignals() {
    detail::StopSignalState& s = detail::stop_signal_state();
    for (int i = 0; i < s.count; ++i) ::sigaction(s.signals[i], &s.previous[i], nullptr);
    s.count = 0;
    s.installed.store(false);
  }

  //! The first handled signal received while a StopSignals lives, or 0. Any thread may ask.
  static int received() noexcept { return detail::stop_signal_state().received.load(); }
};

//! A wall-clock budget for a run, from `start`: whether the next step, taking as long as the
//! time between the last two checks (the step and whatever ran beside it: validation, saving),
//! would end past it. A run that stops there ends within its budget instead of just after it.
class TimeLimit {
 public:
  using clock = std::chrono::steady_clock;

  //! `seconds` after `start` (> 0).
  TimeLimit(clock::time_point start, double seconds) : start_(start), last_(start), seconds_(seconds) {
    LOOM_CHECK(seconds > 0, "TimeLimit: seconds", seconds, "must be > 0");
  }

  //! Called after each step: true when the next step would end past the limit.
  bool next_step_would_pass(clock::time_point now = clock::now()) {
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double interval = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    return elapsed + interval > seconds_;
  }

  //! Seconds since start.
  double elapsed(clock::time_point now = clock::now()) const {
    return std::chrono::duration<double>(now - start_).count();
  }
  double seconds() const noexcept { return seconds_; }

 private:
  clock::time_point start_, last_;
  double seconds_;
};

//! Why a run stops before its last step, as every rank of the mesh agreed: a signal any rank
//! received (the largest number, when ranks saw different ones) and whether any rank's time
//! limit was reached. Neither: go on.
struct StopReason {
  int signal = 0;           //!< a signal number, 0 for none
  bool time_limit = false;  //!< a TimeLimit said the next step would pass it
  explicit operator bool() const noexcept { return signal != 0 || time_limit; }
};

//! Collective over `group` (every rank calls it after the same step): what each rank saw,
//! `signal` (StopSignals::received()) and `time_limit`, combined into one StopReason that every
//! rank gets, so that all stop after the same step and none waits for a peer that stopped.
//! Signals reach ranks at different moments (thread ranks poll the one process-wide flag at
//! different points of a step; mpirun forwards to each process on its own): that is why this
//! takes a collective rather than each rank's own look.
template <Communicator Group>
StopReason agree_to_stop(Group& group, int signal, bool time_limit) {
  LOOM_CHECK(signal >= 0 && signal < NSIG, "agree_to_stop: signal", signal, "must be 0 or a signal number");
  double seen[2] = {static_cast<double>(signal), time_limit ? 1.0 : 0.0};
  group.all_reduce(std::span<double>(seen), ReduceOp::max);
  return StopReason{.signal = static_cast<int>(seen[0]), .time_limit = seen[1] > 0};
}

}  // namespace loom
