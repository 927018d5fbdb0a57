// qmm bench: placeholder until the GPU backend lands.
#include <iostream>
#include "commands.h"
namespace qmm::tool {
int run_bench(const BenchOptions&) { std::cout << "qmm bench: not implemented yet\n"; return 1; }
}  // namespace qmm::tool
