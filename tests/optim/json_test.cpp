// Checkpoint metadata JSON (lib/optim/json.h over nlohmann-json): the bounds and named errors the
// checkpoint loader relies on, and a param name JSON cannot hold refused before anything changes.
#include <chrono>
#include <string>

#include "../../lib/optim/json.h"
#include "test_util.h"
#include "swapopt/optim/adamw.h"

using namespace swapopt;

namespace {

std::string nested(int depth) { return std::string(size_t(depth), '[') + std::string(size_t(depth), ']'); }

}  // namespace

TEST_CASE("json: a dump parses back to the same bytes; keys are sorted") {
  const std::string text = R"({"a":[1,-2,0.5,1e+300,true,null,"x\"y\n"],"b":{"c":{}},"z":18446744073709551615})";
  CHECK(json::dump(json::parse(text), "x") == text);
  CHECK(json::parse(R"({"z":1,"a":2})").dump() == R"({"a":2,"z":1})");
}

TEST_CASE("json: nesting, duplicates, trailing bytes and overflow are named errors") {
  CHECK(json::parse(nested(64)).is_array());
  CHECK_THROWS_WITH_AS(json::parse(nested(65)), "[checkpoint] bad JSON: nesting deeper than 64 levels", Error);
  CHECK_THROWS_WITH_AS(json::parse(nested(100000)), "[checkpoint] bad JSON: nesting deeper than 64 levels", Error);
  CHECK_THROWS_WITH_AS(json::parse(R"({"a":1,"b":{"a":2,"a":3}})"), "[checkpoint] bad JSON: duplicate key 'a'", Error);
  CHECK(json::parse(R"([{"a":1},{"a":2}])").size() == 2);  // the same key in two objects is fine
  CHECK_THROWS_WITH_AS(json::parse("{} x"),
                       "[checkpoint] bad JSON at byte 3: syntax error while parsing value - invalid literal; last read: '{} x'; expected end of input",
                       Error);
  CHECK_THROWS_WITH_AS(json::parse(""), "[checkpoint] bad JSON at byte 0: syntax error while parsing value - unexpected end "
                                        "of input; expected '[', '{', or a literal", Error);
  CHECK_THROWS_WITH_AS(json::parse("[1e999]"), "[checkpoint] bad JSON: number overflow parsing '1e999'", Error);
  CHECK_THROWS_AS(json::parse("\"\xff\""), Error);  // not UTF-8
}

TEST_CASE("json: parsing is linear in the number of objects (a header of 200000 tensors in well under a second)") {
  std::string many = "[";
  for (int i = 0; i < 200000; ++i) many += i ? R"(,{"a":1})" : R"({"a":1})";
  many += "]";
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(json::parse(many).size() == 200000);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("200000 objects parsed in " << seconds << " s");
  CHECK(seconds < 5.0);  // quadratic (a parser callback in nlohmann 3.11) took minutes
}

TEST_CASE("json: writing text that is not UTF-8 is a named error") {
  json::Value v = json::Value::object({{"name", "bad\xff"}});
  CHECK_THROWS_WITH_AS(json::dump(v, "the header"), "[checkpoint] cannot write the header: invalid UTF-8 byte at index 3: 0xFF",
                       Error);
}

TEST_CASE("json: typed reads name the field") {
  const json::Value v = json::parse(R"({"n":5,"f":5.0,"h":5.5,"big":1e17,"u":18446744073709551615,"s":"x"})");
  CHECK(json::get_int(json::member(v, "n", "v"), "n") == 5);
  CHECK(json::get_int(json::member(v, "f", "v"), "f") == 5);
  CHECK_THROWS_WITH_AS(json::get_int(json::member(v, "h", "v"), "h"), "[checkpoint] metadata: h must be an integer", Error);
  CHECK_THROWS_WITH_AS(json::get_int(json::member(v, "big", "v"), "big"), "[checkpoint] metadata: big must be an integer",
                       Error);
  CHECK_THROWS_WITH_AS(json::get_int(json::member(v, "u", "v"), "u"), "[checkpoint] metadata: u must be an integer of 64 bits",
                       Error);
  CHECK_THROWS_WITH_AS(json::get_number(json::member(v, "s", "v"), "s"), "[checkpoint] metadata: s must be a number", Error);
  CHECK_THROWS_WITH_AS(json::member(v, "q", "the options"), "[checkpoint] metadata: the options has no 'q'", Error);
  CHECK_THROWS_WITH_AS(json::get_array(v, "v"), "[checkpoint] metadata: v must be an array", Error);
}

TEST_CASE("a param name that is not UTF-8 is refused by add_group, which changes nothing") {
  AdamW opt(Stream(Device::cpu()));
  opt.add_param_group({make_param("ok", test::random_tensor({4}, DType::f32, 1))});
  CHECK_FALSE(json::is_utf8("bad\xff"));
  CHECK(json::is_utf8("caf\xc3\xa9"));
  CHECK_THROWS_WITH_AS(opt.add_param_group({make_param("other", test::random_tensor({4}, DType::f32, 2)),
                                            make_param("bad\xff", test::random_tensor({4}, DType::f32, 3))}),
                       "[AdamW] parameter name 'bad\xff' is not valid UTF-8 (checkpoints store names as JSON text)", Error);
  CHECK(opt.param_groups().size() == 1);
  CHECK(opt.state_dict().metadata.find("\"param_names\":[\"ok\"]") != std::string::npos);
}
