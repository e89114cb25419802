#include "mp/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "swapopt/core/error.h"

extern char** environ;

namespace swapopt::test {

std::string make_temp_dir(const std::string& prefix) {
  std::string pattern = "/tmp/" + prefix + "XXXXXX";
  char* dir = ::mkdtemp(pattern.data());
  SWAPOPT_CHECK(dir != nullptr, "[launcher] mkdtemp failed");
  return dir;
}

LaunchResult launch_ranks(int world_size, const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                          std::chrono::milliseconds timeout) {
  const std::string logs = make_temp_dir("swapopt_ranks_");
  std::vector<pid_t> pids;
  const auto start = std::chrono::steady_clock::now();
  for (int rank = 0; rank < world_size; ++rank) {
    std::map<std::string, std::string> vars = env;
    vars["RANK"] = std::to_string(rank);
    vars["WORLD_SIZE"] = std::to_string(world_size);
    vars["LOCAL_RANK"] = std::to_string(rank);
    // Everything the child needs is prepared before fork: it only redirects and execs.
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      if (!vars.count(entry.substr(0, entry.find('=')))) env_strings.push_back(entry);
    }
    for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp, args;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_copy = argv;
    for (std::string& s : argv_copy) args.push_back(s.data());
    args.push_back(nullptr);
    const std::string log = logs + "/rank" + std::to_string(rank) + ".log";
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    SWAPOPT_CHECK(fd >= 0, "[launcher] cannot create " << log);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::execve(args[0], args.data(), envp.data());
      ::_exit(127);
    }
    ::close(fd);
    SWAPOPT_CHECK(pid > 0, "[launcher] fork failed");
    pids.push_back(pid);
  }
  LaunchResult result;
  result.ranks.resize(size_t(world_size));
  size_t running = pids.size();
  while (running > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (pids[i] == 0) continue;
      int status = 0;
      if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        result.ranks[i].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        pids[i] = 0;
        --running;
      }
    }
    if (running > 0 && std::chrono::steady_clock::now() - start > timeout) {
      result.timed_out = true;
      for (pid_t& pid : pids) {
        if (pid == 0) continue;
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
        pid = 0;
      }
      running = 0;
    }
    if (running > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int rank = 0; rank < world_size; ++rank) {
    const std::string log = logs + "/rank" + std::to_string(rank) + ".log";
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    result.ranks[size_t(rank)].output = text.str();
    std::remove(log.c_str());
  }
  ::rmdir(logs.c_str());
  return result;
}

}  // namespace swapopt::test
