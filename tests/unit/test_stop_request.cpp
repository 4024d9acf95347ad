// StopSignals, TimeLimit and agree_to_stop: a handled signal is recorded once instead of ending
// the process and announced on stderr, a second one finds the default action back, the
// previous actions return with the destructor; the time limit stops before the step that would
// pass it; and every rank of a communicator of 1..8 ranks agrees on one answer whichever ranks
// saw what.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <string>
#include <thread>
#include <vector>

#include "loom/comm/self.hpp"
#include "loom/comm/threads.hpp"
#include "loom/parallel/stop_request.hpp"
#include "support/error_of.hpp"

namespace test_stop_request {

using namespace loom;
using namespace loom::test;

namespace {

volatile std::sig_atomic_t sentinel_calls = 0;
void sentinel(int) { sentinel_calls = sentinel_calls + 1; }

//! The handler `signo` has now.
void (*handler_of(int signo))(int) {
  struct sigaction now {};
  ::sigaction(signo, nullptr, &now);
  return now.sa_handler;
}

//! What `f` writes to stderr (through a pipe; it must write less than a pipe holds).
template <class F>
std::string stderr_of(F&& f) {
  int ends[2];
  REQUIRE(::pipe(ends) == 0);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(ends[1], STDERR_FILENO);
  f();
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  ::close(ends[1]);
  std::string out;
  char buffer[512];
  for (ssize_t n; (n = ::read(ends[0], buffer, sizeof buffer)) > 0;) out.append(buffer, static_cast<std::size_t>(n));
  ::close(ends[0]);
  return out;
}

}  // namespace

TEST_CASE("a handled signal is recorded, announced once, and the actions come back") {
  struct sigaction mine {};
  mine.sa_handler = sentinel;
  sigemptyset(&mine.sa_mask);
  struct sigaction before {};
  REQUIRE(::sigaction(SIGUSR1, &mine, &before) == 0);
  const auto usr2_before = handler_of(SIGUSR2);
  sentinel_calls = 0;
  {
    StopSignals signals("test_stop_request", "stopping after this step", {SIGUSR1, SIGUSR2});
    CHECK(StopSignals::received() == 0);
    CHECK((handler_of(SIGUSR1) != sentinel));
    const std::string said = stderr_of([] { std::raise(SIGUSR1); });
    CHECK(StopSignals::received() == SIGUSR1);
    CHECK(sentinel_calls == 0);  // caught, not passed on
    CHECK(said == "test_stop_request: got SIGUSR1; stopping after this step\n");
    // The first signal handed both back to their default actions: a second ends the process.
    CHECK((handler_of(SIGUSR1) == SIG_DFL));
    CHECK((handler_of(SIGUSR2) == SIG_DFL));
  }
  // The destructor restores what was there before.
  CHECK((handler_of(SIGUSR1) == sentinel));
  CHECK((handler_of(SIGUSR2) == usr2_before));
  std::raise(SIGUSR1);
  CHECK(sentinel_calls == 1);
  REQUIRE(::sigaction(SIGUSR1, &before, nullptr) == 0);
}

TEST_CASE("received() starts at 0 for each StopSignals and is seen from every thread") {
  {
    StopSignals signals("test_stop_request", "stopping", {SIGUSR1});
    std::thread([] { std::raise(SIGUSR1); }).join();  // delivered to that thread
    CHECK(StopSignals::received() == SIGUSR1);
  }
  StopSignals again("test_stop_request", "stopping", {SIGUSR1});
  CHECK(StopSignals::received() == 0);
  // Two at once would share (and fight over) the process's actions.
  CHECK(contains(error_of([] { StopSignals second("x", "y", {SIGUSR2}); }),
                 "loom: StopSignals: got a second one; one is already installed in this process"));
}

TEST_CASE("the handler leaves errno as it found it, and a long notice is cut to a whole line") {
  {
    StopSignals signals("test_stop_request", "stopping", {SIGUSR1});
    // With stderr closed the handler's write fails and sets errno, which the code the signal
    // interrupted must not see.
    const int saved = ::dup(STDERR_FILENO);
    ::close(STDERR_FILENO);
    errno = EDOM;
    std::raise(SIGUSR1);
    const int seen = errno;
    ::dup2(saved, STDERR_FILENO);
    ::close(saved);
    CHECK(StopSignals::received() == SIGUSR1);
    CHECK(seen == EDOM);
  }
  StopSignals signals("test_stop_request", std::string(400, 'x'), {SIGUSR1});
  const std::string said = stderr_of([] { std::raise(SIGUSR1); });
  CHECK(said.size() == 256);
  CHECK(said.starts_with("test_stop_request: got SIGUSR1; xxx"));
  CHECK(said.back() == '\n');
}

TEST_CASE("bad signal lists are refused, and refusing installs nothing") {
  CHECK(error_of([] { StopSignals s("x", "y", {SIGKILL}); }) ==
        "loom: StopSignals: signal: got 9; must be a signal number that can be caught");
  CHECK(error_of([] { StopSignals s("x", "y", {0}); }) ==
        "loom: StopSignals: signal: got 0; must be a signal number that can be caught");
  CHECK(error_of([] { StopSignals s("x", "y", {SIGTERM, SIGTERM}); }) ==
        "loom: StopSignals: signal: got SIGTERM; is named twice");
  CHECK(error_of([] { StopSignals s("x", "y", {}); }) == "loom: StopSignals: signals: got 0; must name 1 to 8 signals");
  const auto term_before = handler_of(SIGTERM);
  CHECK(error_of([] { StopSignals s("x", "y", {SIGTERM, SIGSTOP}); }) != "");
  CHECK((handler_of(SIGTERM) == term_before));
  StopSignals fine("x", "y");  // nothing was left installed
  CHECK((handler_of(SIGTERM) != term_before));
}

TEST_CASE("signal_name") {
  CHECK(signal_name(SIGINT) == "SIGINT");
  CHECK(signal_name(SIGTERM) == "SIGTERM");
  CHECK(signal_name(SIGUSR1) == "SIGUSR1");
  CHECK(signal_name(SIGWINCH) == "signal " + std::to_string(SIGWINCH));
}

TEST_CASE("TimeLimit stops before the step that would pass it") {
  using clock = TimeLimit::clock;
  using std::chrono::milliseconds;
  const clock::time_point t0{};
  TimeLimit limit(t0, 10.0);
  CHECK_FALSE(limit.next_step_would_pass(t0 + milliseconds(4000)));  // 4 s in, steps of 4 s: 8
  CHECK_FALSE(limit.next_step_would_pass(t0 + milliseconds(7000)));  // 7 + 3 = 10, not past it
  CHECK(limit.next_step_would_pass(t0 + milliseconds(9500)));         // 9.5 + 2.5
  CHECK(limit.elapsed(t0 + milliseconds(9500)) == doctest::Approx(9.5));
  TimeLimit quick(t0, 10.0);
  CHECK(quick.next_step_would_pass(t0 + milliseconds(6000)));  // a 6 s first step: the next ends at 12
  CHECK(error_of([&] { TimeLimit(t0, 0.0); }) == "loom: TimeLimit: seconds: got 0; must be > 0");
}

TEST_CASE("every rank gets one answer, whichever ranks saw the signal or the limit") {
  SelfCommunicator self;
  CHECK_FALSE(agree_to_stop(self, 0, false));
  CHECK(agree_to_stop(self, SIGTERM, false).signal == SIGTERM);
  CHECK(agree_to_stop(self, 0, true).time_limit);
  for (int size = 1; size <= 8; ++size) {
    CAPTURE(size);
    std::vector<StopReason> nothing(static_cast<std::size_t>(size)), seen(nothing), mixed(nothing);
    threads::run(size, [&](threads::Communicator& comm) {
      const int r = comm.rank();
      const auto at = static_cast<std::size_t>(r);
      nothing[at] = agree_to_stop(comm, 0, false);
      // The last rank saw SIGTERM, the first one's clock ran out.
      seen[at] = agree_to_stop(comm, r == size - 1 ? SIGTERM : 0, r == 0);
      // Ranks saw different signals (a SIGINT, then a SIGTERM on others): the larger number wins.
      mixed[at] = agree_to_stop(comm, r % 2 == 0 ? SIGINT : SIGTERM, false);
    });
    for (int r = 0; r < size; ++r) {
      const auto at = static_cast<std::size_t>(r);
      CHECK_FALSE(nothing[at]);
      CHECK(seen[at].signal == SIGTERM);
      CHECK(seen[at].time_limit);
      CHECK(mixed[at].signal == (size == 1 ? SIGINT : SIGTERM));
      CHECK_FALSE(mixed[at].time_limit);
    }
  }
  CHECK(error_of([&] { agree_to_stop(self, -1, false); }) ==
        "loom: agree_to_stop: signal: got -1; must be 0 or a signal number");
}

}  // namespace test_stop_request
