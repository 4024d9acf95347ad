// doctest's main, compiled once and linked into every test executable. It fails a run in
// which the filters matched no test case: the unit tests are built in groups (one executable
// per group, tests/CMakeLists.txt) and each ctest entry runs its file's tests with
// --source-file, so a filter that matched nothing would otherwise pass without testing.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

namespace {

bool no_test_case_ran = false;

//! Notes a run that passed no test case through the filters; reports nothing else.
struct NoMatchListener : doctest::IReporter {
  explicit NoMatchListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override {
    no_test_case_ran = stats.numTestCasesPassingFilters == 0;
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

DOCTEST_REGISTER_LISTENER("loom_no_match", 1, NoMatchListener);

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int result = context.run();
  if (context.shouldExit() || result != 0) return result;
  if (no_test_case_ran) {
    std::fprintf(stderr,
                 "loom tests: no test case matched the filters given (%d arguments); a run must test something\n",
                 argc - 1);
    return 1;
  }
  return 0;
}
