// doctest main: prints why GPU tests skip, and ends with "tests: N passed, M failed, K skipped".
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "swapopt/core/device.h"

namespace {

/** Adds the one-line summary CI reads after doctest's own. Skipped = cases filtered out (the CUDA
 *  suites skip themselves with doctest::skip when no device is present). */
struct SummaryListener : doctest::IReporter {
  explicit SummaryListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override {
    const unsigned passed = s.numTestCasesPassingFilters - s.numTestCasesFailed;
    const unsigned skipped = s.numTestCases - s.numTestCasesPassingFilters;
    std::printf("tests: %u passed, %u failed, %u skipped\n", passed, s.numTestCasesFailed, skipped);
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

REGISTER_LISTENER("summary", 1, SummaryListener);

int main(int argc, char** argv) {
  if (swapopt::cuda_device_count() == 0) {
    std::printf("note: CUDA tests skipped: %s\n",
                swapopt::cuda_built() ? "no CUDA device visible" : "swapopt was built without CUDA");
  }
  doctest::Context context(argc, argv);
  return context.run();
}
