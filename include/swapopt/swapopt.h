#pragma once
/** Umbrella header: everything a trainer needs. */

#include "swapopt/core/allocator.h"
#include "swapopt/core/device.h"
#include "swapopt/core/device_mesh.h"
#include "swapopt/core/dtensor.h"
#include "swapopt/core/dtype.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"
#include "swapopt/core/placement.h"
#include "swapopt/core/storage.h"
#include "swapopt/core/stream.h"
#include "swapopt/core/tensor.h"
