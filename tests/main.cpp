// doctest main: prints why GPU tests skip, and ends with "tests: N passed, M failed, K skipped".
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "swapopt/core/device.h"

namespace {

/** Filled by the listener at the end of the run; printed by main() after doctest's own summary. */
std::string g_summary;
/** Cases the run's filters select, those marked doctest::skip included (a query run counts them). */
unsigned g_selected = 0;

/** Adds the one-line summary CI reads after doctest's own. Skipped = cases marked doctest::skip
 *  (the CUDA suites, when no device is present) that the -tc/-ts filters select: doctest reports
 *  every marked case as skipped, selected or not, so the count is the selected cases (from a query
 *  run) less those that ran. */
struct SummaryListener : doctest::IReporter {
  explicit SummaryListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData& query) override {
    if (query.run_stats != nullptr) g_selected = query.run_stats->numTestCasesPassingFilters;
  }
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override {
    const unsigned passed = s.numTestCasesPassingFilters - s.numTestCasesFailed;
    const unsigned skipped = g_selected - s.numTestCasesPassingFilters;
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
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

REGISTER_LISTENER("summary", 1, SummaryListener);

int main(int argc, char** argv) {
  if (swapopt::cuda_device_count() == 0) {
    std::printf("note: CUDA tests skipped: %s\n",
                swapopt::cuda_built() ? "no CUDA device visible" : "swapopt was built without CUDA");
  }
  {  // the cases the filters select, skip-marked ones included, counted quietly
    std::vector<const char*> args(argv, argv + argc);
    args.push_back("--count");
    args.push_back("--no-skip=true");
    doctest::Context query(int(args.size()), args.data());
    std::ostringstream quiet;
    query.setCout(&quiet);
    query.run();
  }
  doctest::Context context(argc, argv);
  const int status = context.run();
  if (!g_summary.empty()) std::printf("%s\n", g_summary.c_str());
  return status;
}
