// doctest main: prints why GPU tests skip, and ends with "tests: N passed, M failed, K skipped".
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "swapopt/core/device.h"

namespace {

/** Filled by the listener at the end of the run; printed by main() after doctest's own summary. */
std::string g_summary;

/** Adds the one-line summary CI reads after doctest's own. Skipped = cases marked doctest::skip
 *  (the CUDA suites, when no device is present); cases left out by a -tc/-ts filter are not counted. */
struct SummaryListener : doctest::IReporter {
  explicit SummaryListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override {
    const unsigned passed = s.numTestCasesPassingFilters - s.numTestCasesFailed;
    g_summary = "tests: " + std::to_string(passed) + " passed, " + std::to_string(s.numTestCasesFailed) + " failed, " +
                std::to_string(skipped) + " skipped";
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData& data) override { skipped += data.m_skip ? 1 : 0; }
  unsigned skipped = 0;
};

}  // namespace

REGISTER_LISTENER("summary", 1, SummaryListener);

int main(int argc, char** argv) {
  if (swapopt::cuda_device_count() == 0) {
    std::printf("note: CUDA tests skipped: %s\n",
                swapopt::cuda_built() ? "no CUDA device visible" : "swapopt was built without CUDA");
  }
  doctest::Context context(argc, argv);
  const int status = context.run();
  if (!g_summary.empty()) std::printf("%s\n", g_summary.c_str());
  return status;
}
