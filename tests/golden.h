#pragma once
// Reads the golden files written by scripts/reference/make_golden.py.

#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "test_util.h"

namespace swapopt::test {

/** name -> f32 CPU tensor. */
inline std::map<std::string, Tensor> read_golden(const std::string& file) {
  const std::string path = test_path(SWAPOPT_GOLDEN_DIR, "../../tests/golden") + "/" + file;
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  std::map<std::string, Tensor> out;
  std::string word, name;
  while (in >> word) {
    REQUIRE(word == "tensor");
    int ndim = 0;
    in >> name >> ndim;
    Shape shape(size_t(ndim), 0);
    for (int64_t& d : shape) in >> d;
    std::vector<float> values(size_t(shape_numel(shape)));
    for (float& v : values) in >> v;
    out.emplace(name, Tensor::from_floats(values, shape));
  }
  return out;
}

}  // namespace swapopt::test
