// weft::pipeline, the CPU part: tasks, schedules, thread maps, wait rules, the engine with its
// host backend, traces and JSON schedule configs. The CUDA backend is an opt-in include:
// weft/pipeline/cuda_backend.hpp (weft::cuda); the HSTU preset is weft/hstu/schedule.hpp.
#pragma once

#include "weft/pipeline/backend.hpp"
#include "weft/pipeline/batch.hpp"
#include "weft/pipeline/collective_inventory.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/engine.hpp"
#include "weft/pipeline/host_backend.hpp"
#include "weft/pipeline/schedule.hpp"
#include "weft/pipeline/schedule_config.hpp"
#include "weft/pipeline/step_rule.hpp"
#include "weft/pipeline/task.hpp"
#include "weft/pipeline/task_context.hpp"
#include "weft/pipeline/thread_map.hpp"
#include "weft/pipeline/trace.hpp"
#include "weft/pipeline/wait_edges.hpp"
