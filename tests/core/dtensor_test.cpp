#include "test_util.h"

using namespace swapopt;

TEST_CASE("device mesh coordinates are row-major") {
  DeviceMesh mesh({2, 3}, {"replicate", "shard"}, 5);
  CHECK(mesh.size() == 6);
  CHECK(mesh.coordinate() == std::vector<int64_t>{1, 2});
  CHECK(mesh.rank_at({1, 2}) == 5);
  CHECK(mesh.dim_index("shard") == 1);
  CHECK_THROWS_WITH_AS(mesh.dim_index("tp"), "[DeviceMesh] no mesh dim named 'tp'", Error);
  CHECK_THROWS_WITH_AS(DeviceMesh({2, 2}, {"a", "b"}, 4), "[DeviceMesh] rank 4 outside mesh [2, 2]", Error);
  CHECK_THROWS_WITH_AS(DeviceMesh({int64_t(1) << 40, int64_t(1) << 40}, {"a", "b"}, 0),
                       "[DeviceMesh] a mesh [1099511627776, 1099511627776] has more ranks than an int64 counts", Error);
}

TEST_CASE("DTensor shards follow the chunk rule and to_local returns the shard") {
  // A [10, 6] matrix sharded on dim 0 over 4 ranks: chunks of 3, 3, 3, 1.
  for (int64_t rank = 0; rank < 4; ++rank) {
    auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{4}, std::vector<std::string>{"shard"}, rank);
    const int64_t rows = rank < 3 ? 3 : 1;
    Tensor local = Tensor::zeros({rows, 6}, DType::f32, Device::cpu());
    DTensor d(local, {10, 6}, mesh, {Placement::Shard(0)});
    CHECK(d.to_local().data_ptr() == local.data_ptr());
    CHECK(d.local_offset() == Shape{3 * rank, 0});
    CHECK(d.shard_dims() == std::vector<int64_t>{0});
  }
  auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{2, 2}, std::vector<std::string>{"replicate", "shard"}, 3);
  DTensor hsdp(Tensor::zeros({8, 3}, DType::f32, Device::cpu()), {8, 6}, mesh, {Placement::Replicate(), Placement::Shard(1)});
  CHECK(hsdp.replicate_dims() == std::vector<int64_t>{0});
  CHECK(hsdp.local_offset() == Shape{0, 3});
  CHECK(Placement::Shard(1).str() == "Shard(1)");
  CHECK_THROWS_WITH_AS(DTensor(Tensor::zeros({8, 4}, DType::f32, Device::cpu()), {8, 6}, mesh,
                               {Placement::Replicate(), Placement::Shard(1)}),
                       "[DTensor] local shard [8, 4] does not match [8, 3] expected for logical [8, 6] at rank 3", Error);
  CHECK_THROWS_WITH_AS(DTensor(Tensor(), {}, mesh, {Placement::Replicate(), Placement::Replicate()}),
                       "[DTensor] undefined local shard", Error);
  const std::vector<Placement> placements = {Placement::Replicate(), Placement::Shard(0)};
  CHECK_THROWS_WITH_AS(DTensor::local_shape_at({8, 6}, *mesh, placements, {1}),
                       "[DTensor] coordinate [1] for a 2-D mesh", Error);
  CHECK_THROWS_WITH_AS(DTensor::local_shape_at({8, 6}, *mesh, placements, {0, 2}),
                       "[DTensor] coordinate [0, 2] is outside the mesh [2, 2]", Error);
  CHECK_THROWS_WITH_AS(DTensor::local_shape_at({-8, 6}, *mesh, placements, {0, 1}),
                       "[DTensor] negative dim in logical shape [-8, 6]", Error);
  CHECK(DTensor::local_shape_at({8, 6}, *mesh, placements, {0, 1}) == Shape{4, 6});
}

TEST_CASE("meshes and DTensors refuse what they cannot count or name") {
  CHECK_THROWS_WITH_AS(DeviceMesh({2, 2}, {"a", "a"}, 0),
                       "[DeviceMesh] dim name 'a' is given twice: dims are found by name", Error);
  const DeviceMesh mesh({2}, {"shard"}, 1);
  CHECK_THROWS_WITH_AS(mesh.size(5), "[DeviceMesh] no mesh dim 5 (the mesh has 1 dim)", std::out_of_range);
  CHECK_THROWS_WITH_AS(mesh.size(-1), "[DeviceMesh] no mesh dim -1 (the mesh has 1 dim)", std::out_of_range);
  // The chunk rule at the largest extent: ceil(extent / 2) without overflow, the rest on rank 1.
  const int64_t big = std::numeric_limits<int64_t>::max();
  CHECK(DTensor::local_shape_at({big}, mesh, {Placement::Shard(0)}, {1}) == Shape{big - (int64_t(1) << 62)});
  CHECK(DTensor::local_shape_at({big}, mesh, {Placement::Shard(0)}, {0}) == Shape{int64_t(1) << 62});
  CHECK_THROWS_WITH_AS(DTensor::local_shape_at({big, 4}, mesh, {Placement::Shard(0)}, {1}),
                       "[DTensor] logical shape [9223372036854775807, 4] has more elements than an int64 counts",
                       Error);
}
