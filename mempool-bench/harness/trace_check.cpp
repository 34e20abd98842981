// trace_check TRACE...: reads each trace with the replay harness's reader (trace.hpp) and prints
// `<path>: ok events=<n> streams=<k> max_live=<m>`, or `<path>: <what is wrong>` and exits 1.
// Needs no GPU, CUDA or torch: `compare.sh --self-test` builds it to check the reader against
// mempool-bench's (mempool-bench/src/trace.rs), and it checks traces before a GPU run.
#include <cstdio>

#include "trace.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: trace_check TRACE...\n");
    return 2;
  }
  int rc = 0;
  for (int i = 1; i < argc; i++) {
    try {
      trace::Plan p = trace::plan(trace::parse(trace::read_file(argv[i])));
      std::printf("%s: ok events=%zu streams=%zu max_live=%zu\n", argv[i], p.steps.size(), p.values.size(), p.slots);
    } catch (const trace::Error& e) {
      std::printf("%s: %s\n", argv[i], e.what());
      rc = 1;
    }
  }
  return rc;
}
